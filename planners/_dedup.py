"""Deduplication of the ranks' local save plans on the coordinator: one writer per chunk and per object."""

from __future__ import annotations

import dataclasses
import zlib

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from smpckpt.errors import ReplicaMismatch, SpecError

__all__ = ["dedup_plans"]


def dedup_plans(plans: list[SavePlan]) -> list[SavePlan]:
    """(coordinator) ``plans`` with one writer per chunk and per object.

    Ranks that hold the same chunk (replicas the ownership choice could not keep apart, or pieces of
    an uneven split) must agree on its global shape, dtype and sizes; objects held by several ranks
    must be identical (per-rank values need rank-unique keys), and one holder, chosen by the key's
    CRC32, writes each."""
    chunk_owner: dict[MetadataIndex, tuple[int, WriteItem]] = {}
    object_holders: dict[str, list[tuple[int, str]]] = {}
    tensor_meta: dict[str, tuple[int, torch.Size, torch.dtype]] = {}
    for i, plan in enumerate(plans):
        objects = plan.planner_data["objects"]
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                object_holders.setdefault(fqn, []).append((i, objects[fqn]))
                continue
            td = item.tensor_data
            if td is None:
                raise SpecError(f"{fqn}: rank {i} planned a tensor item without tensor data")
            seen = tensor_meta.setdefault(fqn, (i, td.size, td.properties.dtype))
            if (seen[1], seen[2]) != (td.size, td.properties.dtype):
                raise SpecError(
                    f"{fqn}: rank {seen[0]} saves global shape {tuple(seen[1])} {seen[2]} but rank {i} saves "
                    f"{tuple(td.size)} {td.properties.dtype}; their specs or sizes disagree"
                )
            prior = chunk_owner.get(item.index)
            prior_td = prior[1].tensor_data if prior is not None else None
            if prior is not None and prior_td is not None and prior_td.chunk.sizes != td.chunk.sizes:
                raise SpecError(
                    f"{fqn}: ranks {prior[0]} and {i} both write a chunk at offset {tuple(td.chunk.offsets)} "
                    f"with sizes {tuple(prior_td.chunk.sizes)} and {tuple(td.chunk.sizes)}"
                )
            if prior is None:
                chunk_owner[item.index] = (i, item)
    object_owner: dict[str, int] = {}
    for fqn, holders in object_holders.items():
        digests = {d for _, d in holders}
        if len(digests) > 1:
            ranks = sorted({r for r, _ in holders})
            raise ReplicaMismatch(
                f"object {fqn!r} differs between ranks {ranks}: one key can hold one value. Give per-rank "
                "values rank-unique keys (e.g. f'...rank{rank}...') and list them in rank_local="
            )
        object_owner[fqn] = holders[zlib.crc32(fqn.encode()) % len(holders)][0]
    out = []
    for i, plan in enumerate(plans):
        kept = [
            item
            for item in plan.items
            if (item.type == WriteItemType.BYTE_IO and object_owner[item.index.fqn] == i)
            or (item.type != WriteItemType.BYTE_IO and chunk_owner[item.index][0] == i)
        ]
        out.append(dataclasses.replace(plan, items=kept))
    return out

"""The coordinator's checks of a save plan's structure (``ParallelSavePlanner.create_global_plan``), and
the digest each rank sends for them: spec rules that match nothing, ranks of a stage that disagree on
their tensors, parameters tied differently; then its deduplication of the ranks' plans (one writer per
chunk and per object). Values are compared in :mod:`._replica_values`."""

from __future__ import annotations

import dataclasses
import hashlib
import zlib
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from smpckpt.errors import ReplicaMismatch, SpecError
from smpckpt.model.layout import ParallelLayout
from smpckpt.model.specs import SpecRules
from smpckpt.planners._entries import Entry

__all__ = ["check_rules_apply", "check_replica_digests", "gather_ties", "replica_digest", "dedup_plans"]


def check_rules_apply(rules: SpecRules, plans: list[SavePlan]) -> None:
    """(coordinator) Spec rules of which no rank matched a single key are a mistake, never a choice: every TP
    shard they were meant for would be saved as a replica -- one rank's piece kept as the whole
    tensor (rules written for another key scheme, such as a missing ``model.`` prefix)."""
    if not rules or any((p.planner_data or {}).get("matched", 1) for p in plans):
        return
    shown = ", ".join(repr(p) for p in rules.patterns[:5])
    more = f" (and {len(rules.patterns) - 5} more)" if len(rules.patterns) > 5 else ""
    raise SpecError(
        f"none of the {len(rules.patterns)} spec rules matches a tensor of any rank: {shown}{more}. Rules are "
        "matched against the flattened keys (for save_checkpoint: 'model.<parameter name>' or the parameter "
        "name itself; 'optim.state.<parameter name>.<state>'); a rule that matches nothing would save every "
        "TP shard it was meant for as a replica"
    )


def check_replica_digests(layout: ParallelLayout, plans: list[SavePlan]) -> None:
    """(coordinator) The ranks of each stage sent one replica digest (:func:`replica_digest`)."""
    by_stage: dict[int, dict[tuple[int, str], list[int]]] = {}
    for plan in plans:
        rank = plan.planner_data["rank"]
        stage = layout.coords(rank).pp
        digest = tuple(plan.planner_data["digest"])
        by_stage.setdefault(stage, {}).setdefault(digest, []).append(rank)
    problems = []
    for stage, groups in sorted(by_stage.items()):
        if len(groups) > 1:
            parts = ", ".join(f"ranks {ranks} hold {count} such tensors" for (count, _), ranks in groups.items())
            problems.append(f"stage {stage}: {parts}")
    if problems:
        raise ReplicaMismatch(
            "ranks of one pipeline stage disagree on their replicated/sharded tensors (keys, dtypes, "
            f"global shapes or tied parameters): {'; '.join(problems)}. Each rank must hold the same keys "
            "and tie parameters alike; give per-rank values rank-unique keys and list them in rank_local=, "
            "and check the ShardSpec sizes."
        )


def gather_ties(plans: list[SavePlan]) -> dict[str, str]:
    """(coordinator) Every rank's tied keys, checked: a key is tied to one key by every rank that ties
    it, and no rank writes bytes of its own under a key another rank ties (its chunks would be missing
    from the checkpoint's other pieces)."""
    tied: dict[str, tuple[str, int]] = {}
    for i, plan in enumerate(plans):
        for alias, first in ((plan.planner_data or {}).get("tied") or {}).items():
            seen = tied.setdefault(alias, (first, i))
            if seen[0] != first:
                raise ReplicaMismatch(
                    f"{alias!r} is the tensor of {seen[0]!r} on rank {seen[1]} but of {first!r} on rank {i}: tie "
                    "parameters alike on every rank"
                )
    for i, plan in enumerate(plans):
        for item in plan.items:
            if item.index.fqn in tied:
                alias = item.index.fqn
                raise ReplicaMismatch(
                    f"{alias!r} is tied to {tied[alias][0]!r} (the same tensor) on rank {tied[alias][1]} but is a "
                    f"tensor of its own on rank {i}: tie (or untie) parameters alike on every rank"
                )
    return {alias: first for alias, (first, _) in tied.items()}


def replica_digest(shared: list[Entry], tied: Mapping[str, str]) -> tuple[int, str]:
    """Constant-size digest of the tensors every rank of this stage must agree on.

    Covers (key, dtype, global shape, split axes) of every non-rank-local plain tensor (``shared``), and
    the key each tied one is the tensor of. Ranks of a stage whose digests differ would disagree on who
    writes what -- silently losing data. Sorted by key, so ranks that built their state dicts in
    another order still agree.
    """
    rows = [(e.key, e.value.dtype, e.global_shape, e.sharded_axes) for e in shared]
    rows.sort()  # by key: keys are unique, so the other fields are never compared
    # one "key|dtype|shape|axes" line per tensor; the tail is shared by many keys, so format it once
    tails: dict[tuple[Any, ...], str] = {}
    parts: list[str] = []
    for key, dtype, shape, axes in rows:
        tail = tails.get((dtype, shape, axes))
        if tail is None:
            tail = tails[(dtype, shape, axes)] = f"|{dtype}|{tuple(shape or ())}|{sorted(axes)}\n"
        parts.append(key)
        parts.append(tail)
        if key in tied:
            parts.append(f"=|{tied[key]}\n")
    return len(rows), hashlib.sha1("".join(parts).encode()).hexdigest()


def dedup_plans(plans: list[SavePlan]) -> list[SavePlan]:
    """(coordinator) ``plans`` with one writer per chunk and per object.

    Ranks that hold the same chunk (replicas the ownership choice could not keep apart, or pieces of
    an uneven split) must agree on its global shape, dtype and sizes; objects held by several ranks
    must be identical (per-rank values need rank-unique keys), and one holder, chosen by the key's
    CRC32, writes each."""
    chunk_owner: dict[MetadataIndex, tuple[int, torch.Size]] = {}
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
            prior = chunk_owner.setdefault(item.index, (i, td.chunk.sizes))
            if prior[1] != td.chunk.sizes:
                raise SpecError(
                    f"{fqn}: ranks {prior[0]} and {i} both write a chunk at offset {tuple(td.chunk.offsets)} "
                    f"with sizes {tuple(prior[1])} and {tuple(td.chunk.sizes)}"
                )
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

    def owner(item: WriteItem) -> int:
        return object_owner[item.index.fqn] if item.type == WriteItemType.BYTE_IO else chunk_owner[item.index][0]

    return [dataclasses.replace(p, items=[it for it in p.items if owner(it) == i]) for i, p in enumerate(plans)]

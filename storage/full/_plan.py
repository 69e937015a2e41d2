"""Full (consolidated) mode, planning: where every rank's shard bytes land in the safetensors artifact.

The coordinator turns the global save plan into an artifact layout (which tensors go to which
``model*.safetensors`` file, every header, every offset) and gives each rank the *writes* for its own
shards: a box of an artifact tensor and where in the rank's chunk its data comes from; ranks write
straight into the shared files (``_write``). A :class:`~smpckpt.model.translation.Translation` maps our
keys to Hugging Face keys region by region (a fused QKV shard becomes boxes of ``c_attn.weight``
transposed, never assembled). Each write is cut into check units of about ``check_block`` bytes whose
xxh3 go into the generation's metadata.

``torch_save`` files are laid out by ``torch.save`` itself (:func:`_torch_file`; README, "Full checkpoints").
Record CRCs are what ``torch.save`` wrote under ``skip_data`` (nothing here computes them over the data);
integrity comes from the check units.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from smpckpt.errors import CheckpointError, SpecError
from smpckpt.hf import check_config_tensors, check_translation
from smpckpt.model.translation import Expr, Leaf, Translation, pieces
from smpckpt.storage.format._reading import Box
from smpckpt.storage.full import _source
from smpckpt.storage.full._source import (
    ArtifactFile,
    ArtifactLayout,
    FullWrite,
    Place,
    RankFullData,
    encode_header,
    leaf_keys,
)
from smpckpt.storage.full.options import FullOptions

__all__ = ["plan_artifact"]


def _cast(shape: Sequence[int], dtype: torch.dtype, to: torch.dtype | None) -> torch.dtype:
    """The export dtype of one tensor (``FullOptions.dtype``). Scalars (0-dim) are kept: optimizer counters
    and running products (Adam's ``step``) that a narrow float rounds (fp16 made step 70,001 inf); by
    shape, not name."""
    if to is None or not dtype.is_floating_point or len(shape) == 0:
        return dtype
    return to


_SAFE_OBJECT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$")


def plan_artifact(
    plans: Sequence[SavePlan],
    opts: FullOptions,
    save_id: str,
    original_shapes: Mapping[str, Sequence[int]],
    *,
    reserved_names: Sequence[str] = (),
    gather: bool = False,
) -> tuple[list[SavePlan], ArtifactLayout]:
    """(coordinator) The artifact layout and every rank's writes; raises naming the key at fault."""
    shapes, dtypes, object_items = _collect(plans)
    exprs, art_shapes, art_dtypes = _expressions(shapes, dtypes, opts, original_shapes)
    files, tensors, indexes = _files(art_shapes, art_dtypes, opts.max_shard_size, len(plans), opts.format)
    objects, rank_objects = _objects(object_items, {f.name for f in files} | set(indexes) | set(reserved_names))
    out = _rank_writes(plans, opts, save_id, exprs, art_shapes, tensors, rank_objects, files, gather)
    layout = ArtifactLayout(
        tuple(files),
        tensors,
        exprs,
        {fqn: _cast(shapes[fqn], d, opts.dtype) for fqn, d in dtypes.items()},
        objects,
        indexes,
    )
    return out, layout


def _collect(
    plans: Sequence[SavePlan],
) -> tuple[dict[str, tuple[int, ...]], dict[str, torch.dtype], list[tuple[int, MetadataIndex]]]:
    """Every tensor's global shape and dtype, and every object item, from all ranks' plans; every tensor's
    chunks must cover it exactly once (a hole would be zeros in the artifact, silently)."""
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, torch.dtype] = {}
    chunks: dict[str, list[Box]] = {}
    object_items: list[tuple[int, MetadataIndex]] = []
    for rank, plan in enumerate(plans):
        for it in plan.items:
            if it.type == WriteItemType.BYTE_IO or it.tensor_data is None:
                object_items.append((rank, it.index))
                continue
            fqn, td = it.index.fqn, it.tensor_data
            size = tuple(td.size)
            if (
                shapes.setdefault(fqn, size) != size
                or dtypes.setdefault(fqn, td.properties.dtype) != td.properties.dtype
            ):
                was, now = (shapes[fqn], dtypes[fqn]), (size, td.properties.dtype)
                raise SpecError(f"{fqn!r}: ranks disagree on its global shape or dtype ({was} vs {now}, rank {rank})")
            chunks.setdefault(fqn, []).append((tuple(td.chunk.offsets), tuple(td.chunk.sizes)))
    for fqn, shape in shapes.items():
        boxes = chunks[fqn]
        covered = sum(math.prod(s) for _, s in boxes)
        if covered != math.prod(shape):
            raise SpecError(
                f"{fqn!r}: the ranks' shards cover {covered} of its {math.prod(shape)} elements (global shape "
                f"{list(shape)}); a full artifact needs every element exactly once"
            )
        # in bounds + disjoint + the element count above = every element exactly once, at any chunk count
        for off, size in boxes:
            if (
                len(off) != len(shape)
                or len(size) != len(shape)
                or any(o < 0 or n < 0 or o + n > d for o, n, d in zip(off, size, shape))
            ):
                raise SpecError(f"{fqn!r}: shard at offsets {list(off)} sizes {list(size)} lies outside {list(shape)}")
        pair = _first_overlap(boxes, 0)
        if pair is not None:
            raise SpecError(f"{fqn!r}: shards at offsets {pair[0][0]} and {pair[1][0]} overlap")
    return shapes, dtypes, object_items


def _first_overlap(boxes: Sequence[Box], dim: int) -> tuple[Box, Box] | None:
    """Two of ``boxes`` (in bounds, all of one rank) that overlap, or ``None``: exact at any count.

    A sweep along ``dim``: two boxes overlap iff their ``dim`` ranges do and they overlap in the
    dimensions after it; at the later of their two starts both are live and one has just arrived,
    so checking the live set (recursively, one dimension on) whenever boxes arrive finds every overlap.
    Grid-like shardings (TP x DP) make each live set one band: O(n log n); the last dimension is
    a sort. Empty boxes overlap nothing (as in ``intersect``)."""
    boxes = [b for b in boxes if all(n > 0 for n in b[1])]
    if len(boxes) < 2:
        return None
    if not boxes[0][0]:  # 0-dim: any two chunks are the same element
        return boxes[0], boxes[1]
    boxes.sort(key=lambda b: b[0][dim])
    last = dim == len(boxes[0][0]) - 1
    live: list[Box] = []
    i = 0
    while i < len(boxes):
        at = boxes[i][0][dim]
        live = [b for b in live if b[0][dim] + b[1][dim] > at]
        while i < len(boxes) and boxes[i][0][dim] == at:
            live.append(boxes[i])
            i += 1
        if last:
            if len(live) > 1:  # ends are > at, starts <= at: all live ranges share ``at``
                return live[0], live[-1]
        elif len(live) > 1 and (pair := _first_overlap(live, dim + 1)) is not None:
            return pair
    return None


def _expressions(
    shapes: Mapping[str, tuple[int, ...]],
    dtypes: Mapping[str, torch.dtype],
    opts: FullOptions,
    original_shapes: Mapping[str, Sequence[int]],
) -> tuple[dict[str, tuple[str, Expr]], dict[str, dict[str, tuple[int, ...]]], dict[str, dict[str, torch.dtype]]]:
    """Which artifact each tensor goes to and the expression of its bytes over that artifact's tensors."""
    by_artifact: dict[str, dict[str, str]] = {}  # artifact -> our key inside it -> fqn
    for fqn in shapes:
        routed = opts.route(fqn)
        if routed is None:
            raise CheckpointError(
                f"tensor {fqn!r} matches none of the full artifact's key prefixes {sorted(opts.artifacts)}; "
                "leave it out of the state dict or add a prefix to FullOptions.artifacts"
            )
        art, key = routed
        if key in by_artifact.setdefault(art, {}):
            raise CheckpointError(f"tensors {by_artifact[art][key]!r} and {fqn!r} both map to {art}:{key!r}")
        by_artifact[art][key] = fqn
    exprs: dict[str, tuple[str, Expr]] = {}
    art_shapes: dict[str, dict[str, tuple[int, ...]]] = {}
    art_dtypes: dict[str, dict[str, torch.dtype]] = {}
    translated = _translated(by_artifact, shapes, opts.translation) if opts.translation is not None else {}
    # config.json must build a model holding exactly the biases written, with a translation or without
    written = (
        [k for _, a in translated.values() for k in a] if translated else [k for m in by_artifact.values() for k in m]
    )
    check_config_tensors(opts.translation, opts.hf_config, written)
    for art, members in by_artifact.items():
        ours = {key: shapes[fqn] for key, fqn in members.items()}
        if art in translated:
            key_exprs, a_shapes = translated[art]
        else:
            key_exprs, a_shapes = {k: Leaf(k) for k in ours}, {k: v for k, v in ours.items()}
        for key, fqn in members.items():
            expr = key_exprs[key]
            original = original_shapes.get(fqn)
            if isinstance(expr, Leaf) and expr.view is None and expr.perm is None and original is not None:
                original = tuple(int(s) for s in original)
                if math.prod(original) == math.prod(shapes[fqn]) and original != shapes[fqn]:
                    # stored in the shape the model holds it in (fused QKV [3h, d], not the view [3, h, d])
                    a_shapes[expr.key] = original
                    expr = Leaf(expr.key, view=shapes[fqn])
            exprs[fqn] = (art, expr)
            for leaf in leaf_keys(expr):
                art_dtypes.setdefault(art, {})[leaf] = _cast(shapes[fqn], dtypes[fqn], opts.dtype)
        art_shapes[art] = a_shapes

    return exprs, art_shapes, art_dtypes


def _translated(
    by_artifact: Mapping[str, Mapping[str, str]], shapes: Mapping[str, tuple[int, ...]], translation: Translation
) -> dict[str, tuple[dict[str, Expr], dict[str, tuple[int, ...]]]]:
    """Each artifact's expressions and shapes under ``translation``, once it is checked to fit the tensors (a
    wrong family's rules would change nothing and fail nowhere). Translated as one, so optimizer state
    follows its parameter where the translation sees the parameter."""
    joint = {key: shapes[fqn] for members in by_artifact.values() for key, fqn in members.items()}
    check_translation(translation, joint, "ours")
    groups = [list(by_artifact)]
    if len(joint) < sum(len(members) for members in by_artifact.values()):  # a key in two artifacts
        groups = [[art] for art in by_artifact]
    out: dict[str, tuple[dict[str, Expr], dict[str, tuple[int, ...]]]] = {}
    for arts in groups:
        ours = {key: shapes[fqn] for art in arts for key, fqn in by_artifact[art].items()}
        key_exprs, a_shapes = translation.to_artifact(ours)
        for art in arts:
            mine = {k: key_exprs[k] for k in by_artifact[art]}
            out[art] = (mine, {leaf: tuple(a_shapes[leaf]) for e in mine.values() for leaf in leaf_keys(e)})
    return out


#: header bytes besides the tensors' entries: braces, ``__metadata__`` and the padding to 8 bytes
_HEADER_SLACK = 4096


def _header_bound(key: str, dtype: torch.dtype, shape: Sequence[int], total: int) -> int:
    """At least the bytes ``key``'s entry takes in a safetensors header (its offsets are at most ``total``)."""
    # '"k":{"dtype":"F32","shape":[2,3],"data_offsets":[a,b]},' counted, not encoded (a million keys)
    shape_text = len(",".join(str(int(s)) for s in shape))
    return len(json.dumps(key)) + 44 + len(_source.DTYPE_NAMES.get(dtype, "")) + shape_text + 2 * len(str(total))


def _files(
    art_shapes: Mapping[str, Mapping[str, tuple[int, ...]]],
    art_dtypes: Mapping[str, Mapping[str, torch.dtype]],
    max_shard_size: int | str | None,
    world: int,
    file_format: str = "safetensors",
) -> tuple[list[ArtifactFile], dict[str, Place], dict[str, bytes]]:
    """Tensors in order, cut into files at ``max_shard_size``; headers, offsets and index files."""
    files: list[ArtifactFile] = []
    tensors: dict[str, Place] = {}
    indexes: dict[str, bytes] = {}
    for art in sorted(art_shapes):
        dtypes = art_dtypes.get(art, {})
        nbytes = {k: math.prod(shape) * dtypes[k].itemsize for k, shape in art_shapes[art].items() if k in dtypes}
        total = sum(nbytes.values())
        if max_shard_size is not None:
            cap = int(max_shard_size)  # bytes already (FullOptions parses it)
        else:  # Hugging Face's 5 GB, lowered so each rank can start on its own file (at most 2 x world)
            count = max(-(-total // (5 * 10**9)), min(2 * world, total // (256 << 20), 64), 1)  # integer ceilings
            cap = max(1, -(-total // count))
        groups: list[list[str]] = [[]]
        size = head = 0
        # a safetensors file is also cut before its header passes the readers' limit (MAX_HEADER, 100 MB:
        # about a million small tensors, an MoE's unfused experts); bytes alone made one file no reader opens
        head_cap = _source.MAX_HEADER - _HEADER_SLACK if file_format == "safetensors" else None
        for k, n in nbytes.items():
            h = _header_bound(k, dtypes[k], art_shapes[art][k], total) if head_cap is not None else 0
            if groups[-1] and (size + n > cap or (head_cap is not None and head + h > head_cap)):
                groups.append([])
                size = head = 0
            groups[-1].append(k)
            size += n
            head += h
        stem, ext = (art, "safetensors") if file_format == "safetensors" else (_TORCH_STEMS.get(art, art), "bin")
        names = (
            [f"{stem}.{ext}"]
            if len(groups) == 1
            else [f"{stem}-{i + 1:05d}-of-{len(groups):05d}.{ext}" for i in range(len(groups))]
        )
        weight_map: dict[str, str] = {}
        for name, keys in zip(names, groups):
            entries = [(k, art_dtypes[art][k], art_shapes[art][k]) for k in keys]
            if file_format == "torch_save":
                f = _torch_file(name, entries)
            else:
                header, placed = encode_header(entries, {"format": "pt", "writer": "smpckpt"})
                end = max([e.start + e.nbytes for e in placed], default=len(header))
                f = ArtifactFile(
                    name, ((0, header),), end, tuple(e.key for e in placed), tuple(e.start for e in placed)
                )
            files.append(f)
            for (k, dtype, shape), start in zip(entries, f.starts):
                tensors[f"{art}/{k}"] = (art, name, start, dtype, shape)
                weight_map[k] = name
        if len(groups) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            indexes[f"{stem}.{ext}.index.json"] = json.dumps(index, indent=2).encode("utf-8")

    return files, tensors, indexes


#: Hugging Face's torch.save file names (``pytorch_model.bin``); other artifacts keep their own stem
_TORCH_STEMS = MappingProxyType({"model": "pytorch_model"})


def _torch_file(name: str, entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> ArtifactFile:
    """The file ``torch.save({key: tensor})`` writes for these ``(key, dtype, shape)`` tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = {key: torch.empty(shape, dtype=dtype) for key, dtype, shape in entries}
    # saved under the file's own name in a temporary folder: torch.save names the archive inside (every
    # record's path) after the file, as ``torch.save(state, name)`` does; a random temporary name made every
    # export's bytes differ from the next one's and from torch.save's
    folder = tempfile.mkdtemp(prefix="smpckpt-torch-layout-")
    path = os.path.join(folder, name)
    try:
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(fake, path)
        size = os.path.getsize(path)
        reader: Any = torch._C.PyTorchFileReader(path)
        # torch.save numbers storages in pickling order; a dict pickles its values in insertion order
        starts = [int(reader.get_record_offset(f"data/{i}")) for i in range(len(entries))]
        del reader
        holes = sorted((s, s + math.prod(shape) * dtype.itemsize) for s, (_, dtype, shape) in zip(starts, entries))
        pieces = []
        with open(path, "rb") as f:
            pos = 0
            for lo, hi in holes + [(size, size)]:
                if lo > pos:
                    f.seek(pos)
                    pieces.append((pos, f.read(lo - pos)))
                pos = max(pos, hi)
        return ArtifactFile(name, tuple(pieces), size, tuple(k for k, _, _ in entries), tuple(starts))
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def _objects(
    object_items: Sequence[tuple[int, MetadataIndex]], taken: set[str]
) -> tuple[dict[str, str], dict[int, list[tuple[MetadataIndex, str]]]]:
    """One file per object value, named after its key where that is a safe plain name."""
    objects: dict[str, str] = {}
    rank_objects: dict[int, list[tuple[MetadataIndex, str]]] = {}
    for n, (rank, index) in enumerate(object_items):
        if index.fqn in objects:
            continue  # the same object from several ranks: the planner dedups; keep the first
        name = f"{index.fqn}.pt"
        if not _SAFE_OBJECT.match(index.fqn) or name in taken:
            name = f"object-{n:05d}.pt"
        taken.add(name)
        objects[index.fqn] = name
        rank_objects.setdefault(rank, []).append((index, name))

    return objects, rank_objects


def _rank_writes(
    plans: Sequence[SavePlan],
    opts: FullOptions,
    save_id: str,
    exprs: Mapping[str, tuple[str, Expr]],
    art_shapes: Mapping[str, Mapping[str, tuple[int, ...]]],
    tensors: Mapping[str, Place],
    rank_objects: Mapping[int, list[tuple[MetadataIndex, str]]],
    files: Sequence[ArtifactFile],
    gather: bool,
) -> list[SavePlan]:
    """Each rank's plan with its writes: the boxes of artifact tensors its chunks fill (gather mode: also
    every rank's boxes and the files, file ``i`` owned by rank ``i % world``, walked in one global order)."""
    per_rank: list[list[FullWrite]] = []
    for plan in plans:
        writes: list[FullWrite] = []
        for it in plan.items:
            if it.type == WriteItemType.BYTE_IO or it.tensor_data is None:
                continue
            fqn, td = it.index.fqn, it.tensor_data
            art, expr = exprs[fqn]
            for pc in pieces(expr, tuple(td.chunk.offsets), tuple(td.chunk.sizes), art_shapes[art]):
                _, file, start, dtype, _shape = tensors[f"{art}/{pc.key}"]
                box = (tuple(pc.view), tuple(pc.offsets), tuple(pc.sizes), tuple(pc.perm), tuple(pc.dest_offsets))
                writes.append(FullWrite(it.index, pc.key, file, start, *box, dtype))
        per_rank.append(writes)
    # gather mode: every rank's boxes, by rank (each tensor's owner receives them in this order)
    gathered = tuple((r, w) for r, ws in enumerate(per_rank) for w in ws) if gather else ()
    out: list[SavePlan] = []
    for rank, plan in enumerate(plans):
        data = RankFullData(
            save_id,
            rank,
            tuple(per_rank[rank]),
            tuple(rank_objects.get(rank, ())),
            opts.check_block,
            len(plans),
            gathered,
            tuple(files) if gather else (),
        )
        out.append(dataclasses.replace(plan, storage_data=data))
    return out

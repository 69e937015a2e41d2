"""Replicas checked by value: ranks that hold the same piece of a tensor must hold the same bytes.

Only one replica of a tensor is written (its owner's), so a rank whose "replica" differs loses its
values silently. Two mistakes produce exactly that, and no check of keys, dtypes or shapes sees them:

* a TP shard whose spec was forgotten (or whose rule matches no key) looks replicated: every TP rank
  holds a same-shaped piece under one key, and one rank's piece is stored as the whole tensor;
* two pipeline stages holding the same global key (a stage-local name the default ``layers.<i>``
  renaming does not reach): one stage's tensor is stored, the other's is gone.

Every rank sends, with its local plan, a 4-byte digest per tensor it holds (:func:`value_digests`) of a
fixed sample of its elements (:data:`SAMPLES` evenly spaced ones and the element count), in the key
order the replica digest uses; the first rank of each stage (tp=0, dp=0) also sends the keys and how
each is split. The coordinator compares, per stage and key, the ranks that hold the same piece (same
coordinates on the axes the key is split over), and each key two stages hold
(:func:`check_replica_values`). A sample is cheap (one ``take`` of 16 elements per tensor, one host
copy per device and dtype for all of them: ~4 us per tensor, ``benchmarks/bench_replica_values.py``)
and catches both mistakes, whose pieces differ nearly everywhere; it does not promise to see replicas
that drifted apart in a few elements (the written bytes are checksummed either way). What crosses
ranks is 4 bytes per tensor and rank, as one opaque ``bytes`` object (no Python object per tensor).

DTensors say by their placements which ranks hold the same piece, whatever the layout: each rank sends
12 bytes per DTensor piece (:func:`dtensor_values`: the piece's id and its value digest) and the
coordinator compares the ranks that sent the same piece. Samples are compared as values, not bits
(:func:`_canonical`: signed zeros are equal, and so are all NaNs).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
import xxhash

from smpckpt.errors import ReplicaMismatch
from smpckpt.model.layout import ParallelLayout

__all__ = ["SAMPLES", "value_digests", "dtensor_values", "piece_id", "stage_keys", "check_replica_values"]

#: elements sampled per tensor (evenly spaced, first and last included)
SAMPLES = 16
#: how a key's piece is placed: by nothing (replicated over the stage), by tp, by dp
_SPLIT_CODES = MappingProxyType({frozenset(): 0, frozenset({"tp"}): 1, frozenset({"dp"}): 2})
_SHOWN = 5


@functools.lru_cache(maxsize=4096)
def _indices(numel: int, device: int) -> torch.Tensor:
    """The sampled flat indices of a tensor of ``numel`` elements on CUDA ``device`` (-1: the CPU)."""
    # Integer arithmetic only: a float32 linspace rounds ``numel - 1`` up to ``numel`` above 2**24
    # elements (every 7B-class weight) and ``take`` then indexes past the end.
    last, steps = numel - 1, SAMPLES - 1
    idx = torch.tensor([(i * last + steps // 2) // steps for i in range(SAMPLES)], dtype=torch.int64)
    return idx if device < 0 else idx.to(f"cuda:{device}")


def value_digests(tensors: Sequence[torch.Tensor]) -> bytes:
    """One little-endian uint32 per tensor: xxh3 of its sampled elements' bytes, seeded with its element
    count. A meta tensor (no values: planning benchmarks plan with them) samples nothing.

    Every rank runs this over every tensor at every save, so the loop avoids what costs microseconds
    per tensor (``Tensor.device`` builds an object; ``get_device`` is a plain int)."""
    counts = [t.numel() for t in tensors]
    raw: list[memoryview] = [memoryview(b"")] * len(tensors)
    groups: dict[tuple[int, torch.dtype], list[tuple[int, torch.Tensor]]] = {}
    for i, (t, n) in enumerate(zip(tensors, counts)):
        if not n or t.is_meta:
            continue
        device = t.get_device()
        # take() reads a logical flat index of any strides: no copy of the tensor
        sample = torch.take(t, _indices(n, device)) if n > SAMPLES else t.reshape(-1)
        groups.setdefault((device, t.dtype), []).append((i, sample))
    for (device, _dtype), members in groups.items():
        # one join, one canonicalisation (and, on a GPU, one copy to the host) per device and dtype, not
        # one per tensor
        joined = _canonical(torch.cat([m for _, m in members])).reshape(-1).view(torch.uint8)
        view = (joined.cpu() if device >= 0 else joined).numpy().data
        size = len(view) // sum(m.numel() for _, m in members)  # bytes per sampled element, canonical
        pos = 0
        for i, m in members:
            n = m.numel() * size
            raw[i] = view[pos : pos + n]
            pos += n
    digest = xxhash.xxh3_64_intdigest
    return np.fromiter(
        (digest(b, seed=n) & 0xFFFFFFFF for b, n in zip(raw, counts)), dtype="<u4", count=len(tensors)
    ).tobytes()


#: floating dtypes compared in their own precision; the others (float8 variants) are widened to float32,
#: which holds each of their values exactly, because comparisons are not implemented for them
_COMPARABLE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _canonical(samples: torch.Tensor) -> torch.Tensor:
    """Samples as values, not bit patterns: ``-0.0`` becomes ``+0.0`` and every NaN one NaN.

    Replicas are compared by value, so two ranks that hold equal numbers are replicas even where their
    bits differ. Signed zeros compare equal (``-0.0 == 0.0``) and arise in replicas computed alike
    (``0 * -x`` on one rank, ``0 * x`` on another). NaN is never equal to itself, but a NaN held in the
    same place by two replicas is the same "not a number" for the checkpoint: its sign and payload
    bits carry no value (x86 writes ``0/0`` as a negative NaN, CUDA as a positive one; torch keeps no
    payload across arithmetic), so NaNs of any bits count as equal. Which replica's bits are stored
    is then unspecified, as it always was between equal replicas. Integers and booleans are their bits.
    """
    if samples.is_complex():
        samples = torch.view_as_real(samples)  # each part on its own: (-0.0, 1.0) == (0.0, 1.0)
    elif not samples.is_floating_point():
        return samples
    if samples.dtype not in _COMPARABLE:
        samples = samples.float()
    samples = torch.where(samples == 0, 0.0, samples)
    return torch.where(torch.isnan(samples), float("nan"), samples)


def stage_keys(keys: Sequence[str], splits: Sequence[frozenset[str]]) -> tuple[tuple[str, ...], bytes]:
    """What a stage's first rank sends: the keys, and a byte per key saying how its pieces are placed."""
    return tuple(keys), bytes(_SPLIT_CODES[s] for s in splits)


def piece_id(key: str, offsets: Sequence[int], sizes: Sequence[int]) -> int:
    """A 64-bit name for one piece of a global tensor: its key and its chunk's offsets and sizes."""
    return xxhash.xxh3_64_intdigest(f"{key}\0{tuple(offsets)}\0{tuple(sizes)}".encode())


def dtensor_values(pieces: Sequence[tuple[str, Sequence[int], Sequence[int], torch.Tensor]]) -> bytes:
    """What a rank sends for the DTensors it holds, given as (key, chunk offsets, chunk sizes, local
    tensor): per piece its :func:`piece_id` (8 bytes) then, after all of them, its value digest (4 bytes).

    A DTensor says by its placements, not by the layout, which ranks hold the same piece (every
    ``Replicate`` mesh dim, and every copy of a mesh that spans only part of the job, such as a TP mesh
    per data-parallel group): the coordinator groups ranks by the piece itself, so any mesh and any mix
    of ``Shard`` and ``Replicate`` is compared alike, without sending keys."""
    ids = np.fromiter((piece_id(k, o, s) for k, o, s, _ in pieces), dtype="<u8", count=len(pieces))
    return ids.tobytes() + value_digests([t for *_, t in pieces])


def _cause(code: int, ranks: list[int], layout: ParallelLayout) -> str:
    tps = {layout.coords(r).tp for r in ranks}
    if code in (0, 2) and len(tps) > 1:
        return (
            "tensor-parallel ranks hold different values under one key: most likely a TP shard without its "
            "ShardSpec (add a spec rule that matches this key), or per-rank values (give them rank-unique keys "
            "listed in rank_local=)"
        )
    return "data-parallel replicas hold different values: replicas that drifted apart"


def check_replica_values(fresh: Sequence[Any], structure: Sequence[Any], layout: ParallelLayout) -> None:
    """(coordinator) Compare the ranks' value digests; raise :class:`ReplicaMismatch` naming keys and ranks.

    ``fresh`` are this save's local plans (their ``planner_data["values"]``); ``structure`` the full local
    plans (cached ones substituted), whose stage leaders carry ``planner_data["value_keys"]``. Ranks
    that sent no digests (the check turned off) are skipped."""
    leaders: dict[int, tuple[tuple[str, ...], np.ndarray]] = {}
    for plan in structure:
        data = plan.planner_data or {}
        if data.get("value_keys") is not None:
            keys, codes = data["value_keys"]
            leaders[layout.coords(data["rank"]).pp] = (tuple(keys), np.frombuffer(codes, dtype=np.uint8))
    rows: dict[int, list[tuple[int, np.ndarray]]] = {}
    for rank, plan in enumerate(fresh):
        values = (plan.planner_data or {}).get("values")
        if values is not None:
            rows.setdefault(layout.coords(rank).pp, []).append((rank, np.frombuffer(values, dtype="<u4")))
    problems: list[str] = []
    first_rows: dict[int, tuple[int, np.ndarray]] = {}
    for stage, members in sorted(rows.items()):
        if stage not in leaders:
            continue
        keys, codes = leaders[stage]
        members = [(r, v) for r, v in members if len(v) == len(keys)]  # others failed the replica digest
        if not members:
            continue
        first_rows[stage] = members[0]
        for code in (0, 1, 2):
            cols = np.nonzero(codes == code)[0]
            if not len(cols):
                continue
            groups: dict[tuple[int, ...], list[tuple[int, np.ndarray]]] = {}
            for rank, v in members:  # ranks that hold the same piece: same coordinates on its split axes
                c = layout.coords(rank)
                groups.setdefault(() if code == 0 else (c.tp,) if code == 1 else (c.dp,), []).append((rank, v))
            for group in groups.values():
                base_rank, base = group[0]
                for rank, v in group[1:]:
                    bad = cols[v[cols] != base[cols]]
                    if len(bad):
                        shown = ", ".join(repr(keys[i]) for i in bad[:_SHOWN])
                        more = f" (and {len(bad) - _SHOWN} more)" if len(bad) > _SHOWN else ""
                        problems.append(
                            f"stage {stage}: ranks {base_rank} and {rank} hold different values of {shown}{more}: "
                            + _cause(code, [base_rank, rank], layout)
                        )
                        break
    problems.extend(_across_stages(leaders, first_rows))
    problems.extend(_dtensor_problems(fresh, structure))
    if problems:
        raise ReplicaMismatch(
            "ranks that must hold the same tensor piece hold different values, and only one of them would be "
            f"saved: {'; '.join(problems[:_SHOWN])}. (Checked on a sample of each tensor; pass "
            "verify_replicas=False only if replicas are meant to differ.)"
        )


def _across_stages(
    leaders: dict[int, tuple[tuple[str, ...], np.ndarray]], first_rows: dict[int, tuple[int, np.ndarray]]
) -> list[str]:
    """A global key two stages hold must hold one value: else a stage-local name was not renumbered."""
    seen: dict[str, tuple[int, int, int]] = {}  # key -> (stage, rank, digest) of its first holder
    problems: list[str] = []
    for stage, (rank, values) in sorted(first_rows.items()):
        keys = leaders[stage][0]
        for i, key in enumerate(keys):
            prior = seen.setdefault(key, (stage, rank, int(values[i])))
            if prior[0] != stage and prior[2] != int(values[i]):
                problems.append(
                    f"pipeline stages {prior[0]} and {stage} (ranks {prior[1]} and {rank}) both hold {key!r} with "
                    "different values: a stage-local key not renumbered to its global name (only a 'layers.<i>' "
                    "segment is renumbered by pp_layers; pass name_map= for other schemes)"
                )
    return problems


def _dtensor_problems(fresh: Sequence[Any], structure: Sequence[Any]) -> list[str]:
    """Ranks that sent the same DTensor piece (:func:`dtensor_values`) with different values.

    One vectorised pass over every rank's pieces (sorted by piece id, each compared with the first of
    its run); keys are looked up only for pieces that differ, among the items of the plans (the piece's
    writer lists it), so nothing per piece crosses ranks but its 12 bytes."""
    ids_parts, value_parts, rank_parts = [], [], []
    for rank, plan in enumerate(fresh):
        raw = (plan.planner_data or {}).get("dtensor_values")
        if not raw:
            continue
        n = len(raw) // 12
        ids_parts.append(np.frombuffer(raw, dtype="<u8", count=n))
        value_parts.append(np.frombuffer(raw, dtype="<u4", count=n, offset=8 * n))
        rank_parts.append(np.full(n, rank, dtype=np.int64))
    if len(ids_parts) < 2:
        return []
    order = np.argsort(np.concatenate(ids_parts), kind="stable")
    ids, values, ranks = (np.concatenate(a)[order] for a in (ids_parts, value_parts, rank_parts))
    starts = np.ones(len(ids), dtype=bool)
    starts[1:] = ids[1:] != ids[:-1]
    first = np.maximum.accumulate(np.where(starts, np.arange(len(ids)), 0))
    bad = np.nonzero(values != values[first])[0]
    if not len(bad):
        return []
    shown: dict[int, tuple[int, int]] = {}  # piece id -> (first rank, a rank that differs)
    for i in bad:
        if len(shown) == _SHOWN:
            break
        shown.setdefault(int(ids[i]), (int(ranks[first[i]]), int(ranks[i])))
    names = _piece_names(set(shown), structure)
    problems = []
    for pid, (a, b) in shown.items():
        what = names.get(pid, f"a DTensor piece (id {pid:#018x})")
        problems.append(
            f"ranks {a} and {b} hold different values of {what}: a DTensor's replicas (the ranks of its Replicate "
            "mesh dims, or of another copy of its mesh) must hold the same local values"
        )
    distinct = len(np.unique(ids[bad]))
    if distinct > len(shown):
        problems.append(f"(and {distinct - len(shown)} more DTensor pieces)")
    return problems


def _piece_names(wanted: set[int], structure: Sequence[Any]) -> dict[int, str]:
    """``DTensor 'key' piece at offsets (...)`` for the wanted piece ids, from the plans' write items."""
    names: dict[int, str] = {}
    for plan in structure:
        for item in getattr(plan, "items", ()):
            td = item.tensor_data
            if td is None:
                continue
            pid = piece_id(item.index.fqn, td.chunk.offsets, td.chunk.sizes)
            if pid in wanted and pid not in names:
                names[pid] = f"DTensor {item.index.fqn!r} piece at offsets {tuple(td.chunk.offsets)}"
                if len(names) == len(wanted):
                    return names
    return names

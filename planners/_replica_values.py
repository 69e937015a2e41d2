"""Replicas checked by value: ranks that hold the same piece of a tensor must hold the same bytes.

Only one replica of a tensor is written (its owner's), so a rank whose "replica" differs loses its
values silently. Two mistakes produce exactly that, and no check of keys, dtypes or shapes sees them:

* a TP shard whose spec was forgotten (or whose rule matches no key) looks replicated: every TP rank
  holds a same-shaped piece under one key, and one rank's piece is stored as the whole tensor;
* two pipeline stages holding the same global key (a stage-local name the default ``layers.<i>``
  renaming does not reach): one stage's tensor is stored, the other's is gone.

Every rank computes a 4-byte digest (:func:`~._value_digests.value_digests`: a fixed sample of
:data:`SAMPLES` elements and the element count, compared as values) of each tensor other ranks hold
too, in the key order the replica digest uses. Which tensors those are follows from the layout alone,
by how a key is split (:func:`checked_codes`): a key replicated over the stage when the stage has more
than one rank, a TP shard when dp > 1 (its DP replicas), a ZeRO shard when tp > 1; with pipeline
stages every replicated key, since two stages may hold one global key. A rank of a single-rank stage
computes nothing.

What crosses ranks stays small (:func:`rank_values`): every rank sends one 4-byte summary per split
code (a digest of its digests), and per-key digests only where they name keys: the first two ranks of
each group that holds one piece send theirs (:func:`detail_codes`), and the first rank of each stage
(tp=0, dp=0) sends every one, with the keys and how each is split, for the check across stages. At
4,096 ranks that is a few dozen per-key lists instead of 4,096. The coordinator compares summaries
within each group and, where two differ, the per-key digests of the two ranks -- naming the keys when
both sent theirs, else the ranks (:func:`check_replica_values`).

A sample catches both mistakes, whose pieces differ nearly everywhere; it does not promise to see
replicas that drifted apart in a few elements (the written bytes are checksummed either way).

DTensors say by their placements which ranks hold the same piece, whatever the layout: each rank sends
12 bytes per DTensor piece that other ranks may hold too (:func:`dtensor_values`: the piece's id and
its value digest; a piece no placement replicates is left out) and the coordinator compares the ranks
that sent the same piece.

Keys split over DP are compared across pipeline stages the same way, by piece (``stage_values``; the
save planner says which pieces), not through the stages' first ranks: a ZeRO-style piece is often empty
on DP rank 0, and two stages may put one tied tensor's state on different DP ranks.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
import xxhash
from torch.distributed.checkpoint.planner import SavePlan

from smpckpt.errors import ReplicaMismatch
from smpckpt.model.layout import KeyMapper, NameMap, ParallelLayout, RankCoords
from smpckpt.planners._entries import Entry
from smpckpt.planners._value_digests import SAMPLES, value_digests

__all__ = ["SAMPLES", "value_digests", "dtensor_values", "piece_id", "stage_keys", "check_replica_values"]
__all__ += ["checked_codes", "detail_codes", "rank_values", "split_code", "stage_values"]

#: how a key's piece is placed: by nothing (replicated over the stage), by tp, by dp
_SPLIT_CODES = MappingProxyType({frozenset(): 0, frozenset({"tp"}): 1, frozenset({"dp"}): 2})
_CODES = (0, 1, 2)
_DP_SPLIT = 2
_SHOWN = 5
#: bytes of a rank's summaries (one little-endian uint32 per split code) ahead of its per-key digests
_SUMMARY_BYTES = 4 * len(_CODES)


def split_code(axes: frozenset[str]) -> int:
    """A replicated key's split code: 0 replicated over the stage, 1 split over tp, 2 split over dp."""
    return _SPLIT_CODES[axes]


def _shared_codes(layout: ParallelLayout) -> tuple[int, ...]:
    """The split codes whose pieces more than one rank of a stage holds."""
    sizes = (layout.tp * layout.dp, layout.dp, layout.tp)  # ranks per group, by code
    return tuple(c for c in _CODES if sizes[c] > 1)


def checked_codes(layout: ParallelLayout) -> tuple[int, ...]:
    """The split codes whose keys every rank digests: those another rank of its stage holds too, and
    with pipeline stages all of them (two stages may hold one global key)."""
    return _CODES if layout.pp > 1 else _shared_codes(layout)


def _group(code: int, c: RankCoords) -> tuple[int, ...]:
    """Which group of ranks holding one piece (within a stage) a rank is in, for keys of ``code``."""
    return () if code == 0 else (c.tp,) if code == 1 else (c.dp,)


def _index_in_group(code: int, c: RankCoords, layout: ParallelLayout) -> int:
    """A rank's place among the ranks of its group, in rank order."""
    return c.tp + layout.tp * c.dp if code == 0 else c.dp if code == 1 else c.tp


def detail_codes(layout: ParallelLayout, rank: int) -> tuple[int, ...]:
    """The split codes a rank sends per-key digests of: where it is one of the first two ranks of its
    group (so a difference between those two is named key by key), and, with pipeline stages, every
    code from the first rank of each stage (compared key by key across stages)."""
    c = layout.coords(rank)
    if layout.pp > 1 and c.tp == 0 and c.dp == 0:
        return _CODES
    return tuple(code for code in _shared_codes(layout) if _index_in_group(code, c, layout) < 2)


def _summary(digests: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(digests.tobytes()) & 0xFFFFFFFF


def rank_values(layout: ParallelLayout, rank: int, tensors: Sequence[torch.Tensor], codes: bytes) -> bytes:
    """What a rank sends for its checked tensors (``codes``: each one's split code, in the order of
    the stage's key list): a summary per code, then the per-key digests of its :func:`detail_codes`."""
    code_of = np.frombuffer(codes, dtype=np.uint8)
    shared = _shared_codes(layout)
    detail = detail_codes(layout, rank)
    # Only the digests this rank sends are computed: those of the codes it summarises (shared within
    # its stage) or sends key by key. With pipeline stages every replicated key is on the stage's key
    # list (for the check across stages), but only the stage's first rank sends every code: a TP shard
    # held by one rank of its stage (dp=1) is digested there alone.
    needed = np.isin(code_of, np.asarray(sorted({*shared, *detail}), dtype=np.uint8))
    if needed.all():
        digests = np.frombuffer(value_digests(tensors), dtype="<u4")
    else:
        digests = np.zeros(len(code_of), dtype="<u4")
        at = np.nonzero(needed)[0]
        digests[at] = np.frombuffer(value_digests([tensors[i] for i in at.tolist()]), dtype="<u4")
    summaries = np.zeros(len(_CODES), dtype="<u4")
    for code in shared:
        summaries[code] = _summary(digests[code_of == code])
    keep = np.isin(code_of, np.asarray(detail, dtype=np.uint8))
    return summaries.tobytes() + digests[keep].tobytes()


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


def stage_values(
    layout: ParallelLayout, rank: int, name_map: NameMap | None, shared: Sequence[Any], tied: Mapping[str, str]
) -> bytes | None:
    """(pipeline stages) What a rank sends for its tensors split over DP that another stage may hold
    under the same global key: per piece its :func:`piece_id` and value digest, as :func:`dtensor_values`;
    ``None`` when there are none. ``shared``: the rank's plain tensor entries other ranks agree on.

    Why by piece, from every holder: a key split over DP (ZeRO-style optimizer state) often has empty
    pieces -- each tensor's state in one DP rank's range -- and two stages may legitimately place one
    tied tensor's state on different DP ranks. Pieces are compared where two stages hold the same one
    (the coordinator groups them by id, :func:`_stage_piece_problems`), so an empty piece compares
    nothing and a moved one refuses nothing; comparing the stages' first ranks would miss the first and
    refuse the second. Left out: empty pieces; a key split over DP alone on ranks other than TP rank 0
    (its TP replicas hold the same piece, compared within the stage); a key the ``layers.<i>`` rule
    renumbers (its global layer number is its stage's own: no other stage holds it)."""
    if layout.pp == 1:
        return None
    coords = layout.coords(rank)
    mapper = KeyMapper(layout, coords.pp, name_map)
    pieces = []
    for e in shared:
        axes, chunk = e.sharded_axes, e.chunk
        if "dp" not in axes or e.key in tied or chunk is None or 0 in chunk.sizes:
            continue
        if ("tp" not in axes and coords.tp != 0) or mapper.renumbers(e.local_key):
            continue
        pieces.append((e.key, chunk.offsets, chunk.sizes, e.value))
    return dtensor_values(pieces) if pieces else None


def _cause(code: int, ranks: list[int], layout: ParallelLayout) -> str:
    tps = {layout.coords(r).tp for r in ranks}
    if code in (0, 2) and len(tps) > 1:
        return (
            "tensor-parallel ranks hold different values under one key: most likely a TP shard without its "
            "ShardSpec (add a spec rule that matches this key), or per-rank values (give them rank-unique keys "
            "listed in rank_local=)"
        )
    return "data-parallel replicas hold different values: replicas that drifted apart"


@dataclasses.dataclass(frozen=True)
class _Row:
    """One rank's values, parsed: its summaries (by code) and its per-key digests (``None`` where it
    sent none), aligned with its stage's key list."""

    rank: int
    summaries: np.ndarray
    digests: np.ndarray
    detail: tuple[int, ...]


def _parse(layout: ParallelLayout, rank: int, values: bytes, codes: np.ndarray) -> _Row | None:
    """A rank's values against its stage's key list; ``None`` when they do not fit it (the rank holds
    other keys: the replica digest check names it)."""
    detail = detail_codes(layout, rank)
    keep = np.isin(codes, np.asarray(detail, dtype=np.uint8))
    if len(values) != _SUMMARY_BYTES + 4 * int(keep.sum()):
        return None
    digests = np.zeros(len(codes), dtype="<u4")
    digests[keep] = np.frombuffer(values, dtype="<u4", offset=_SUMMARY_BYTES)
    return _Row(rank, np.frombuffer(values, dtype="<u4", count=len(_CODES)), digests, detail)


_HOW = (
    "replicated over the stage",  # code 0
    "split over tp (their data-parallel replicas)",  # code 1
    "split over dp (their tensor-parallel replicas)",  # code 2
)


def check_replica_values(fresh: Sequence[Any], structure: Sequence[Any], layout: ParallelLayout) -> None:
    """(coordinator) Compare the ranks' value digests; raise :class:`ReplicaMismatch` naming keys and ranks.

    ``fresh`` are this save's local plans (their ``planner_data["values"]``, :func:`rank_values`);
    ``structure`` the full local plans (cached ones substituted), whose stage leaders carry
    ``planner_data["value_keys"]``. Ranks that sent no digests (the check turned off) are skipped."""
    leaders: dict[int, tuple[tuple[str, ...], np.ndarray]] = {}
    for plan in structure:
        data = plan.planner_data or {}
        if data.get("value_keys") is not None:
            keys, codes = data["value_keys"]
            leaders[layout.coords(data["rank"]).pp] = (tuple(keys), np.frombuffer(codes, dtype=np.uint8))
    rows: dict[int, list[_Row]] = {}
    for rank, plan in enumerate(fresh):
        values = (plan.planner_data or {}).get("values")
        stage = layout.coords(rank).pp
        if values is None or stage not in leaders:
            continue
        row = _parse(layout, rank, values, leaders[stage][1])
        if row is not None:
            rows.setdefault(stage, []).append(row)
    problems: list[str] = []
    first_rows: dict[int, _Row] = {}
    shared = _shared_codes(layout)
    for stage, members in sorted(rows.items()):
        if members[0].rank == layout.rank_of(pp=stage):
            first_rows[stage] = members[0]  # the stage's first rank: every key's digest
        problems.extend(_stage_problems(stage, members, leaders[stage], shared, layout))
    problems.extend(_across_stages(leaders, first_rows))
    problems.extend(_dtensor_problems(fresh, structure))
    problems.extend(_stage_piece_problems(fresh, structure, layout))
    if problems:
        more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
        raise ReplicaMismatch(
            "ranks that must hold the same tensor piece hold different values, and only one of them would be "
            f"saved: {'; '.join(problems[:_SHOWN])}{more}. (Checked on a sample of each tensor; pass "
            "verify_replicas=False only if replicas are meant to differ.)"
        )


def _stage_problems(
    stage: int,
    members: list[_Row],
    leader: tuple[tuple[str, ...], np.ndarray],
    shared: tuple[int, ...],
    layout: ParallelLayout,
) -> list[str]:
    """Within one stage, per split code: the ranks of each group holding one piece compared with the
    group's first rank, by summary; a difference named key by key where both ranks sent per-key digests."""
    keys, codes = leader
    problems: list[str] = []
    for code in shared:
        cols = np.nonzero(codes == code)[0]
        if not len(cols):
            continue
        groups: dict[tuple[int, ...], list[_Row]] = {}
        for row in members:  # ranks that hold the same piece: same coordinates on its split axes
            groups.setdefault(_group(code, layout.coords(row.rank)), []).append(row)
        for group in groups.values():
            base = group[0]
            for row in group[1:]:
                if row.summaries[code] == base.summaries[code]:
                    continue
                ranks = f"stage {stage}: ranks {base.rank} and {row.rank}"
                cause = _cause(code, [base.rank, row.rank], layout)
                if code in base.detail and code in row.detail:
                    bad = cols[row.digests[cols] != base.digests[cols]]
                    shown = ", ".join(repr(keys[i]) for i in bad[:_SHOWN])
                    more = f" (and {len(bad) - _SHOWN} more)" if len(bad) > _SHOWN else ""
                    problems.append(f"{ranks} hold different values of {shown}{more}: {cause}")
                else:
                    problems.append(
                        f"{ranks} hold different values of some of the {len(cols)} tensors {_HOW[code]} (keys "
                        "are named between the first two ranks of a group, which agree here): " + cause
                    )
                break
    return problems


def _across_stages(leaders: dict[int, tuple[tuple[str, ...], np.ndarray]], first_rows: dict[int, _Row]) -> list[str]:
    """A global key two stages hold must hold one value: else a stage-local name was not renumbered.
    Keys split over DP are left to :func:`_stage_piece_problems` (compared by piece)."""
    seen: dict[str, tuple[int, int, int]] = {}  # key -> (stage, rank, digest) of its first holder
    problems: list[str] = []
    for stage, row in sorted(first_rows.items()):
        rank, values = row.rank, row.digests
        keys, codes = leaders[stage]
        for i, key in enumerate(keys):
            if codes[i] == _DP_SPLIT:
                continue
            prior = seen.setdefault(key, (stage, rank, int(values[i])))
            if prior[0] != stage and prior[2] != int(values[i]):
                problems.append(
                    f"pipeline stages {prior[0]} and {stage} (ranks {prior[1]} and {rank}) both hold {key!r} with "
                    "different values: a stage-local key not renumbered to its global name (only a 'layers.<i>' "
                    "segment is renumbered by pp_layers; pass name_map= for other schemes)"
                )
    return problems


def _differing_pieces(fresh: Sequence[Any], field: str) -> tuple[dict[int, tuple[int, int]], int]:
    """Ranks that sent the same piece (``planner_data[field]``, :func:`dtensor_values`' format) with
    different values: up to :data:`_SHOWN` piece ids -> (the first rank that sent it, a rank that differs),
    and how many pieces differ in all.

    One vectorised pass over every rank's pieces (sorted by piece id, each compared with the first of
    its run), so nothing per piece crosses ranks but its 12 bytes."""
    ids_parts, value_parts, rank_parts = [], [], []
    for rank, plan in enumerate(fresh):
        raw = (plan.planner_data or {}).get(field)
        if not raw:
            continue
        n = len(raw) // 12
        ids_parts.append(np.frombuffer(raw, dtype="<u8", count=n))
        value_parts.append(np.frombuffer(raw, dtype="<u4", count=n, offset=8 * n))
        rank_parts.append(np.full(n, rank, dtype=np.int64))
    if len(ids_parts) < 2:
        return {}, 0
    order = np.argsort(np.concatenate(ids_parts), kind="stable")
    ids, values, ranks = (np.concatenate(a)[order] for a in (ids_parts, value_parts, rank_parts))
    starts = np.ones(len(ids), dtype=bool)
    starts[1:] = ids[1:] != ids[:-1]
    first = np.maximum.accumulate(np.where(starts, np.arange(len(ids)), 0))
    bad = np.nonzero(values != values[first])[0]
    if not len(bad):
        return {}, 0
    shown: dict[int, tuple[int, int]] = {}
    for i in bad:
        if len(shown) == _SHOWN:
            break
        shown.setdefault(int(ids[i]), (int(ranks[first[i]]), int(ranks[i])))
    return shown, len(np.unique(ids[bad]))


def _dtensor_problems(fresh: Sequence[Any], structure: Sequence[Any]) -> list[str]:
    """Ranks that sent the same DTensor piece (:func:`dtensor_values`) with different values; keys are
    looked up only for pieces that differ, among the items of the plans (the piece's writer lists it)."""
    shown, distinct = _differing_pieces(fresh, "dtensor_values")
    if not shown:
        return []
    names = _piece_names(set(shown), structure)
    problems = []
    for pid, (a, b) in shown.items():
        what = names.get(pid, f"a DTensor piece (id {pid:#018x})")
        problems.append(
            f"ranks {a} and {b} hold different values of {what}: a DTensor's replicas (the ranks of its Replicate "
            "mesh dims, or of another copy of its mesh) must hold the same local values"
        )
    if distinct > len(shown):
        problems.append(f"(and {distinct - len(shown)} more DTensor pieces)")
    return problems


def _stage_piece_problems(fresh: Sequence[Any], structure: Sequence[Any], layout: ParallelLayout) -> list[str]:
    """Pipeline stages that hold the same piece of a key split over DP (``stage_values``) with different
    values: a stage-local key not renumbered to its global name (one stage's values would be dropped)."""
    shown, distinct = _differing_pieces(fresh, "stage_values")
    if not shown:
        return []
    names = _piece_names(set(shown), structure, "")
    problems = []
    for pid, (a, b) in shown.items():
        what = names.get(pid, f"a piece (id {pid:#018x}) of a tensor split over data parallelism")
        problems.append(
            f"pipeline stages {layout.coords(a).pp} and {layout.coords(b).pp} (ranks {a} and {b}) both hold {what} "
            "with different values: a stage-local key not renumbered to its global name (only a 'layers.<i>' "
            "segment is renumbered by pp_layers; pass name_map= for other schemes)"
        )
    if distinct > len(shown):
        problems.append(f"(and {distinct - len(shown)} more pieces held by several stages)")
    return problems


def _piece_names(wanted: set[int], structure: Sequence[Any], kind: str = "DTensor ") -> dict[int, str]:
    """``DTensor 'key' piece at offsets (...)`` for the wanted piece ids, from the plans' write items."""
    names: dict[int, str] = {}
    for plan in structure:
        for item in getattr(plan, "items", ()):
            td = item.tensor_data
            if td is None:
                continue
            pid = piece_id(item.index.fqn, td.chunk.offsets, td.chunk.sizes)
            if pid in wanted and pid not in names:
                names[pid] = f"{kind}{item.index.fqn!r} piece at offsets {tuple(td.chunk.offsets)}"
                if len(names) == len(wanted):
                    return names
    return names


def check_duplicate_writers(writers: dict[Any, list[int]], rank_local: Any) -> None:
    """(coordinator) Refuse a rank-local tensor that several ranks plan to write under one key: the global
    plan keeps one writer per chunk, so the other ranks' values would be dropped without a word (a
    rank-local key must be unique per rank).

    ``writers``: each chunk (``MetadataIndex``) several ranks plan, with their ranks (empty chunks of
    uneven splits left out); ``rank_local`` the compiled ``rank_local`` globs (or ``None``).

    Not refused here: a key split over DP that several pipeline stages hold under one global key. It is
    what a tied embedding's optimizer state under a distributed optimizer looks like (legitimate, equal
    values), and also what a stage-local key saved without a name map looks like (different values, one
    stage's dropped): the value check tells them apart by piece (:func:`_stage_piece_problems`)."""
    if rank_local is None:
        return
    for index, ranks in writers.items():
        if rank_local.fullmatch(index.fqn):
            raise ReplicaMismatch(
                f"{index.fqn}: ranks {sorted(ranks)} each hold it as rank-local, under one key: only one rank's "
                f"value of the chunk at offset {tuple(index.offset or ())} would be written. A rank-local key "
                "must be unique per rank (e.g. f'...rank{rank}')"
            )


def undigestable(tensors: Iterable[tuple[str, Any]], exc: BaseException) -> BaseException:
    """The error for a tensor whose values the replica check cannot sample (a packed or quantized dtype):
    named by its key, with the way out; ``exc`` itself when no single tensor is at fault."""
    for key, value in tensors:
        if not isinstance(value, torch.Tensor):
            continue
        try:
            value_digests([value.to_local() if hasattr(value, "to_local") else value])
        except (RuntimeError, NotImplementedError, TypeError) as one:
            why = (str(one).splitlines() or [""])[0][:200]  # torch's dispatcher lists every backend after it
            return TypeError(
                f"{key}: the replica value check cannot sample a {value.dtype} tensor ({why}); save with "
                "verify_replicas=False (SaveOptions(verify_replicas=False) through save_checkpoint or a "
                "Checkpointer), or hold this tensor on one rank only"
            )
    return exc


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

"""Replicas: who writes each (:func:`assign_owners`), and a check by value that ranks holding the same
piece of a tensor hold the same bytes (what and why: the README's "Every global chunk is written exactly
once" and "Replica checks").

Owners: every rank of a stage runs the same greedy assignment over its replicated tensors, so the ranks
agree on one owner per tensor without exchanging anything. A replica group (:func:`replica_range`) is, by
the axes a tensor is split over: nothing, the whole stage; ``tp``, the DP ranks of one TP coordinate;
``dp``, the TP ranks of one DP coordinate; both, the rank alone. The stage-wide tensors are balanced
first, then each smaller group's from those loads (a rank never needs sizes outside its own groups).

Values: each rank digests (:func:`~._value_digests.value_digests`) the tensors other ranks hold too
(:func:`checked_codes`) and sends little (:func:`rank_values`: summaries per split code, per-key digests
from the first two ranks of each group, :func:`detail_codes`, and each stage's first rank); the
coordinator compares them (:func:`check_replica_values`). DTensors (:func:`dtensor_values`) and keys split
over TP or DP across pipeline stages (:func:`stage_values`) are compared by piece, grouped by its id."""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import operator
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
import xxhash
from torch.distributed.checkpoint.planner import SavePlan

from smpckpt.errors import ReplicaMismatch
from smpckpt.model.layout import KeyMapper, NameMap, ParallelLayout
from smpckpt.planners._entries import Entry
from smpckpt.planners._key_notes import stage_differences
from smpckpt.planners._value_digests import SAMPLES, undigestable, value_digests

__all__ = ["SAMPLES", "value_digests", "dtensor_values", "piece_id", "stage_keys", "check_replica_values"]
__all__ += ["checked_codes", "detail_codes", "rank_values", "SPLIT_CODES", "stage_values", "check_tie_groups"]
__all__ += ["assign_owners", "replica_range", "KEYS_WAY", "RANK_WAY", "check_held", "undigestable"]
RANK_WAY = "listed in rank_local="  #: the refusals' way out for a planner's caller (the API names its own)
KEYS_WAY = f"give per-rank values rank-unique keys {RANK_WAY}, and list keys only some ranks hold in held_by_some="

#: how a key's piece is placed, by split code: by nothing (replicated over the stage), by tp, by dp
_AXES: tuple[frozenset[str], ...] = (frozenset(), frozenset({"tp"}), frozenset({"dp"}))
#: a replicated key's split code: 0 replicated over the stage, 1 split over tp, 2 split over dp
SPLIT_CODES = MappingProxyType({axes: code for code, axes in enumerate(_AXES)})
_CODES = (0, 1, 2)
_SHOWN = 5
#: bytes of a rank's summaries (one little-endian uint32 per split code) ahead of its per-key digests
_SUMMARY_BYTES = 4 * len(_CODES)


def _shared_codes(layout: ParallelLayout) -> tuple[int, ...]:
    """The split codes whose pieces more than one rank of a stage holds."""
    sizes = (layout.tp * layout.dp, layout.dp, layout.tp)  # ranks per group, by code
    return tuple(c for c in _CODES if sizes[c] > 1)


def checked_codes(layout: ParallelLayout) -> tuple[int, ...]:
    """The split codes whose keys every rank digests: those another rank of its stage holds too, and
    with pipeline stages all of them (two stages may hold one global key)."""
    return _CODES if layout.pp > 1 else _shared_codes(layout)


def detail_codes(layout: ParallelLayout, rank: int) -> tuple[int, ...]:
    """The split codes a rank sends per-key digests of: where it is one of the first two ranks of its
    group (so a difference between those two is named key by key), and, with pipeline stages, every
    code from the first rank of each stage (compared key by key across stages)."""
    c = layout.coords(rank)
    if layout.pp > 1 and c.tp == 0 and c.dp == 0:
        return _CODES
    return tuple(code for code in _shared_codes(layout) if replica_range(layout, rank, _AXES[code]).index(rank) < 2)


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
    return tuple(keys), bytes(SPLIT_CODES[s] for s in splits)


def piece_id(key: str, offsets: Sequence[int], sizes: Sequence[int]) -> int:
    """A 64-bit name for one piece of a global tensor: its key and its chunk's offsets and sizes."""
    return xxhash.xxh3_64_intdigest(f"{key}\0{tuple(offsets)}\0{tuple(sizes)}".encode())


def dtensor_values(pieces: Sequence[tuple[str, Sequence[int], Sequence[int], torch.Tensor]]) -> bytes:
    """What a rank sends for the DTensors it holds, given as (key, chunk offsets, chunk sizes, local
    tensor): per piece its :func:`piece_id` (8 bytes) then, after all of them, its value digest (4 bytes).
    A DTensor's placements, not the layout, say which ranks hold the same piece (a ``Replicate`` mesh
    dim, each copy of a mesh spanning part of the job): the coordinator groups ranks by the piece itself,
    so any mesh and any mix of ``Shard`` and ``Replicate`` is compared alike, without sending keys."""
    ids = np.fromiter((piece_id(k, o, s) for k, o, s, _ in pieces), dtype="<u8", count=len(pieces))
    return ids.tobytes() + value_digests([t for *_, t in pieces])


def stage_values(
    layout: ParallelLayout, rank: int, name_map: NameMap | None, shared: Sequence[Any], tied: Mapping[str, str]
) -> bytes | None:
    """(pipeline stages) What a rank sends for its tensors split over TP or DP that another stage may hold
    under the same global key: per piece its :func:`piece_id` and value digest, as :func:`dtensor_values`;
    ``None`` when there are none. ``shared``: the rank's plain tensor entries other ranks agree on.

    By piece, from every holder: such a key's pieces are often empty (ZeRO-style state lies in one DP
    rank's range), two stages may place one tied tensor's state on different DP ranks, and comparing the
    stages' first ranks would see TP rank 0's piece of a shared embedding alone (hunt62a). Left out: empty
    pieces; a key split over one axis alone on ranks other than the first of the other (its replicas
    there hold the same piece, compared within the stage); a key the ``layers.<i>`` rule renumbers."""
    if layout.pp == 1:
        return None
    coords = layout.coords(rank)
    mapper = KeyMapper(layout, coords.pp, name_map)
    pieces = []
    for e in shared:
        axes, chunk = e.sharded_axes, e.chunk
        if not axes or e.key in tied or chunk is None or 0 in chunk.sizes:
            continue
        if any(a not in axes and getattr(coords, a) for a in ("tp", "dp")) or mapper.renumbers(e.local_key):
            continue
        pieces.append((e.key, chunk.offsets, chunk.sizes, e.value))
    return dtensor_values(pieces) if pieces else None


def _cause(code: int, ranks: list[int], layout: ParallelLayout) -> str:
    tps = {layout.coords(r).tp for r in ranks}
    if code in (0, 2) and len(tps) > 1:
        return (
            "tensor-parallel ranks hold different values under one key: most likely a TP shard without its "
            "ShardSpec (add a spec rule that matches this key), or per-rank values (give them rank-unique keys "
            f"{RANK_WAY})"
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
            "verify_replicas=False only if replicas are meant to differ: one rank's values are saved then. "
            "BatchNorm statistics differ per rank unless SyncBatchNorm, or DDP's buffer sync with every rank of "
            "its group in the save, makes them one.)"
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
        groups: dict[int, list[_Row]] = {}  # by the group's first rank
        for row in members:  # ranks that hold the same piece: same coordinates on its split axes
            groups.setdefault(replica_range(layout, row.rank, _AXES[code]).start, []).append(row)
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


#: why two pipeline stages hold one global key with different values
_STAGE_CAUSE = (
    "a stage-local key not renumbered to its global name (only a 'layers.<i>' segment is renumbered by "
    "pp_layers; pass name_map= for other schemes), or two copies of one shared tensor (an embedding the first "
    "and last stage both hold) that drifted apart (their gradients not all-reduced)"
)


def _across_stages(leaders: dict[int, tuple[tuple[str, ...], np.ndarray]], first_rows: dict[int, _Row]) -> list[str]:
    """A global key two stages hold must hold one value: else a stage-local name was not renumbered.
    Keys split over TP or DP are left to :func:`_stage_piece_problems` (compared by piece)."""
    seen: dict[str, tuple[int, int, int]] = {}  # key -> (stage, rank, digest) of its first holder
    problems: list[str] = []
    for stage, row in sorted(first_rows.items()):
        rank, values = row.rank, row.digests
        keys, codes = leaders[stage]
        for i, key in enumerate(keys):
            if codes[i]:  # split: compared by piece
                continue
            prior = seen.setdefault(key, (stage, rank, int(values[i])))
            if prior[0] != stage and prior[2] != int(values[i]):
                problems.append(
                    f"pipeline stages {prior[0]} and {stage} (ranks {prior[1]} and {rank}) both hold {key!r} with "
                    "different values: " + _STAGE_CAUSE
                )
    return problems


def _differing_pieces(
    fresh: Sequence[Any], structure: Sequence[Any], field: str, kind: str, unnamed: str
) -> list[tuple[str, int, int]]:
    """Ranks that sent the same piece (``planner_data[field]``, :func:`dtensor_values`' format) with
    different values: up to :data:`_SHOWN` of (the piece, named ``<kind>'key' piece at offsets (...)``
    from the plans' write items, else ``unnamed``; the first rank that sent it; a rank that differs),
    then, when more pieces differ, ``("", n, 0)`` for the ``n`` others (one vectorised pass, sorted by
    piece id)."""
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
        return []
    order = np.argsort(np.concatenate(ids_parts), kind="stable")
    ids, values, ranks = (np.concatenate(a)[order] for a in (ids_parts, value_parts, rank_parts))
    starts = np.ones(len(ids), dtype=bool)
    starts[1:] = ids[1:] != ids[:-1]
    first = np.maximum.accumulate(np.where(starts, np.arange(len(ids)), 0))
    bad = np.nonzero(values != values[first])[0]
    shown: dict[int, tuple[int, int]] = {}
    for i in bad:
        if len(shown) == _SHOWN:
            break
        shown.setdefault(int(ids[i]), (int(ranks[first[i]]), int(ranks[i])))
    names: dict[int, str] = {}  # keys looked up only for the pieces that differ (the writer lists each)
    for item in (item for plan in structure for item in getattr(plan, "items", ())) if shown else ():
        td = item.tensor_data
        if td is not None and (pid := piece_id(item.index.fqn, td.chunk.offsets, td.chunk.sizes)) in shown:
            names.setdefault(pid, f"{kind}{item.index.fqn!r} piece at offsets {tuple(td.chunk.offsets)}")
    found = [(names.get(pid, unnamed.format(pid)), a, b) for pid, (a, b) in shown.items()]
    more = len(np.unique(ids[bad])) - len(shown)
    return found + [("", more, 0)] if more else found


def _dtensor_problems(fresh: Sequence[Any], structure: Sequence[Any]) -> list[str]:
    """Ranks that sent the same DTensor piece (:func:`dtensor_values`) with different values."""
    return [
        f"ranks {a} and {b} hold different values of {what}: a DTensor's replicas (the ranks of its Replicate "
        "mesh dims, or of another copy of its mesh) must hold the same local values"
        if what
        else f"(and {a} more DTensor pieces)"
        for what, a, b in _differing_pieces(
            fresh, structure, "dtensor_values", "DTensor ", "a DTensor piece (id {:#018x})"
        )
    ]


def _stage_piece_problems(fresh: Sequence[Any], structure: Sequence[Any], layout: ParallelLayout) -> list[str]:
    """Pipeline stages that hold the same piece of a key split over TP or DP (``stage_values``) with different
    values (one stage's values would be dropped): see :data:`_STAGE_CAUSE`."""
    return [
        f"pipeline stages {layout.coords(a).pp} and {layout.coords(b).pp} (ranks {a} and {b}) both hold {what} "
        "with different values: " + _STAGE_CAUSE
        if what
        else f"(and {a} more pieces held by several stages)"
        for what, a, b in _differing_pieces(
            fresh, structure, "stage_values", "", "a piece (id {:#018x}) of a split tensor"
        )
    ]


def check_duplicate_writers(writers: dict[Any, list[int]], rank_local: Any) -> None:
    """(coordinator) Refuse a rank-local tensor that several ranks plan to write under one key: the global
    plan keeps one writer per chunk, so the other ranks' values would be dropped without a word (a
    rank-local key must be unique per rank).

    ``writers``: each chunk (``MetadataIndex``) several ranks plan, with their ranks (empty chunks of
    uneven splits left out); ``rank_local`` the compiled ``rank_local`` globs (or ``None``). Not refused
    here: a key split over DP that several stages hold under one global key -- a tied embedding's
    distributed optimizer state (equal values) or a stage-local key saved without a name map (not):
    the value check tells them apart by piece (:func:`_stage_piece_problems`)."""
    if rank_local is None:
        return
    for index, ranks in writers.items():
        if rank_local.fullmatch(index.fqn):
            raise ReplicaMismatch(
                f"{index.fqn}: ranks {sorted(ranks)} each hold it as rank-local, under one key: only one rank's "
                f"value of the chunk at offset {tuple(index.offset or ())} would be written. A rank-local key "
                "must be unique per rank (e.g. f'...rank{rank}')"
            )


def check_replica_digests(layout: ParallelLayout, plans: list[SavePlan]) -> None:
    """(coordinator) The ranks of each stage sent one replica digest (:func:`replica_digest`), and agree per
    replica group on the ties it leaves out (:func:`check_tie_groups`)."""
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
            members = {r for ranks in groups.values() for r in ranks}
            problems.append(f"stage {stage}: {parts}{stage_differences(plans, members)}")
    if problems:
        raise ReplicaMismatch(
            "ranks of one pipeline stage disagree on their replicated/sharded tensors (keys, dtypes, "
            f"global shapes or tied parameters): {'; '.join(problems)}. Each rank must hold the same keys "
            f"and tie parameters alike; {KEYS_WAY} (copies of each other, as experts under their global ids; "
            "MoE experts stacked into one tensor need neither: ShardSpec(0, axis='dp', sizes=...) on the stack). "
            "A split into uneven pieces needs ShardSpec(sizes=) (without it each rank takes its piece's "
            "extent times the degree as the global one), and a rank holding no piece of a split tensor (a "
            "ZeRO rank owning none of a parameter) must still hold its keys: an empty piece (0 in sizes=) "
            "and the 0-d step."
        )
    check_tie_groups(layout, plans)


def check_tie_groups(layout: ParallelLayout, plans: list[SavePlan]) -> None:
    """(coordinator) A tied key split over TP or DP (``planner_data["tie_axes"]``) is tied alike by every
    rank of its replica group: they hold the same piece, with values (an empty piece ties nothing, so a
    rank tying it holds values), and would otherwise plan that piece's writer differently (a group not
    tying it writes it, :func:`~._entries.gather_ties` refusing). Ranks of other groups may hold empty
    pieces of it: they neither make nor deny the tie."""
    tying: dict[tuple[str, int], dict[int, str]] = {}  # (key, group's first rank) -> rank -> key tied to
    groups: dict[tuple[str, int], range] = {}
    for plan in plans:
        data = plan.planner_data
        for alias, axes in (data.get("tie_axes") or {}).items():
            group = replica_range(layout, data["rank"], frozenset(axes))
            tying.setdefault((alias, group.start), {})[data["rank"]] = data["tied"][alias]
            groups[(alias, group.start)] = group
    for (alias, start), ranks in sorted(tying.items()):
        apart = [r for r in groups[(alias, start)] if r not in ranks]
        if apart:
            firsts = sorted(set(ranks.values()))
            raise ReplicaMismatch(
                f"{alias!r} is tied to {' or '.join(map(repr, firsts))} (the same tensor) on ranks {sorted(ranks)} "
                f"but is a tensor of its own on ranks {apart}, which hold the same piece of it: tie (or untie) "
                "parameters alike on every rank holding values of them"
            )


def replica_digest(shared: list[Entry], tied: Mapping[str, str]) -> tuple[int, str]:
    """Constant-size digest of (key, dtype, global shape, split axes) of every non-rank-local plain
    tensor (``shared``) and of the ties of keys not split, sorted by key: ranks of a stage whose digests
    differ would disagree on who writes what, silently losing data. A key split over TP or DP may be an
    empty piece on some ranks (an uneven split), which shows no tie: its ties are agreed by the ranks
    holding its values (:func:`check_tie_groups`). A tie is split when either key is: a key not split tied to
    a split one's piece is no tie a save keeps (``_entries.saved_ties``), so a tie here whose key is not
    split has a first key not split either."""
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
        if key in tied and not axes:
            parts.append(f"=|{tied[key]}\n")
    return len(rows), hashlib.sha1("".join(parts).encode()).hexdigest()


# -- owners ---------------------------------------------------------------------------------------------


def replica_range(layout: ParallelLayout, rank: int, sharded_axes: frozenset[str]) -> range:
    """Ranks holding the same piece as ``rank`` for a tensor split over ``sharded_axes``, ascending (the
    rank order makes each group an arithmetic progression)."""
    c = layout.coords(rank)
    if "tp" in sharded_axes and "dp" in sharded_axes:
        return range(rank, rank + 1)
    if "tp" in sharded_axes:  # the DP ranks of this TP coordinate: stride tp
        first = layout.rank_of(tp=c.tp, dp=0, pp=c.pp)
        return range(first, first + layout.tp * layout.dp, layout.tp)
    if "dp" in sharded_axes:  # the TP ranks of this DP coordinate: consecutive
        first = layout.rank_of(tp=0, dp=c.dp, pp=c.pp)
        return range(first, first + layout.tp)
    first = layout.rank_of(tp=0, dp=0, pp=c.pp)  # the whole stage
    return range(first, first + layout.tp * layout.dp)


_KEY = operator.itemgetter(0)
_NBYTES = operator.itemgetter(1)


def _lpt(items: Sequence[tuple[str, int]], members: range, loads: dict[int, int]) -> dict[str, int]:
    """Greedy largest-first (by bytes, then key): each item to the member with the least load, the lowest
    rank among equals (``min(members, key=lambda r: (loads.get(r, 0), r))`` per item). Members holding
    nothing are one cursor over ``members``; loaded ones a heap of ``(load, rank)``. ``loads`` is
    updated in place."""
    owners: dict[str, int] = {}
    if len(members) == 1:  # a group of one (e.g. TP-split tensors at DP=1): no choice, no sort
        only = members[0]
        owners = dict.fromkeys((key for key, _ in items), only)
        loads[only] = loads.get(only, 0) + sum(nbytes for _, nbytes in items)
        return owners
    # by bytes descending, then key ascending: two stable sorts on C-level keys (no tuple per item)
    order = sorted(items, key=_KEY)
    order.sort(key=_NBYTES, reverse=True)  # reverse keeps equal items in their (key) order
    heap = [(load, r) for r, load in loads.items() if r in members]
    heapq.heapify(heap)
    loaded = {r for _, r in heap}
    cursor = 0  # index into members of the lowest member with no load entry yet

    for key, nbytes in order:
        while cursor < len(members) and members[cursor] in loaded:
            cursor += 1
        fresh = members[cursor] if cursor < len(members) else None
        if fresh is not None and not (heap and heap[0] < (0, fresh)):
            owner = fresh
            loaded.add(owner)
            heapq.heappush(heap, (nbytes, owner))
        else:  # no fresh member left means every member is loaded: the heap holds them all
            load, owner = heap[0]
            heapq.heapreplace(heap, (load + nbytes, owner))
        owners[key] = owner
        loads[owner] = loads.get(owner, 0) + nbytes
    return owners


def assign_owners(
    layout: ParallelLayout,
    rank: int,
    replicated: Iterable[tuple[str, int, frozenset[str]]],
    *,
    lowest_rank: bool = False,
) -> dict[str, int]:
    """Owner rank of each ``(key, nbytes, sharded_axes)`` tensor this rank holds as a replica;
    ``lowest_rank=True`` puts each on the lowest rank of its group instead of spreading bytes."""
    by_axes: dict[frozenset[str], list[tuple[str, int]]] = {}
    groups: dict[frozenset[str], list[tuple[str, int]]] = {}  # by the axes as given: a few distinct sets
    for key, nbytes, axes in replicated:
        group = groups.get(axes)
        if group is None:
            group = groups[axes] = by_axes.setdefault(frozenset(axes) - {"pp"}, [])
        group.append((key, nbytes))
    owners: dict[str, int] = {}
    stage_loads: dict[int, int] = {}
    for axes in _AXES:  # the stage-wide tensors first, then each smaller group's from those loads
        items = by_axes.pop(axes, [])
        if not items:
            continue
        members = replica_range(layout, rank, axes)
        loads = stage_loads if not axes else dict(stage_loads)
        owners.update(_lpt(items, members[:1] if lowest_rank else members, loads))
    for items in by_axes.values():  # split over every axis: nothing to share
        owners.update({key: rank for key, _ in items})
    return owners


def _ranks(ranks: list[int]) -> str:
    return f"ranks {sorted(ranks)[:8]}" + (f" (and {len(ranks) - 8} more)" if len(ranks) > 8 else "")


def replica_differences(layout: ParallelLayout, seen: Sequence[Mapping[str, str]], shown: int = 5) -> str:
    """(failure path, every rank) The keys whose dtype or global shape (``seen``: each rank's, by key; ranks
    holding equal lists may share one object) differ between the ranks of a stage, or that some of its ranks
    lack, each with its ranks (at most 8 named)."""
    stages: dict[int, dict[int, list[int]]] = {}  # stage -> one list's id -> the ranks holding it
    for rank in range(len(seen)):
        stages.setdefault(layout.coords(rank).pp, {}).setdefault(id(seen[rank]), []).append(rank)
    lines = []
    for _, holders in sorted(stages.items()):
        if len(holders) < 2:
            continue
        for key in sorted(set().union(*(seen[rs[0]] for rs in holders.values()))):
            views: dict[str, list[int]] = {}
            for rs in holders.values():
                views.setdefault(seen[rs[0]].get(key, "absent"), []).extend(rs)
            if len(views) > 1:
                lines.append(f"{key!r}: " + ", ".join(f"{v} on {_ranks(rs)}" for v, rs in views.items()))
    more = f" ... ({len(lines) - shown} more)" if len(lines) > shown else ""
    return f"Differing: {'; '.join(lines[:shown])}{more}." if lines else ""


def check_held(fresh: list[SavePlan], structure: list[SavePlan]) -> None:
    """(coordinator) The ranks holding a ``held_by_some`` key (``held_values``) hold copies of it."""
    found = _differing_pieces(fresh, structure, "held_values", "", "a piece (id {:#018x}) of a held_by_some key")
    if found:
        shown = "; ".join(f"ranks {a} and {b} differ on {what}" if what else f"(and {a} more)" for what, a, b in found)
        raise ReplicaMismatch(
            f"ranks holding a held_by_some key hold different values of it, and only one copy would be saved: "
            f"{shown}. Its holders (DP ranks of one expert) must hold copies (checked on a sample of each tensor, "
            "verify_replicas or not); a held key is saved whole, so a TP-split expert cannot be held"
        )

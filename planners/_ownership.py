"""Who writes each replicated tensor: a deterministic, byte-balanced choice every replica computes alike.

Each rank runs the same greedy largest-first assignment over the replicated tensors of its pipeline
stage, so the ranks agree on one owner per tensor without exchanging anything, and each rank's local
plan carries only what it writes. The coordinator then gathers unique shards, not world-size copies.

Replica groups, by the axes a tensor is split over (within one pipeline stage):

* split over nothing: every TP x DP rank of the stage holds it;
* split over ``tp``: the DP ranks with the same TP coordinate;
* split over ``dp``: the TP ranks with the same DP coordinate;
* split over both: the rank alone.

Ranks first balance the stage-wide replicated tensors over the whole stage, then each smaller group
balances its tensors starting from those loads. That keeps the decision local: a rank never needs the
sizes of tensors outside its own groups.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from smpckpt.layout import ParallelLayout

__all__ = ["assign_owners", "replica_group"]


def replica_group(layout: ParallelLayout, rank: int, sharded_axes: frozenset[str]) -> list[int]:
    """Ranks holding the same piece as ``rank`` for a tensor split over ``sharded_axes``."""
    c = layout.coords(rank)
    tps = [c.tp] if "tp" in sharded_axes else range(layout.tp)
    dps = [c.dp] if "dp" in sharded_axes else range(layout.dp)
    return sorted(layout.rank_of(tp=t, dp=d, pp=c.pp) for t in tps for d in dps)


def _lpt(
    items: Sequence[tuple[str, int]], members: Sequence[int], loads: dict[int, int], lowest: bool
) -> dict[str, int]:
    owners: dict[str, int] = {}
    for key, nbytes in sorted(items, key=lambda kv: (-kv[1], kv[0])):
        owner = members[0] if lowest else min(members, key=lambda r: (loads.get(r, 0), r))
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
    """Owner rank of each ``(key, nbytes, sharded_axes)`` tensor this rank holds as a replica.

    ``lowest_rank=True`` puts every replica on the lowest rank of its group (fewer files to read on
    load, less balance) instead of spreading bytes.
    """
    by_axes: dict[frozenset[str], list[tuple[str, int]]] = {}
    for key, nbytes, axes in replicated:
        by_axes.setdefault(frozenset(axes) - {"pp"}, []).append((key, nbytes))
    owners: dict[str, int] = {}
    stage_loads: dict[int, int] = {}
    order = [frozenset(), frozenset({"tp"}), frozenset({"dp"})]
    for axes in order:
        items = by_axes.pop(axes, [])
        if not items:
            continue
        members = replica_group(layout, rank, axes)
        loads = stage_loads if not axes else dict(stage_loads)
        owners.update(_lpt(items, members, loads, lowest_rank))
    for items in by_axes.values():  # split over every axis: nothing to share
        owners.update({key: rank for key, _ in items})
    return owners

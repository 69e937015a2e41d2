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

The rule: tensors in descending ``(bytes, then key ascending)`` order each go to the group member with
the least bytes so far, the lowest rank among equals. Every rank plans at every save, so the cost must
not grow with the world: a group is a ``range`` of ranks (the rank order makes each one an arithmetic
progression), and the greedy step keeps only the members that already hold something in a heap -- at
most one per tensor -- next to the lowest member that holds nothing yet. Time O(n log n) for n tensors,
whatever the group's size.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Iterable, Sequence

from smpckpt.model.layout import ParallelLayout

__all__ = ["assign_owners", "replica_group", "replica_range"]


def replica_range(layout: ParallelLayout, rank: int, sharded_axes: frozenset[str]) -> range:
    """Ranks holding the same piece as ``rank`` for a tensor split over ``sharded_axes``, ascending.

    With ``rank = tp_rank + tp * (dp_rank + dp * pp_rank)`` each group is a ``range``: O(1) to build and
    to test membership in, however many ranks it spans.
    """
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


def replica_group(layout: ParallelLayout, rank: int, sharded_axes: frozenset[str]) -> list[int]:
    """:func:`replica_range` as a list (for tools and tests; planning uses the range itself)."""
    return list(replica_range(layout, rank, sharded_axes))


_KEY = operator.itemgetter(0)
_NBYTES = operator.itemgetter(1)


def _lpt(items: Sequence[tuple[str, int]], members: range, loads: dict[int, int]) -> dict[str, int]:
    """Greedy largest-first: each item to the member with the least load, the lowest rank among equals.

    Equal to ``min(members, key=lambda r: (loads.get(r, 0), r))`` per item, without visiting members
    that hold nothing: among those (load 0) the lowest rank wins, so one cursor over ``members``
    skipping the loaded ones stands for all of them, and the loaded ones (a heap of ``(load, rank)``)
    number at most ``len(loads) + len(items)``. ``loads`` is updated in place, as before.
    """
    owners: dict[str, int] = {}
    if len(members) == 1:  # a group of one (e.g. TP-split tensors at DP=1): no choice, no sort
        only = members[0]
        owners = dict.fromkeys((key for key, _ in items), only)
        loads[only] = loads.get(only, 0) + sum(nbytes for _, nbytes in items)
        return owners
    # by bytes descending, then key ascending: two stable sorts on C-level keys (a lambda building a
    # tuple per item cost ~1 us each); the first is linear on the key-ordered items the planner passes
    order = sorted(items, key=_KEY)
    order.sort(key=_NBYTES, reverse=True)  # reverse keeps equal items in their (key) order
    heap = [(load, r) for r, load in loads.items() if r in members]
    if not heap and len(order) <= len(members) and all(nbytes > 0 for _, nbytes in order):
        # A large group with nothing loaded yet (the usual case at scale): each tensor finds a member
        # holding nothing (load 0) below every loaded one, so the i-th largest goes to the i-th member.
        for (key, nbytes), owner in zip(order, members):
            owners[key] = owner
            loads[owner] = nbytes
        return owners
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
    """Owner rank of each ``(key, nbytes, sharded_axes)`` tensor this rank holds as a replica.

    ``lowest_rank=True`` puts every replica on the lowest rank of its group (fewer files to read on
    load, less balance) instead of spreading bytes.
    """
    by_axes: dict[frozenset[str], list[tuple[str, int]]] = {}
    groups: dict[frozenset[str], list[tuple[str, int]]] = {}  # by the axes as given: a few distinct sets
    for key, nbytes, axes in replicated:
        group = groups.get(axes)
        if group is None:
            group = groups[axes] = by_axes.setdefault(frozenset(axes) - {"pp"}, [])
        group.append((key, nbytes))
    owners: dict[str, int] = {}
    stage_loads: dict[int, int] = {}
    order = [frozenset(), frozenset({"tp"}), frozenset({"dp"})]
    for axes in order:
        items = by_axes.pop(axes, [])
        if not items:
            continue
        members = replica_range(layout, rank, axes)
        loads = stage_loads if not axes else dict(stage_loads)
        owners.update(_lpt(items, members[:1] if lowest_rank else members, loads))
    for items in by_axes.values():  # split over every axis: nothing to share
        owners.update({key: rank for key, _ in items})
    return owners

"""Loads into destinations that share memory without being one view (:class:`SharedMemoryLoads`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Set

import torch
from torch.distributed.checkpoint.planner import ReadItem

from smpckpt.errors import LayoutMismatch
from smpckpt.planners._entries import Entry, same_bits

__all__ = ["SharedMemoryLoads"]


def _extent_end(v: torch.Tensor) -> int:
    """The address one past a non-empty tensor's last byte (strides are never negative: the extent ends
    at the last element's end)."""
    if v.is_contiguous():
        return v.data_ptr() + v.nbytes
    return v.data_ptr() + (sum((n - 1) * st for n, st in zip(v.shape, v.stride())) + 1) * v.element_size()


class SharedMemoryLoads:
    """One load's destinations that share memory without being one view (``base[0:4]`` and ``base[2:6]``
    under two keys; tied keys, the same view, are :class:`TiedLoads`'): written one after another, the
    last would silently overwrite the others where they overlap. Each is read into scratch instead, and
    once all of a group are in they are copied into their destinations in state-dict order and each
    destination must then hold its own value, bit for bit (a buffer viewing part of a parameter, saved
    from such a model, loads as saved); otherwise :class:`LayoutMismatch` names the keys."""

    def __init__(self) -> None:
        #: key of a destination in such a group -> that destination (its entry reads into scratch)
        self.dest: dict[str, torch.Tensor] = {}
        self._scratch: dict[str, torch.Tensor] = {}
        self._groups: list[list[str]] = []
        self._pending: dict[str, int] = {}  # elements of each key still to be read
        self._read: set[str] = set()  # keys with reads (the others keep their values)

    def plan(self, entries: Mapping[str, Entry], skip: Set[str]) -> None:
        """Find the groups among ``entries`` (less ``skip``: tied keys loaded through another key, or
        compared in scratch) by a sweep over their byte extents, addresses rather than storages (two
        storages over one memory are found too; interleaved views whose extents overlap though no
        element does take the scratch path needlessly but correctly)."""
        self.dest, self._scratch, self._groups, self._pending = {}, {}, [], {}
        spans: list[tuple[int, int, str]] = []
        for e in entries.values():
            if e.kind == "object" or e.chunk is None or e.key in skip:
                continue
            v = e.value
            if not v.numel():
                continue
            start, stop = v.data_ptr(), _extent_end(v)
            if start and stop > start:  # address 0: no storage (meta, ZeroTensor), which nothing shares
                spans.append((start, stop, e.key))
        order = {key: i for i, key in enumerate(entries)}
        for group in _overlapping(spans):
            # the same addresses on two devices are no shared memory: each device's keys swept apart
            by_device: dict[torch.device, list[tuple[int, int, str]]] = {}
            for span in group:
                by_device.setdefault(entries[span[2]].value.device, []).append(span)
            for row in by_device.values():
                for found in _overlapping(row) if len(by_device) > 1 else [row]:
                    self._groups.append(sorted((key for _, _, key in found), key=order.__getitem__))
        self.dest = {key: entries[key].value for group in self._groups for key in group}

    def scratch(self, entry: Entry) -> Entry:
        """The entry of a key in a group, reading into a scratch tensor of its shape instead."""
        value = self._scratch[entry.key] = torch.empty_like(entry.value)
        return dataclasses.replace(entry, value=value)

    def count(self, items: list[ReadItem]) -> None:
        """(after the local plan) The elements each key waits for. A key nothing is read for (missing
        from the checkpoint, optional) keeps its value: its scratch holds that, to be checked too."""
        self._pending = dict.fromkeys(self.dest, 0)
        for item in items:
            if item.dest_index.fqn in self._pending:
                self._pending[item.dest_index.fqn] += math.prod(item.lengths)
        self._read = {key for key, left in self._pending.items() if left}
        for key, left in self._pending.items():
            if not left:
                self._scratch.setdefault(key, torch.empty_like(self.dest[key])).copy_(self.dest[key])

    def _covered(self, group: list[str]) -> set[str]:
        """The keys of ``group`` not read whose every byte a read key writes (a buffer viewing part of a
        weight, resumed from a checkpoint saved before the buffer existed): they have no saved value and
        cannot keep their old one, so they follow the memory they view, as a view does."""
        unread = [k for k in group if k not in self._read]
        if not unread:
            return set()
        views = [self.dest[k] for k in group]
        lo, hi = min(v.data_ptr() for v in views), max(_extent_end(v) for v in views)
        written = torch.zeros(hi - lo, dtype=torch.uint8, device=views[0].device)

        def bytes_of(v: torch.Tensor) -> torch.Tensor:
            size = v.element_size()
            return written.as_strided((*v.shape, size), (*(st * size for st in v.stride()), 1), v.data_ptr() - lo)

        for key in group:
            if key in self._read:
                bytes_of(self.dest[key]).fill_(1)
        return {k for k in unread if bool(bytes_of(self.dest[k]).all())}

    def committed(self, item: ReadItem, entries: Mapping[str, Entry], rank: int) -> None:
        """(reader) One read is in: write and check each group whose reads are all in."""
        fqn = item.dest_index.fqn
        if fqn not in self._pending:
            return
        self._pending[fqn] -= math.prod(item.lengths)
        if self._pending[fqn]:
            return
        for group in self._groups:
            if fqn not in group or any(self._pending[k] for k in group):
                continue
            for key in group:
                if key in self._read:  # a key not read keeps its value: its scratch is only to check
                    self.dest[key].copy_(self._scratch[key])
            covered = self._covered(group)  # keys not read that read keys overwrite whole: views of them
            bad = [k for k in group if k not in covered and not same_bits(self.dest[k], self._scratch[k])]
            if bad:
                unread = [k for k in group if k not in self._read]
                raise LayoutMismatch(
                    f"rank {rank}: {', '.join(map(repr, group))} are destinations that share memory (overlapping "
                    "views of one storage, not the same view), but their saved values disagree where they "
                    f"overlap: once all are written, {', '.join(map(repr, bad))} would not hold "
                    + ("its" if len(bad) == 1 else "their")
                    + " saved value"
                    + (f" ({', '.join(map(repr, unread))}: not in the checkpoint, so its value kept)" if unread else "")
                    + ". Load them into tensors of their own, or from a checkpoint saved from a model whose "
                    "views share this memory"
                )


def _overlapping(spans: list[tuple[int, int, str]]) -> list[list[tuple[int, int, str]]]:
    """The groups of two or more byte extents ``[start, stop)`` (key last) that overlap, by a sweep in
    address order: an extent starting before every extent so far has ended joins their group."""
    groups: list[list[tuple[int, int, str]]] = []
    group: list[tuple[int, int, str]] = []
    end = -1
    for span in sorted(spans):
        if span[0] < end:
            group.append(span)
            end = max(end, span[1])
            continue
        if len(group) > 1:
            groups.append(group)
        group, end = [span], span[1]
    if len(group) > 1:
        groups.append(group)
    return groups

"""Tied keys on load: one tensor under several keys (transformers ties ``lm_head.weight`` to the input
embedding), in the destination, in the checkpoint, or both.

* Keys tied in the destination are one tensor: it is loaded once, through the first key the checkpoint
  holds (directly, or stored tied to another key); the others count as loaded.
* A destination key the checkpoint stores tied to another (our record of the save, or a Hugging Face
  folder that leaves the head out) is read from that key's bytes.
* A checkpoint may hold the keys of one destination tensor *apart* (an untied model's files, a
  pipeline's last stage's own head). A tied model holds one value, so they must be equal: the others
  are read into scratch tensors and compared bit for bit with the key loaded once both are in, and a
  difference fails the load naming both keys -- unless the caller says which to keep (``keep_tied``
  globs): that key is loaded, the others are not read.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.planner import ReadItem

from smpckpt.errors import LayoutMismatch
from smpckpt.planners._entries import Entry

__all__ = ["TiedLoads"]


class TiedLoads:
    """One load's tied keys: where each is read from, and the comparisons of values held apart."""

    def __init__(self, keep: re.Pattern[str] | None) -> None:
        self.keep = keep
        #: destination key -> the checkpoint key read for it
        self.sources: dict[str, str] = {}
        #: skipped destination key (the tensor of another) -> the key that loads it
        self.through: dict[str, str] = {}
        #: checkpoint keys such a skipped key covers (loaded through the other key of the same tensor)
        self.covered: list[str] = []
        #: a tied key the checkpoint holds apart, read into scratch -> the key loaded it must equal
        self.compare: dict[str, str] = {}
        self._pending: dict[str, int] = {}  # elements of each compared key still to be read

    def plan(
        self,
        entries: Mapping[str, Entry],
        dest_tied: Mapping[str, str],
        saved_tied: Mapping[str, str],
        md_all: Mapping[str, Any],
    ) -> None:
        """Decide, for this rank's destination ``entries``, from the checkpoint's keys ``md_all``."""

        def stored(key: str) -> str | None:
            if key in md_all:
                return key
            first = saved_tied.get(key)
            return first if first is not None and first in md_all else None

        groups: dict[str, list[str]] = {}
        for alias, first in dest_tied.items():
            groups.setdefault(first, [first]).append(alias)
        self.sources, self.through, self.covered, self.compare, self._pending = {}, {}, [], {}, {}
        for keys in groups.values():
            apart = [k for k in keys if k in md_all and k not in saved_tied]  # holding bytes of their own
            kept = [k for k in apart if self.keep is not None and self.keep.fullmatch(k)]
            reader = kept[0] if kept else next((k for k in keys if stored(k) is not None), keys[0])
            for key in keys:
                if key == reader:
                    continue
                if key in apart and reader in apart and not kept:
                    self.compare[key] = reader  # two values for one tensor: read both, compare
                    continue
                self.through[key] = reader
                if key in md_all:
                    self.covered.append(key)
        for key in entries:
            if key not in self.through and key not in md_all and (source := stored(key)) is not None:
                self.sources[key] = source

    def scratch(self, entry: Entry) -> Entry:
        """The entry of a compared key, reading into a scratch tensor of its shape instead."""
        return Entry(
            entry.local_key,
            entry.key,
            entry.path,
            entry.kind,
            torch.empty_like(entry.value),
            entry.chunk,
            entry.global_shape,
            entry.sharded_axes,
            entry.specs,
            entry.rank_local,
            entry.dtensor,
            entry.original_global_shape,
        )

    def count(self, items: list[ReadItem]) -> None:
        """(after the local plan) The elements each compared key and its loaded key wait for."""
        watched = set(self.compare) | set(self.compare.values())
        self._pending = dict.fromkeys(watched, 0)
        for item in items:
            if item.dest_index.fqn in watched:
                self._pending[item.dest_index.fqn] += math.prod(item.lengths)

    def committed(self, item: ReadItem, entries: Mapping[str, Entry], rank: int) -> None:
        """(reader) One read is in: compare each pair whose reads are all in."""
        fqn = item.dest_index.fqn
        if fqn not in self._pending:
            return
        self._pending[fqn] -= math.prod(item.lengths)
        for alias, reader in self.compare.items():
            if fqn in (alias, reader) and self._pending.get(alias) == 0 and self._pending.get(reader) == 0:
                self._pending.pop(alias)
                if not _same_bits(entries[reader].value, entries[alias].value):
                    raise LayoutMismatch(
                        f"rank {rank}: {alias!r} and {reader!r} are one tensor in the model (tied), but the "
                        "checkpoint holds them apart with different values, and a tied model holds one. Pass "
                        f"keep_tied=[{reader!r}] (or [{alias!r}]) to load that one and ignore the other, or untie "
                        "them in the model (give the head its own parameter) to load both"
                    )


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (a NaN equals itself, -0.0 is not +0.0): one tensor written twice is the same bytes."""
    if a.numel() != b.numel() or a.dtype != b.dtype:
        return False
    a, b = a.reshape(-1), b.reshape(-1)
    if a.dtype.is_floating_point:
        as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return bool(torch.equal(a.view(as_int), b.view(as_int)))
    return bool(torch.equal(a, b))

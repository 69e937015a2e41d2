"""Save plans that cross ranks as flat columns.

DCP gathers every rank's local plan on the coordinator and scatters the global plans back, pickled,
and unpickles them in its own code with Python's cyclic collector running. A plain pickle of a
``WriteItem`` unpickles as ten tracked objects: each of its four dataclasses, and a ``__dict__`` for
each, which pickle's ``BUILD`` step materialises. At 2,723 tensors per rank and 4 ranks the gather
alone made ~70,000 on the coordinator, past the quarter of a torch process's long-lived objects that
sets off a full collection: 0.12 s each, one or two inside every save's gather (benchmarks/RESULTS.md,
"Plans across ranks").

A :class:`CompactSavePlan` pickles its items as one flat list of their fields (``torch.Size`` and
``TensorProperties`` objects the items share travel once, as before) and unpickles as a plain
:class:`~torch.distributed.checkpoint.planner.SavePlan` whose items are built by their constructors,
with the collector paused: four objects per item, no ``__dict__``. The receiver gets what a
plain pickle would give, field for field (an item's index offset and chunk offsets, equal, become
one object).

``dataclasses.replace`` keeps the class, so a storage writer that replaces ``storage_data`` (ours,
DCP's) keeps the plan compact. Should DCP's plan classes ever gain fields, :func:`compact` returns
plans unchanged (a plain pickle, as before) rather than drop a field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem

from smpckpt.storage._gc import gc_paused

__all__ = ["CompactSavePlan", "compact", "FIELDS_PER_ITEM"]

#: Entries per item in the flat list: fqn, offset, index hint, type, bytes_io_data, chunk offsets,
#: chunk sizes, properties, global size.
FIELDS_PER_ITEM = 9

_EXPECTED_FIELDS = {
    SavePlan: ("items", "storage_data", "planner_data", "usable"),
    WriteItem: ("index", "type", "bytes_io_data", "tensor_data"),
    MetadataIndex: ("fqn", "offset", "index"),
    TensorWriteData: ("chunk", "properties", "size"),
    ChunkStorageMetadata: ("offsets", "sizes"),
}
# the flat form names every field of these classes; with any other field it would drop data
_SUPPORTED = all(tuple(f.name for f in dataclasses.fields(cls)) == names for cls, names in _EXPECTED_FIELDS.items())


class CompactSavePlan(SavePlan):
    """A ``SavePlan`` that pickles its items as flat columns and unpickles as a plain ``SavePlan``.
    Compares equal to a plain plan with the same fields."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_open, (_flatten(self.items), self.storage_data, self.planner_data, self.usable))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SavePlan):
            return NotImplemented
        return (self.items, self.storage_data, self.planner_data, self.usable) == (
            other.items,
            other.storage_data,
            other.planner_data,
            other.usable,
        )

    __hash__ = None  # type: ignore[assignment]  # as SavePlan's: its items are a list


def compact(plan: SavePlan) -> SavePlan:
    """``plan`` as a :class:`CompactSavePlan` (the same fields; no copy of its items)."""
    if not _SUPPORTED or isinstance(plan, CompactSavePlan):
        return plan
    return CompactSavePlan(plan.items, plan.storage_data, plan.planner_data, plan.usable)


def _flatten(items: list[WriteItem]) -> list[Any]:
    flat: list[Any] = []
    add = flat.extend
    for it in items:
        index, td = it.index, it.tensor_data
        if td is None:
            add((index.fqn, index.offset, index.index, it.type, it.bytes_io_data, None, None, None, None))
        else:
            chunk = td.chunk
            # the index's offset is a copy of the chunk's (MetadataIndex copies what it is given): send
            # one object for both, and the receiver keeps one
            offset = chunk.offsets if index.offset == chunk.offsets else index.offset
            add((index.fqn, offset, index.index, it.type, it.bytes_io_data, chunk.offsets, chunk.sizes))
            add((td.properties, td.size))
    return flat


def _open(flat: list[Any], storage_data: Any, planner_data: Any, usable: bool) -> SavePlan:
    """(unpickling) The plain plan ``flat`` stands for. ``MetadataIndex`` is filled field by field:
    its constructor would copy every offset into a new ``torch.Size``, undoing the sharing."""
    if len(flat) % FIELDS_PER_ITEM:
        raise ValueError(f"a compact save plan holds {len(flat)} fields, not a multiple of {FIELDS_PER_ITEM}")
    new, put = object.__new__, object.__setattr__
    items: list[WriteItem] = []
    with gc_paused():  # an object per field of every item
        cols = [iter(flat)] * FIELDS_PER_ITEM
        for fqn, offset, hint, kind, bio, offsets, sizes, props, size in zip(*cols):
            index = new(MetadataIndex)
            put(index, "fqn", fqn)
            put(index, "offset", offset)
            put(index, "index", hint)
            td = None if offsets is None else TensorWriteData(ChunkStorageMetadata(offsets, sizes), props, size)
            items.append(WriteItem(index, kind, bio, td))
    return SavePlan(items, storage_data, planner_data, usable)

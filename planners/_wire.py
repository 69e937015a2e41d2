"""Save and load plans that cross ranks as flat columns.

DCP gathers every rank's local plan on the coordinator and scatters the global plans back, pickled,
and unpickles them in its own code with Python's cyclic collector running. A plain pickle of a
``WriteItem`` unpickles as ten tracked objects: each of its four dataclasses, and a ``__dict__`` for
each, which pickle's ``BUILD`` step materialises. At 2,723 tensors per rank and 4 ranks the gather
alone made ~70,000 on the coordinator, past the quarter of a torch process's long-lived objects that
sets off a full collection: 0.12 s each, one or two inside every save's gather (benchmarks/RESULTS.md,
"Plans across ranks").

A :class:`CompactSavePlan` pickles its items as one flat list of their fields and unpickles as a
plain :class:`~torch.distributed.checkpoint.planner.SavePlan` whose items are built by their
constructors, with the collector paused: four objects per item, no ``__dict__``.
:class:`CompactLoadPlan` does the same for ``dcp.load``'s ``ReadItem`` (14 tracked objects per item
of a resharding load's plan before, 3-4 now). The receiver gets what a plain pickle would give,
field for field; equal ``torch.Size`` values (offsets, shapes: a few distinct ones over thousands of
items) and the shared ``TensorProperties`` arrive as one object each.

``dataclasses.replace`` keeps the class, so a storage writer that replaces ``storage_data`` (ours,
DCP's) keeps the plan compact. Should DCP's plan classes ever gain fields, :func:`compact` returns
plans unchanged (a plain pickle, as before) rather than drop a field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar, cast

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem

from smpckpt._gc import gc_paused

__all__ = ["CompactSavePlan", "CompactLoadPlan", "compact", "compact_load", "FIELDS_PER_ITEM", "FIELDS_PER_READ"]

_Plan = TypeVar("_Plan", SavePlan, LoadPlan)

#: Entries per item in the flat list: fqn, offset, index hint, type, bytes_io_data, chunk offsets,
#: chunk sizes, properties, global size.
FIELDS_PER_ITEM = 9

#: Entries per read item: type, then fqn, offset, index hint of the destination index, destination
#: offsets, the same four for the storage index and offsets, lengths.
FIELDS_PER_READ = 10

_EXPECTED_FIELDS = MappingProxyType(
    {
        SavePlan: ("items", "storage_data", "planner_data", "usable"),
        LoadPlan: ("items", "storage_data", "planner_data"),
        ReadItem: ("type", "dest_index", "dest_offsets", "storage_index", "storage_offsets", "lengths"),
        WriteItem: ("index", "type", "bytes_io_data", "tensor_data"),
        MetadataIndex: ("fqn", "offset", "index"),
        TensorWriteData: ("chunk", "properties", "size"),
        ChunkStorageMetadata: ("offsets", "sizes"),
    }
)
# the flat form names every field of these classes; with any other field it would drop data
_SUPPORTED = all(tuple(f.name for f in dataclasses.fields(cls)) == names for cls, names in _EXPECTED_FIELDS.items())


class _ComparesAsPlain:
    """Equal to a plain plan of ``_BASE`` with the same fields (a dataclass's generated ``__eq__`` wants
    the very same class)."""

    _BASE: ClassVar[type]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, self._BASE):
            return NotImplemented
        return all(getattr(self, f.name) == getattr(other, f.name) for f in dataclasses.fields(self._BASE))

    __hash__ = None  # type: ignore[assignment]  # as the plain plans': their items are a list


class CompactSavePlan(_ComparesAsPlain, SavePlan):
    """A ``SavePlan`` that pickles its items as flat columns and unpickles as a plain ``SavePlan``.
    Compares equal to a plain plan with the same fields."""

    _BASE = SavePlan

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_open, (_flatten(self.items), self.storage_data, self.planner_data, self.usable))


def compact(plan: _Plan) -> _Plan:
    """``plan`` as a :class:`CompactSavePlan` or :class:`CompactLoadPlan` (the same fields; no copy of
    its items)."""
    cls: type[Any] = CompactSavePlan if isinstance(plan, SavePlan) else CompactLoadPlan
    if not _SUPPORTED or isinstance(plan, cls):
        return plan
    return cast(_Plan, cls(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}))


compact_load = compact  # the name the load planner calls it by


def _flatten(items: list[WriteItem]) -> list[Any]:
    flat: list[Any] = []
    add = flat.extend
    one = _interner()
    for it in items:
        index, td = it.index, it.tensor_data
        if td is None:
            add((index.fqn, one(index.offset), index.index, it.type, it.bytes_io_data, None, None, None, None))
        else:
            chunk = td.chunk
            offsets = one(chunk.offsets)
            # the index's offset is a copy of the chunk's (MetadataIndex copies what it is given)
            same = type(index.offset) is type(offsets) and index.offset == offsets
            offset = offsets if same else one(index.offset)
            add((index.fqn, offset, index.index, it.type, it.bytes_io_data, offsets, one(chunk.sizes)))
            add((td.properties, one(td.size)))
    return flat


def _interner() -> Any:
    """Maps each ``torch.Size`` to the first equal one seen, so equal offsets and shapes (a few
    distinct values over thousands of items) travel once and arrive as one object. Anything else (a
    plain tuple a custom planner put there, a list, None) passes as it is: equal is not enough, the
    receiver must get the same type."""
    seen: dict[Any, Any] = {}

    def one(value: Any) -> Any:
        return seen.setdefault(value, value) if type(value) is torch.Size else value

    return one


def _index(fqn: str, offset: Any, hint: int | None) -> MetadataIndex:
    """A ``MetadataIndex`` filled field by field: its constructor would copy the offset into a new
    ``torch.Size``, undoing the sharing."""
    index = object.__new__(MetadataIndex)
    object.__setattr__(index, "fqn", fqn)
    object.__setattr__(index, "offset", offset)
    object.__setattr__(index, "index", hint)
    return index


def _rows(flat: list[Any], width: int, what: str) -> Iterator[tuple[Any, ...]]:
    """(unpickling) The items' fields in ``flat``, ``width`` at a time."""
    if len(flat) % width:
        raise ValueError(f"a compact {what} plan holds {len(flat)} fields, not a multiple of {width}")
    return zip(*[iter(flat)] * width)


def _open(flat: list[Any], storage_data: Any, planner_data: Any, usable: bool) -> SavePlan:
    """(unpickling) The plain save plan ``flat`` stands for."""
    items: list[WriteItem] = []
    with gc_paused():  # an object per field of every item
        for fqn, offset, hint, kind, bio, offsets, sizes, props, size in _rows(flat, FIELDS_PER_ITEM, "save"):
            td = None if offsets is None else TensorWriteData(ChunkStorageMetadata(offsets, sizes), props, size)
            items.append(WriteItem(_index(fqn, offset, hint), kind, bio, td))
    return SavePlan(items, storage_data, planner_data, usable)


class CompactLoadPlan(_ComparesAsPlain, LoadPlan):
    """A ``LoadPlan`` that pickles its items as flat columns and unpickles as a plain ``LoadPlan``.
    Compares equal to a plain plan with the same fields."""

    _BASE = LoadPlan

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_open_load, (_flatten_reads(self.items), self.storage_data, self.planner_data))


def _flatten_reads(items: list[ReadItem]) -> list[Any]:
    flat: list[Any] = []
    add = flat.extend
    one = _interner()
    for it in items:
        d, s = it.dest_index, it.storage_index
        add((it.type, d.fqn, one(d.offset), d.index, one(it.dest_offsets), s.fqn, one(s.offset), s.index))
        add((one(it.storage_offsets), one(it.lengths)))
    return flat


def _open_load(flat: list[Any], storage_data: Any, planner_data: Any) -> LoadPlan:
    """(unpickling) The plain load plan ``flat`` stands for."""
    items: list[ReadItem] = []
    rows = _rows(flat, FIELDS_PER_READ, "load")
    with gc_paused():  # an object per field of every item
        for kind, dfqn, doff, dhint, doffsets, sfqn, soff, shint, soffsets, lengths in rows:
            dest = _index(dfqn, doff, dhint)
            # one object where the sender's were one value: interned offsets arrive as one object, so
            # identity (not equality: a tuple equals a torch.Size) says the types match too
            same = sfqn == dfqn and soff is doff and shint == dhint
            src = dest if same else _index(sfqn, soff, shint)
            items.append(ReadItem(kind, dest, doffsets, src, soffsets, lengths))
    return LoadPlan(items, storage_data, planner_data)

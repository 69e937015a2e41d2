"""The save planner's plan caches (what a :class:`~smpckpt.planners.ParallelSavePlanner` reuses across
saves while its state's structure is unchanged, and the rules that keep reuse exact), and the compact
form in which save and load plans cross ranks.

Two scopes (``ParallelSavePlanner(cache_scope=...)``, the README's "Plan caching"): ``"local"`` memoises a rank's
local plan (a pure function of :func:`structure_signature`); under ``"global"`` an unchanged rank sends an
empty plan naming the *generation* of the global plan it holds.

Why the "global" cache survives failed saves: the README's "Plan caching" (staged, promoted only in
``finish_plan``; dropped after a round that stopped before it; generations checked). A coordinator holds
a global plan only under the generation it built it as (finishing another coordinator's plan drops its
own). The cached metadata is a private deep copy:
storage writers rewrite the one DCP hands them (full mode replaces its chunks and dtypes).

Compact plans: DCP unpickles the gathered and scattered plans with the cyclic collector running, and a
plain ``WriteItem`` unpickles as ten tracked objects (its dataclasses and their ``__dict__``): enough,
at a few thousand tensors per rank, to set off full collections inside every save's gather
(benchmarks/RESULTS.md, "Plans across ranks"). :class:`CompactSavePlan` / :class:`CompactLoadPlan`
pickle their items as flat columns and unpickle, with the collector paused, as the plain DCP plans a
plain pickle would give, field for field, built by their constructors; equal ``torch.Size`` values and
the shared ``TensorProperties`` arrive as one object each. ``dataclasses.replace`` keeps the class (a
storage writer replacing ``storage_data`` keeps the plan compact); should DCP's plan classes gain
fields, :func:`compact` returns plans unchanged rather than drop one."""

from __future__ import annotations

import dataclasses
import logging
import pickle
import secrets
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType

from smpckpt._gc import gc_paused
from smpckpt.errors import SpecError

__all__ = ["PlanCache", "structure_signature", "GENERATION", "CompactSavePlan", "CompactLoadPlan", "compact"]
__all__ += ["FIELDS_PER_ITEM", "FIELDS_PER_READ", "tensor_write_item", "hinted", "pinning_possible"]


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
    """Maps each ``torch.Size`` to the first equal one seen, so equal offsets and shapes travel once
    and arrive as one object; anything else passes as it is (the receiver must get the same type)."""
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


def tensor_write_item(
    fqn: str, chunk: ChunkStorageMetadata, properties: Any, size: torch.Size, kind: WriteItemType
) -> WriteItem:
    """A tensor's ``WriteItem``, equal field for field to what the constructors build but faster (one
    per tensor per fresh plan): fields by position, the index's offset the chunk's own ``torch.Size``
    (``MetadataIndex`` would copy it). By keywords should DCP's classes change their fields."""
    if not _SUPPORTED:
        data = TensorWriteData(chunk=chunk, properties=properties, size=size)
        return WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=kind, tensor_data=data)
    offsets = chunk.offsets
    if type(offsets) is not torch.Size:
        offsets = torch.Size(offsets)
    return WriteItem(_index(fqn, offsets, None), kind, None, TensorWriteData(chunk, properties, size))


def hinted(item: WriteItem, hint: int) -> WriteItem:
    """``item`` with its index's hint ``hint`` (the chunk's position in the tensor's metadata), as
    ``dataclasses.replace`` makes it, faster: the coordinator rewrites every item of every rank."""
    if not _SUPPORTED:
        return dataclasses.replace(item, index=dataclasses.replace(item.index, index=hint))
    index = item.index
    return WriteItem(_index(index.fqn, index.offset, hint), item.type, item.bytes_io_data, item.tensor_data)


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


if TYPE_CHECKING:
    from smpckpt.planners.save import ParallelSavePlanner


logger = logging.getLogger(__name__)

#: planner_data key of a final (and a cached) plan: the generation of the global plan it came from
GENERATION = "smpckpt_plan_generation"


def _copy(metadata: Metadata) -> Metadata:
    """A deep copy through pickle (Metadata must pickle anyway), much faster than ``copy.deepcopy``."""
    return cast(Metadata, pickle.loads(pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)))


def check_plan_ranks(plans: Sequence[SavePlan | LoadPlan], layout: Any, rules: Any, what: str) -> None:
    """(coordinator) DCP gathers plans in the process group's order, so each plan's place is its rank: a planner
    given another ``rank=`` (a rank formula other than the group's, ``LOCAL_RANK``) put its rows at another
    rank's offsets, or read another rank's, silently (hunt73c F5). Refused where the two ranks hold other pieces
    (another TP rank or stage; another DP rank under a ``dp`` spec) and the plans make the layout's whole world
    (one process may plan one rank's piece alone, offline)."""
    if len(plans) != layout.world_size:
        return
    dp = any(s["axis"] == "dp" for rule in rules.to_records() for s in rule["specs"])
    wrong = []
    for place, plan in enumerate(plans):
        rank = (plan.planner_data or {}).get("rank", place)
        given, at = layout.coords(rank), layout.coords(place)
        if (given.tp, given.pp, given.dp if dp else 0) != (at.tp, at.pp, at.dp if dp else 0):
            wrong.append(f"rank {rank} at place {place}")
    if wrong:
        raise SpecError(
            f"{what}: planners were given ranks other than their place in the process group ({', '.join(wrong[:4])}): "
            "pass rank=None (the group's own) or the group's rank (dist.get_rank(group)); an explicit rank is for "
            "one process planning without a process group"
        )


def pinning_possible() -> bool:
    """Whether a tensor of this process can be pinned at all: without an accelerator
    (``at::getAccelerator()``) ``Tensor.is_pinned()`` answers False, so the planners need not ask each
    tensor at every save. With one (CUDA, even with no device present) every tensor is asked."""
    get = getattr(torch._C, "_accelerator_getAccelerator", None)
    return get is None or get() is not None


def structure_signature(
    planner: ParallelSavePlanner,
    object_digests: Mapping[str, str] | None,
    props: dict[str, tuple[Any, ...]],
) -> tuple[Any, ...]:
    """Everything the planner's local plan depends on, compared by equality at the next save (no hashing
    of text): the layout, rank and owner rule, and per key its path, kind and geometry, the fields of its
    ``TensorProperties``, split axes, original shape, rank-locality and (DTensors) placements; which
    keys are tied to which (a tie made or broken between saves changes what is written), whether
    replica values are verified (the plan then carries the stage's key list); object
    values only when ``object_digests`` is given. Fills ``props`` with each tensor's
    ``TensorProperties`` fields by key, for the write items."""
    p, mappings = planner, planner.mappings
    parts: list[Any] = [p.layout, p.rank, p.replica_owner, tuple(p.tied.items()), p.verify_replicas]
    add = parts.append
    can_pin = pinning_possible()
    for e in p.entries.values():
        key, kind = e.key, e.kind
        if kind == "object":
            add((key, mappings.get(key), None if object_digests is None else object_digests[key]))
            continue
        chunk = cast(ChunkStorageMetadata, e.chunk)  # every tensor entry has one
        v = e.value
        # TensorProperties' fields
        properties = props[key] = (v.dtype, v.layout, v.requires_grad, can_pin and v.is_pinned())
        dt = e.dtensor
        placement = None if dt is None else (dt.placements, dt.device_mesh)
        # one flat row per key (a tuple fewer to build than grouping its geometry)
        add(
            (
                key,
                mappings.get(key),
                kind,
                properties,
                e.global_shape,
                chunk.offsets,
                chunk.sizes,
                e.sharded_axes,
                e.original_global_shape,
                e.rank_local,
                placement,
            )
        )
    return tuple(parts)


class PlanCache:
    """One planner's cached and staged plans (see the module docstring for the rules).

    Call order, as the planner drives it: :meth:`begin_round` (set_up_planner) -> :meth:`hit` and
    :meth:`remember` (create_local_plan) -> on the coordinator :meth:`reuse_global` or
    :meth:`substitute` then :meth:`stage_global` (create_global_plan) -> :meth:`finish` (finish_plan)."""

    def __init__(self, scope: str) -> None:
        self.scope = scope  # "global", "local", or "off" (caching disabled: nothing kept)
        self.round_open = False  # begin_round ran and finish has not (yet)
        self.drop()

    def drop(self) -> None:
        """Forget every cached and staged plan: the next save plans afresh."""
        self.signature: tuple[Any, ...] | None = None
        self.local: SavePlan | None = None  # the local plan of structure `signature`
        self.pending: tuple[tuple[Any, ...], SavePlan] | None = None  # ("global") promoted in finish
        self.final: SavePlan | None = None
        self.generation: str | None = None  # of the global plan `final` came from
        # coordinator: every rank's local plan and the global plan of generation `generation`, and a
        # global plan built this round (promoted in this rank's finish)
        self.all_plans: list[SavePlan] | None = None
        self.global_plan: tuple[list[SavePlan], Metadata] | None = None
        self.staged: tuple[str, list[SavePlan], list[SavePlan], Metadata] | None = None

    # -- every rank -------------------------------------------------------------------------------------
    def begin_round(self, rank: Any) -> None:
        if self.round_open:
            # The last save stopped between planning and finish_plan here: a global plan it staged may
            # have reached some ranks and not others. Trust nothing cached from before it.
            logger.debug("rank %s: the last save did not finish planning; dropping plan caches", rank)
            self.drop()
        self.round_open = True

    def hit(
        self,
        signature: tuple[Any, ...] | None,
        rank: int,
        object_digests: Mapping[str, str],
        values: Mapping[str, bytes | None],
    ) -> SavePlan | None:
        """The plan to send when ``signature`` is the cached structure's, else None: "local", the cached
        plan with this save's object digests; "global", an empty plan naming the held generation. Either
        carries this save's replica value digests (``values``, planner_data fields: they change at every
        save)."""
        cached = self.local
        if signature is None or cached is None or signature != self.signature:
            return None
        logger.debug("rank %d: state structure unchanged, reusing its cached plan", rank)
        if self.scope == "local":
            data = {**cached.planner_data, "objects": dict(object_digests), **values}
            return dataclasses.replace(cached, planner_data=data)
        data = {"rank": rank, "cached": True, GENERATION: self.generation, **values}
        return SavePlan([], usable=False, planner_data=data)

    def remember(self, signature: tuple[Any, ...] | None, plan: SavePlan) -> None:
        """Keep a freshly built local plan: at once ("local": a pure function of the signature, so what
        happens to this save cannot make it stale), else once this round finishes."""
        if signature is None:
            self.pending = None
        elif self.scope == "local":
            self.signature, self.local = signature, plan
        else:
            self.pending = (signature, plan)

    # -- coordinator --------------------------------------------------------------------------------------
    def holds(self, plan: SavePlan) -> bool:
        """Whether ``plan`` is a cached (empty) plan of the generation this coordinator holds."""
        data = plan.planner_data or {}
        return bool(data.get("cached")) and self.generation is not None and data.get(GENERATION) == self.generation

    def reuse_global(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], list[SavePlan], Metadata] | None:
        """When every rank sent a cached plan of the held generation: (the held global plans, the empty
        plans to scatter, a copy of the held metadata -- the storage writer may rewrite what it gets)."""
        if self.global_plan is None or not all(self.holds(p) for p in all_plans):
            return None
        plans, metadata = self.global_plan
        held = {GENERATION: self.generation}
        return plans, [SavePlan([], usable=False, planner_data=held) for _ in all_plans], _copy(metadata)

    def substitute(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        """Every rank's full local plan: a cached (empty) one replaced by this coordinator's copy of it,
        which must be of the generation the coordinator holds (else every cache is dropped and this
        save fails before anything is written)."""
        out: list[SavePlan] = []
        for i, plan in enumerate(all_plans):
            if plan.usable:
                out.append(plan)
            elif self.all_plans is not None and i < len(self.all_plans) and self.holds(plan):
                out.append(self.all_plans[i])
            else:
                held = self.generation if self.all_plans is not None else None
                self.drop()
                raise SpecError(
                    f"rank {i} reused a cached save plan (generation {(plan.planner_data or {}).get(GENERATION)}) "
                    f"that this coordinator does not hold (it holds {held}): a previous save failed part-way or "
                    "planners were not reused alike on every rank. Nothing was written; the planners drop their "
                    "caches, so saving again plans afresh"
                )
        return out

    def stage_global(self, full: list[SavePlan], plans: list[SavePlan], metadata: Metadata) -> dict[str, Any] | None:
        """("global") Hold this round's global plan back until this rank's finish; the planner_data every
        final plan carries (its generation), or None when this scope caches no global plan."""
        if self.scope != "global":
            self.staged = None
            return None
        generation = secrets.token_hex(8)
        self.staged = (generation, full, plans, _copy(metadata))
        return {GENERATION: generation}

    # -- every rank --------------------------------------------------------------------------------------
    def finish(self, new_plan: SavePlan, rank: int) -> SavePlan:
        """This rank's final plan (the coordinator's, or the cached one it stands for); a usable plan
        promotes what this round staged under the plan's generation ("global")."""
        self.round_open = False
        gen = (new_plan.planner_data or {}).get(GENERATION)
        if not new_plan.usable:
            if self.final is None or gen != self.generation:
                self.drop()
                raise SpecError(
                    f"rank {rank}: the coordinator sent a cached plan (generation {gen}) this rank does not "
                    "hold; saving again plans afresh"
                )
            # The storage layer may put per-save data (a new save id) on this round's plan; keep it.
            plan = dataclasses.replace(self.final, storage_data=new_plan.storage_data)
        else:
            plan = new_plan
            if self.scope == "global":
                self.final = new_plan
                self.generation = gen
                if self.pending is not None:
                    self.signature, self.local = self.pending
                staged = self.staged
                if staged is not None and staged[0] == gen:
                    self.all_plans, self.global_plan = staged[1], (staged[2], staged[3])
                else:
                    # another coordinator built this plan: a global plan held from before is of another
                    # generation, and must not pass as this one's
                    self.all_plans = self.global_plan = None
        self.pending = None
        self.staged = None
        return plan

"""ParallelSavePlanner: TP/PP/DP-aware save planning for ``dcp.save``.

Call order (as ``dcp.save`` drives it; "all" = every rank, "coord" = rank 0 of the group)::

    1. (all)   set_up_planner(state_dict, storage_meta, is_coordinator)
    2. (all)   create_local_plan()            -> only the items this rank writes
    3. (coord) create_global_plan(all_plans)  -> checks replicas, dedups, builds Metadata
    4. (all)   finish_plan(plan)              -> this rank's final plan (from cache when unchanged)
    5. (all)   resolve_data(item)             -> tensor or bytes, called from writer threads
    6. (caller, optional) release_state()     -> drop this save's tensors before keeping the planner

Plain local tensors are mapped to global chunks by their :class:`~smpckpt.ShardSpec`; DTensors carry
their own placement; other values are pickled (``torch.save``) objects.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import io
import logging
import math
import secrets
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.default_planner import _validate_global_plan, create_default_global_save_plan
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType

from smpckpt.errors import ReplicaMismatch, SpecError
from smpckpt.layout import ParallelLayout
from smpckpt.naming import NameMap
from smpckpt.planners._entries import (
    Entry,
    LayoutScope,
    ObjectBytes,
    dtensor_is_owner,
)
from smpckpt.planners._ownership import assign_owners
from smpckpt.record import METADATA_KEY, LayoutRecord
from smpckpt.specs import SpecLike, SpecRules

__all__ = ["ParallelSavePlanner", "SaveReport"]

logger = logging.getLogger(__name__)

# planner_data key of a final plan: which global plan (of the "global" plan cache) it came from
_GENERATION = "smpckpt_plan_generation"


@dataclasses.dataclass(frozen=True)
class SaveReport:
    """What the last global plan did (filled on the coordinator)."""

    bytes_per_rank: tuple[int, ...]
    items: int
    cached: bool

    @property
    def balance(self) -> float:
        """max / mean of bytes written per rank (1.0 is perfect)."""
        total = sum(self.bytes_per_rank)
        if not total:
            return 1.0
        return max(self.bytes_per_rank) / (total / len(self.bytes_per_rank))


class ParallelSavePlanner(LayoutScope, SavePlanner):
    """Save planner for plain TP/PP shards, DP replicas, ZeRO-sharded state and DTensors.

    Args:
        layout: the parallel layout of the job saving.
        specs: glob -> :class:`~smpckpt.ShardSpec` rules for plain local shards (first match wins);
            unmatched tensors are replicas within their pipeline stage.
        rank: this rank in the layout; default the process group's rank, else 0 (lets tools and
            simulations plan without a process group).
        name_map: stage-local key -> global key (overrides the ``layers.<i>`` rule of ``pp_layers``).
        process_group: the group ``dcp.save`` runs on (for the default ``rank``).
        rank_local: globs of keys each rank holds for itself (RNG states, per-rank counters). Such keys
            must be rank-unique; they are written by their holder and never deduplicated.
        replica_owner: ``"balanced"`` spreads replicated tensors over their replicas by bytes;
            ``"lowest"`` writes them all from the lowest rank of each group.
        enable_plan_caching: reuse this instance's plans while the state's structure is unchanged.
        cache_scope: what the plan cache reuses (with ``enable_plan_caching``):

            * ``"global"`` (default): an unchanged rank sends an empty plan and the coordinator reuses
              the global plan and metadata it built before (less gathered, no global planning). Every
              rank must then reuse its planner alike.
            * ``"local"``: a rank reuses only its own local plan -- a pure function of its state's
              structure, its rank and the layout -- and sends it in full; the coordinator plans afresh
              at every save. Nothing cached crosses ranks, so any mix of reused and fresh planners is
              correct, and object values (user content, RNG states) may change without a re-plan.

    Every plan and cache lives on the instance (DCP's class-level plan cache is never used: it can hand
    one rank's plan to another when several planners share a process).

    Why the "global" cache survives failed saves: caches are promoted only in ``finish_plan``, which every
    rank reaches after the same scatter of the global plan, or none does (the coordinator's
    failure is scattered to all). A rank whose last save stopped between ``set_up_planner`` and
    ``finish_plan`` drops every cache at its next ``set_up_planner``. Each final plan carries the
    generation of the global plan it came from, and a coordinator holds a global plan only under the
    generation it built it as (a planner that later finishes another coordinator's plan drops its own):
    the coordinator substitutes or reuses a rank's cached plan only when that rank names the generation
    of the global plan the coordinator holds, else it fails the save with a
    :class:`~smpckpt.errors.SpecError` (no rank writes; the next save plans afresh) rather than write
    metadata for a structure some rank no longer has. The cached metadata is a private copy: storage
    writers rewrite the one DCP hands them (full mode replaces its chunks and dtypes).
    """

    _signature: tuple[Any, ...] | None
    _cached_local: SavePlan | None  #: the local plan of structure _signature
    _pending: tuple[tuple[Any, ...], SavePlan] | None  #: ("global") promoted to the two above in finish_plan
    _cached_final: SavePlan | None
    _generation: str | None  #: of the global plan _cached_final came from
    # coordinator: every rank's local plan and the global plan of generation _generation, and a global
    # plan built this round (promoted in this rank's finish_plan)
    _cached_all: list[SavePlan] | None
    _cached_global: tuple[list[SavePlan], Metadata] | None
    _staged_global: tuple[str, list[SavePlan], list[SavePlan], Metadata] | None

    def __init__(
        self,
        layout: ParallelLayout,
        specs: Mapping[str, SpecLike] | SpecRules | None = None,
        *,
        rank: int | None = None,
        name_map: NameMap | None = None,
        process_group: Any = None,
        rank_local: Sequence[str] = (),
        replica_owner: str = "balanced",
        enable_plan_caching: bool = True,
        cache_scope: Literal["global", "local"] = "global",
    ) -> None:
        super().__init__()
        self._set_scope(layout, specs, rank, name_map, process_group, rank_local)
        if replica_owner not in ("balanced", "lowest"):
            raise SpecError(f"replica_owner must be 'balanced' or 'lowest', got {replica_owner!r}")
        if cache_scope not in ("global", "local"):
            raise SpecError(f"cache_scope must be 'global' or 'local', got {cache_scope!r}")
        self.replica_owner = replica_owner
        self.enable_plan_caching = enable_plan_caching
        self.cache_scope = cache_scope
        self.report: SaveReport | None = None
        self.entries: dict[str, Entry] = {}
        self._round_open = False  # set_up_planner ran and finish_plan has not (yet)
        self._drop_caches()

    # -- 1. set up ---------------------------------------------------------------------------------
    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """(all ranks, once per save) Resolve this rank's state dict against the layout: global keys
        (PP renaming), global chunks (specs, DTensor placements), objects."""
        if self._round_open:
            # The last save stopped between planning and finish_plan here: a global plan it staged may
            # have reached some ranks and not others. Trust nothing cached from before it.
            logger.debug("rank %s: the last save did not finish planning; dropping plan caches", self._rank_arg)
            self._drop_caches()
        self._round_open = True
        resolved = self._resolve(state_dict)
        self.entries = resolved.entries
        self.mappings = resolved.mappings
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator
        self._object_bytes: dict[str, bytes] = {}

    # -- 2. local plan -----------------------------------------------------------------------------
    def create_local_plan(self) -> SavePlan:
        """(all ranks) Only the items this rank writes (it owns its shards and, by a deterministic
        byte-balanced choice every replica computes alike, some replicas), plus a constant-size
        replica digest; an empty "cached" plan when the structure is unchanged since the last save.

        Every rank runs this at every save: its cost is O(own keys), whatever the world size."""
        object_digests = self._serialise_objects()
        local_scope = self.cache_scope == "local"
        # the signature only serves the plan cache; a planner built per save skips it. The local scope
        # leaves object values out: they change the plan's object digests only, refreshed below.
        signature = (
            self._structure_signature(None if local_scope else object_digests) if self.enable_plan_caching else None
        )
        cached = self._cached_local
        if signature is not None and cached is not None and signature == self._signature:
            logger.debug("rank %d: state structure unchanged, reusing its cached plan", self.rank)
            if local_scope:
                return dataclasses.replace(cached, planner_data={**cached.planner_data, "objects": object_digests})
            return SavePlan(
                [], usable=False, planner_data={"rank": self.rank, "cached": True, _GENERATION: self._generation}
            )

        replicated = [
            (e.key, e.nbytes, e.sharded_axes)
            for e in self.entries.values()
            if e.kind == "tensor" and not e.rank_local and e.sharded_axes != {"tp", "dp"}
        ]
        owners = assign_owners(self.layout, self.rank, replicated, lowest_rank=self.replica_owner == "lowest")
        items: list[WriteItem] = []
        properties: dict[tuple[Any, ...], TensorProperties] = {}
        objects: dict[str, str] = {}
        mappings: dict[str, Any] = {}
        original: dict[str, tuple[int, ...]] = {}
        for entry in self.entries.values():
            if entry.kind == "object":
                items.append(WriteItem(index=MetadataIndex(entry.key), type=WriteItemType.BYTE_IO))
                objects[entry.key] = object_digests[entry.key]
            elif not self._writes(entry, owners) or _carries_no_data(entry):
                continue
            else:
                items.append(_tensor_item(entry, properties))
            mappings[entry.key] = self.mappings[entry.key]
            if entry.original_global_shape is not None:
                original[entry.key] = entry.original_global_shape
        planner_data = {
            "rank": self.rank,
            "digest": self._replica_digest(),
            "objects": objects,
            "mappings": mappings,
            "original_shapes": original,
        }
        plan = SavePlan(items, planner_data=planner_data)
        if signature is not None and local_scope:
            # a pure function of the signature: what happens to this save cannot make it stale
            self._signature, self._cached_local = signature, plan
        else:
            self._pending = (signature, plan) if signature is not None else None
        return plan

    def _writes(self, entry: Entry, owners: Mapping[str, int]) -> bool:
        """Whether this rank writes its piece of a tensor entry (before the empty-piece check)."""
        if entry.kind == "dtensor":
            return dtensor_is_owner(entry)
        return entry.rank_local or owners.get(entry.key, self.rank) == self.rank

    def _serialise_objects(self) -> dict[str, str]:
        """Serialise this rank's objects once (``resolve_data`` hands out these bytes); their digests."""
        digests: dict[str, str] = {}
        for entry in self.entries.values():
            if entry.kind != "object":
                continue
            if isinstance(entry.value, ObjectBytes):
                raw = bytes(entry.value)
            else:
                buf = io.BytesIO()
                torch.save(entry.value, buf)
                raw = buf.getvalue()
            self._object_bytes[entry.key] = raw
            digests[entry.key] = hashlib.sha1(raw).hexdigest()
        return digests

    def _structure_signature(self, object_digests: Mapping[str, str] | None) -> tuple[Any, ...]:
        """Everything the local plan depends on, compared by equality at the next save (no hashing of
        text): the layout, rank and owner rule, and per key its path, kind and geometry, the fields of
        its ``TensorProperties``, split axes, original shape, rank-locality and (DTensors) placements;
        object values only when ``object_digests`` is given."""
        parts: list[Any] = [self.layout, self.rank, self.replica_owner]
        mappings = self.mappings
        for e in self.entries.values():
            if e.kind == "object":
                parts.append((e.key, mappings.get(e.key), None if object_digests is None else object_digests[e.key]))
                continue
            chunk = e.chunk
            if chunk is None:
                raise SpecError(f"{e.key}: tensor entry without a chunk")
            v = e.value
            parts.append(
                (
                    e.key,
                    mappings.get(e.key),
                    e.kind,
                    v.dtype,
                    v.layout,
                    v.requires_grad,
                    v.is_pinned(),
                    e.global_shape,
                    chunk.offsets,
                    chunk.sizes,
                    e.sharded_axes,
                    e.original_global_shape,
                    e.rank_local,
                    None if e.dtensor is None else (e.dtensor.placements, e.dtensor.device_mesh),
                )
            )
        return tuple(parts)

    def _replica_digest(self) -> tuple[int, str]:
        """Constant-size digest of the tensors every rank of this stage must agree on.

        Covers (key, dtype, global shape, split axes) of every non-rank-local plain tensor. Ranks of a
        stage whose digests differ would disagree on who writes what -- silently losing data. Sorted by
        key, so ranks that built their state dicts in another order still agree.
        """
        rows = [
            (e.key, e.value.dtype, e.global_shape, e.sharded_axes)
            for e in self.entries.values()
            if e.kind == "tensor" and not e.rank_local
        ]
        rows.sort(key=lambda row: row[0])
        # one "key|dtype|shape|axes" line per tensor; the tail is shared by many keys, so format it once
        tails: dict[tuple[Any, ...], str] = {}
        parts: list[str] = []
        for key, dtype, shape, axes in rows:
            tail = tails.get((dtype, shape, axes))
            if tail is None:
                tail = tails[(dtype, shape, axes)] = f"|{dtype}|{tuple(shape or ())}|{sorted(axes)}\n"
            parts.append(key)
            parts.append(tail)
        return len(rows), hashlib.sha1("".join(parts).encode()).hexdigest()

    # -- 3. global plan (coordinator) --------------------------------------------------------------
    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """(coordinator) Compare replica digests per stage, dedup objects, build the ``Metadata``
        (with the :class:`~smpckpt.record.LayoutRecord`) and check that the chunks tile every tensor."""
        if self._cached_global is not None and all(self._reuses_held(p) for p in all_plans):
            plans, metadata = self._cached_global
            self.report = dataclasses.replace(self.report, cached=True) if self.report else None
            self.global_plan, self.metadata = plans, metadata
            held = {_GENERATION: self._generation}
            # a copy: the storage writer may rewrite what it is handed, and this one is reused again
            return [SavePlan([], usable=False, planner_data=held) for _ in all_plans], copy.deepcopy(metadata)
        full = self._substitute_cached(all_plans)
        self.layout.check_world_size(len(full), "dcp.save's world")
        self._check_replicas(full)
        deduped = self._dedup(full)
        plans, metadata = create_default_global_save_plan(deduped)
        mappings: dict[str, Any] = {}
        for plan in full:
            mappings.update(plan.planner_data["mappings"])
        original: dict[str, tuple[int, ...]] = {}
        for plan in full:
            original.update((plan.planner_data or {}).get("original_shapes", {}))
        record = LayoutRecord(
            self.layout, tuple(self.rules.to_records()), self._rank_local_globs, original_shapes=original
        )
        mappings[METADATA_KEY] = record.to_json()
        metadata = dataclasses.replace(metadata, planner_data=mappings)
        errors = _validate_global_plan(plans, metadata)
        if errors:
            shown = "; ".join(errors[:5])
            raise SpecError(
                f"the ranks' shards do not tile their global tensors ({len(errors)} problems): {shown}. "
                "Check that every rank gives the same specs and sizes."
            )
        caching = self.enable_plan_caching and self.cache_scope == "global"
        generation = secrets.token_hex(8) if caching else None
        gen = {_GENERATION: generation} if generation else None
        plans = [dataclasses.replace(p, planner_data=gen) for p in plans]
        if plans:
            # the storage writer's coordinator reads the record here (full mode lays tensors out in
            # their original shapes); one copy, on the coordinator's own plan
            plans[0] = dataclasses.replace(plans[0], planner_data={**(gen or {}), METADATA_KEY: record.to_json()})
        self.report = SaveReport(
            bytes_per_rank=tuple(_plan_bytes(p) for p in plans), items=sum(len(p.items) for p in plans), cached=False
        )
        logger.info("save plan: %d items, max/mean bytes per rank %.2f", self.report.items, self.report.balance)
        # held back until this rank's finish_plan: only a global plan every rank received may be reused
        # (a private copy of the metadata: DCP hands `metadata` to the storage writer, which may rewrite it)
        self._staged_global = (generation, full, plans, copy.deepcopy(metadata)) if generation else None
        self.global_plan, self.metadata = plans, metadata
        return plans, metadata

    def _reuses_held(self, plan: SavePlan) -> bool:
        """Whether ``plan`` is a cached (empty) plan of the generation this coordinator holds."""
        data = plan.planner_data or {}
        return bool(data.get("cached")) and self._generation is not None and data.get(_GENERATION) == self._generation

    def _substitute_cached(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        """(coordinator) Every rank's full local plan: a cached (empty) one replaced by this coordinator's
        copy of it, which must be of the generation the coordinator holds (else every cache is dropped
        and this save fails before anything is written)."""
        out: list[SavePlan] = []
        for i, plan in enumerate(all_plans):
            if plan.usable:
                out.append(plan)
            elif self._cached_all is not None and i < len(self._cached_all) and self._reuses_held(plan):
                out.append(self._cached_all[i])
            else:
                held = self._generation if self._cached_all is not None else None
                self._drop_caches()
                raise SpecError(
                    f"rank {i} reused a cached save plan (generation {(plan.planner_data or {}).get(_GENERATION)}) "
                    f"that this coordinator does not hold (it holds {held}): a previous save failed part-way or "
                    "planners were not reused alike on every rank. Nothing was written; the planners drop their "
                    "caches, so saving again plans afresh"
                )
        return out

    def _check_replicas(self, plans: list[SavePlan]) -> None:
        by_stage: dict[int, dict[tuple[int, str], list[int]]] = {}
        for plan in plans:
            rank = plan.planner_data["rank"]
            stage = self.layout.coords(rank).pp
            digest = tuple(plan.planner_data["digest"])
            by_stage.setdefault(stage, {}).setdefault(digest, []).append(rank)
        problems = []
        for stage, groups in sorted(by_stage.items()):
            if len(groups) > 1:
                parts = ", ".join(f"ranks {ranks} hold {count} such tensors" for (count, _), ranks in groups.items())
                problems.append(f"stage {stage}: {parts}")
        if problems:
            raise ReplicaMismatch(
                "ranks of one pipeline stage disagree on their replicated/sharded tensors (keys, dtypes or "
                f"global shapes): {'; '.join(problems)}. Each rank must hold the same keys; give per-rank "
                "values rank-unique keys and list them in rank_local=, and check the ShardSpec sizes."
            )

    def _dedup(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Keep one writer per chunk and per object; identical objects only."""
        chunk_owner: dict[MetadataIndex, tuple[int, WriteItem]] = {}
        object_holders: dict[str, list[tuple[int, str]]] = {}
        tensor_meta: dict[str, tuple[int, torch.Size, torch.dtype]] = {}
        for i, plan in enumerate(plans):
            objects = plan.planner_data["objects"]
            for item in plan.items:
                fqn = item.index.fqn
                if item.type == WriteItemType.BYTE_IO:
                    object_holders.setdefault(fqn, []).append((i, objects[fqn]))
                    continue
                td = item.tensor_data
                if td is None:
                    raise SpecError(f"{fqn}: rank {i} planned a tensor item without tensor data")
                seen = tensor_meta.setdefault(fqn, (i, td.size, td.properties.dtype))
                if (seen[1], seen[2]) != (td.size, td.properties.dtype):
                    raise SpecError(
                        f"{fqn}: rank {seen[0]} saves global shape {tuple(seen[1])} {seen[2]} but rank {i} saves "
                        f"{tuple(td.size)} {td.properties.dtype}; their specs or sizes disagree"
                    )
                prior = chunk_owner.get(item.index)
                prior_td = prior[1].tensor_data if prior is not None else None
                if prior is not None and prior_td is not None and prior_td.chunk.sizes != td.chunk.sizes:
                    raise SpecError(
                        f"{fqn}: ranks {prior[0]} and {i} both write a chunk at offset {tuple(td.chunk.offsets)} "
                        f"with sizes {tuple(prior_td.chunk.sizes)} and {tuple(td.chunk.sizes)}"
                    )
                if prior is None:
                    chunk_owner[item.index] = (i, item)
        object_owner: dict[str, int] = {}
        for fqn, holders in object_holders.items():
            digests = {d for _, d in holders}
            if len(digests) > 1:
                ranks = sorted({r for r, _ in holders})
                raise ReplicaMismatch(
                    f"object {fqn!r} differs between ranks {ranks}: one key can hold one value. Give per-rank "
                    "values rank-unique keys (e.g. f'...rank{rank}...') and list them in rank_local="
                )
            object_owner[fqn] = holders[zlib.crc32(fqn.encode()) % len(holders)][0]
        out = []
        for i, plan in enumerate(plans):
            kept = [
                item
                for item in plan.items
                if (item.type == WriteItemType.BYTE_IO and object_owner[item.index.fqn] == i)
                or (item.type != WriteItemType.BYTE_IO and chunk_owner[item.index][0] == i)
            ]
            out.append(dataclasses.replace(plan, items=kept))
        return out

    # -- 4. finish ---------------------------------------------------------------------------------
    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """(all ranks) This rank's final plan: the coordinator's, or this instance's cached one. With the
        "global" cache, a usable plan promotes what this round staged (this rank's local plan; on the
        coordinator, the global plan) under the plan's generation."""
        self._round_open = False
        gen = (new_plan.planner_data or {}).get(_GENERATION)
        if not new_plan.usable:
            if self._cached_final is None or gen != self._generation:
                self._drop_caches()
                raise SpecError(
                    f"rank {self.rank}: the coordinator sent a cached plan (generation {gen}) this rank does not "
                    "hold; saving again plans afresh"
                )
            # The storage layer may put per-save data (a new save id) on this round's plan; keep it.
            plan = dataclasses.replace(self._cached_final, storage_data=new_plan.storage_data)
        else:
            plan = new_plan
            if self.enable_plan_caching and self.cache_scope == "global":
                self._cached_final = new_plan
                self._generation = gen
                if self._pending is not None:
                    self._signature, self._cached_local = self._pending
                staged = self._staged_global
                if staged is not None and staged[0] == gen:
                    self._cached_all, self._cached_global = staged[1], (staged[2], staged[3])
                else:
                    # another coordinator built this plan: a global plan held from before is of another
                    # generation, and must not pass as this one's
                    self._cached_all = self._cached_global = None
        self._pending = None
        self._staged_global = None
        self.plan = plan
        return plan

    def _drop_caches(self) -> None:
        """Forget every cached and staged plan: the next save plans afresh."""
        self._signature = None
        self._cached_local = None
        self._pending = None
        self._cached_final = None
        self._generation = None
        self._cached_all = None
        self._cached_global = None
        self._staged_global = None

    def release_state(self, *, scope: bool = False) -> None:
        """(all ranks, after ``dcp.save`` returned or raised) Drop this save's state dict, tensors, object
        bytes, final plan and (coordinator) metadata, so a planner kept for reuse pins no memory between
        saves; the plan caches stay. With ``scope``, also drop the process group and name map: call
        :meth:`rescope` before the next save."""
        self.entries = {}
        self.mappings = {}
        self.state_dict = {}
        self._object_bytes = {}
        self.global_plan = []
        for name in ("plan", "metadata"):
            self.__dict__.pop(name, None)
        if scope:
            self.process_group = None
            self.name_map = None

    def rescope(
        self,
        layout: ParallelLayout,
        specs: Mapping[str, SpecLike] | SpecRules | None = None,
        *,
        rank: int | None = None,
        name_map: NameMap | None = None,
        process_group: Any = None,
        rank_local: Sequence[str] = (),
    ) -> None:
        """(all ranks, between saves) Plan the next saves for this scope (the constructor's arguments).
        The local plan cache stays -- its signature holds the layout, rank and every key's geometry, so a
        plan is reused only where it is still exact -- while a "global" cache is dropped: it also
        depends on who the coordinator is."""
        self._set_scope(layout, specs, rank, name_map, process_group, rank_local)
        if self.cache_scope == "global":
            self._drop_caches()

    # -- 5. data -----------------------------------------------------------------------------------
    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        """(all ranks, from the storage writer's threads) The tensor or object bytes of one item."""
        entry = self.entries.get(write_item.index.fqn)
        if entry is None:
            raise SpecError(f"rank {self.rank} was asked to write {write_item.index.fqn!r}, which it does not hold")
        if entry.kind == "object":
            return io.BytesIO(self._object_bytes[entry.key])
        return entry.value

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self.entries[index.fqn].value


def _carries_no_data(entry: Entry) -> bool:
    """An empty piece of a non-empty tensor (an uneven split giving a rank nothing) is not written.

    Its offset can coincide with a neighbour's real chunk, and it adds nothing to the checkpoint. An
    empty *global* tensor is still written once, so its key and shape are recorded.
    """
    chunk, shape = entry.chunk, entry.global_shape
    if chunk is None or shape is None:
        return False
    return math.prod(chunk.sizes) == 0 and math.prod(shape) != 0


def _tensor_item(entry: Entry, properties: dict[tuple[Any, ...], TensorProperties]) -> WriteItem:
    """The write item of a tensor entry; ``properties`` shares one ``TensorProperties`` per distinct
    value among a plan's items (building one per item was ~1/8 of a local plan's time)."""
    chunk, shape = entry.chunk, entry.global_shape
    if chunk is None or shape is None:
        raise SpecError(f"{entry.key}: tensor entry without a chunk")
    whole = entry.kind == "tensor" and not entry.sharded_axes
    value = entry.value
    # the fields create_from_tensor reads (memory_format is always contiguous_format there)
    fields = (value.dtype, value.layout, value.requires_grad, value.is_pinned())
    props = properties.get(fields)
    if props is None:
        props = properties[fields] = TensorProperties.create_from_tensor(value)
    return WriteItem(
        index=MetadataIndex(entry.key, chunk.offsets),
        type=WriteItemType.TENSOR if whole else WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk=chunk, properties=props, size=shape),
    )


def _plan_bytes(plan: SavePlan) -> int:
    total = 0
    for item in plan.items:
        if item.tensor_data is not None:
            total += item.tensor_storage_size() or 0
    return total

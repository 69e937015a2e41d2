"""ParallelSavePlanner: TP/PP/DP-aware save planning for ``dcp.save``.

Call order (as ``dcp.save`` drives it; "all" = every rank, "coord" = rank 0 of the group)::

    1. (all)   set_up_planner(state_dict, storage_meta, is_coordinator)
    2. (all)   create_local_plan()            -> only the items this rank writes
    3. (coord) create_global_plan(all_plans)  -> checks replicas, dedups, builds Metadata
    4. (all)   finish_plan(plan)              -> this rank's final plan (from cache when unchanged)
    5. (all)   resolve_data(item)             -> tensor or bytes, called from writer threads
    6. (caller, optional) release_state()     -> drop this save's tensors before keeping the planner

Plain local tensors are mapped to global chunks by their :class:`~smpckpt.ShardSpec`; DTensors carry
their own placement; other values are pickled (``torch.save``) objects. The coordinator checks the
plans' structure (spec rules that match nothing, ranks of a stage that disagree on their tensors or
ties; values in :mod:`._replica_values`) and deduplicates them (one writer per chunk and per object)."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import _validate_global_plan
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import Replicate

from smpckpt._checks import check_flag
from smpckpt._gc import gc_paused
from smpckpt.errors import ReplicaMismatch, SpecError
from smpckpt.model.layout import METADATA_KEY, RESERVED, LayoutRecord, NameMap, ParallelLayout
from smpckpt.model.specs import SpecLike, SpecRules
from smpckpt.planners._cache import PlanCache, check_plan_ranks, compact, hinted, structure_signature, tensor_write_item
from smpckpt.planners._entries import (
    Entry,
    LayoutScope,
    ObjectBytes,
    carries_no_data,
    dtensor_is_owner,
    encode_object,
    gather_ties,
    saved_ties,
)
from smpckpt.planners._replica_values import (
    RANK_WAY,
    SPLIT_CODES,
    assign_owners,
    check_duplicate_writers,
    check_held,
    check_replica_digests,
    check_replica_values,
    checked_codes,
    dtensor_values,
    rank_values,
    replica_digest,
    stage_values,
    undigestable,
)
from smpckpt.storage.format._safe_pickle import warn_pickled

__all__ = ["ParallelSavePlanner", "SaveReport", "check_replica_digests", "gather_ties"]
__all__ += ["replica_digest", "dedup_plans", "global_save_plan", "tiling_errors", "ObjectBuffer"]


class ObjectBuffer(io.BytesIO):
    """An :class:`ObjectBytes` record in its owner's buffer (unchanged until the save is done), not copied."""


def dedup_plans(plans: list[SavePlan], rank_local: Any) -> list[SavePlan]:
    """(coordinator) ``plans`` with one writer per chunk and per object.

    Ranks that hold the same chunk (replicas the ownership choice could not keep apart, or pieces of
    an uneven split) must agree on its global shape, dtype and sizes, and something must have compared
    their values (:func:`check_duplicate_writers`); objects held by several ranks must be identical
    (per-rank values need rank-unique keys), and one holder, chosen by the key's CRC32, writes each."""
    chunk_owner: dict[MetadataIndex, tuple[int, torch.Size]] = {}
    writers: dict[MetadataIndex, list[int]] = {}  # chunks more than one rank plans: their ranks
    object_holders: dict[str, list[tuple[int, str]]] = {}
    tensor_meta: dict[str, tuple[int, torch.Size, torch.dtype]] = {}
    losers: set[int] = set()  # ranks with an item another rank writes: only their plans are filtered
    for i, plan in enumerate(plans):
        objects = plan.planner_data["objects"]
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                object_holders.setdefault(fqn, []).append((i, objects[fqn]))
                continue
            td = cast(TensorWriteData, item.tensor_data)  # our local plans give every tensor item its data
            seen = tensor_meta.setdefault(fqn, (i, td.size, td.properties.dtype))
            if (seen[1], seen[2]) != (td.size, td.properties.dtype):
                raise SpecError(
                    f"{fqn}: rank {seen[0]} saves global shape {tuple(seen[1])} {seen[2]} but rank {i} saves "
                    f"{tuple(td.size)} {td.properties.dtype}; their specs or sizes (or held_by_some copies) disagree"
                )
            prior = chunk_owner.setdefault(item.index, (i, td.chunk.sizes))
            if prior[0] != i:
                losers.add(i)
                if prior[1] != td.chunk.sizes:
                    raise SpecError(
                        f"{fqn}: ranks {prior[0]} and {i} both write a chunk at offset {tuple(td.chunk.offsets)} "
                        f"with sizes {tuple(prior[1])} and {tuple(td.chunk.sizes)}"
                    )
                if all(td.chunk.sizes):  # an empty piece of an uneven split holds no value
                    writers.setdefault(item.index, [prior[0]]).append(i)
    check_duplicate_writers(writers, rank_local)
    object_owner: dict[str, int] = {}
    for fqn, holders in object_holders.items():
        digests = {d for _, d in holders}
        if len(digests) > 1:
            ranks = sorted({r for r, _ in holders})
            raise ReplicaMismatch(
                f"object {fqn!r} differs between ranks {ranks}: one key can hold one value. Give per-rank "
                f"values rank-unique keys (e.g. f'...rank{{rank}}...') {RANK_WAY}"
            )
        object_owner[fqn] = holders[zlib.crc32(fqn.encode()) % len(holders)][0]
        losers.update(r for r, _ in holders if r != object_owner[fqn])

    def owner(item: WriteItem) -> int:
        return object_owner[item.index.fqn] if item.type == WriteItemType.BYTE_IO else chunk_owner[item.index][0]

    return [
        dataclasses.replace(p, items=[it for it in p.items if owner(it) == i]) if i in losers else p
        for i, p in enumerate(plans)
    ]


def global_save_plan(plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata, tuple[int, ...]]:
    """(coordinator) What ``create_default_global_save_plan(plans)`` returns -- each item's index hint
    its chunk's position in the tensor's metadata, the metadata in plan order -- and each plan's bytes
    (its chunks' own: DCP's ``tensor_storage_size`` counts a shard as its whole global tensor)."""
    md: dict[str, STORAGE_TYPES] = {}
    out: list[SavePlan] = []
    per_rank: list[int] = []
    for rank, plan in enumerate(plans):
        items: list[WriteItem] = []
        nbytes = 0
        for item in plan.items:
            fqn = item.index.fqn
            entry = md.get(fqn)
            if entry is not None and (item.type != WriteItemType.SHARD or not isinstance(entry, TensorStorageMetadata)):
                raise SpecError(f"{fqn}: written twice in the global plan (rank {rank} among its writers)")
            if item.type == WriteItemType.BYTE_IO:
                md[fqn] = BytesStorageMetadata()
                items.append(item)
                continue
            data = cast(TensorWriteData, item.tensor_data)
            if entry is None:
                entry = md[fqn] = TensorStorageMetadata(properties=data.properties, size=data.size, chunks=[])
            tensor = cast(TensorStorageMetadata, entry)
            items.append(hinted(item, len(tensor.chunks)))
            tensor.chunks.append(data.chunk)
            nbytes += math.prod(data.chunk.sizes) * data.properties.dtype.itemsize
        out.append(dataclasses.replace(plan, items=items))
        per_rank.append(nbytes)
    return out, Metadata(md), tuple(per_rank)


def tiling_errors(plans: list[SavePlan], metadata: Metadata) -> list[str]:
    """(coordinator) DCP's ``_validate_global_plan(plans, metadata)``: the same errors, in the same order.
    A tensor whose chunks are the cells of one grid (every TP/DP/ZeRO split) is proven tiled in one pass
    over its chunks; DCP's pairwise sweep, slow at scale, checks only the rest."""
    rest: dict[str, STORAGE_TYPES] = {
        key: value
        for key, value in metadata.state_dict_metadata.items()
        if isinstance(value, TensorStorageMetadata) and len(value.size) and not _grid_tiled(value.size, value.chunks)
    }
    if not rest:
        return []
    return _validate_global_plan(plans, dataclasses.replace(metadata, state_dict_metadata=rest))


def _grid_tiled(size: torch.Size, chunks: Sequence[ChunkStorageMetadata]) -> bool:
    """True when ``chunks`` are exactly the cells of the grid their boundaries draw on ``size``: each
    chunk one cell, no cell twice, as many chunks as cells -- so they are in bounds, disjoint and fill
    the tensor. False says nothing (DCP's check decides)."""
    dims = len(size)
    if not chunks:
        return False
    if len(chunks) == 1:
        return all(o == 0 for o in chunks[0].offsets) and tuple(chunks[0].sizes) == tuple(size)
    rows = [(*c.offsets, *c.sizes) for c in chunks]
    if any(len(r) != 2 * dims for r in rows):
        return False
    table = np.array(rows, dtype=np.int64).reshape(len(rows), 2 * dims)
    cells = np.empty((len(rows), dims), dtype=np.int64)
    shape = []
    for d in range(dims):
        starts, ends = table[:, d], table[:, d] + table[:, dims + d]
        line = np.union1d(starts, ends)
        if line[0] != 0 or line[-1] != size[d]:
            return False
        cells[:, d] = np.searchsorted(line, starts)
        if not np.array_equal(np.searchsorted(line, ends), cells[:, d] + 1):  # not one cell (or empty)
            return False
        shape.append(len(line) - 1)
    if math.prod(shape) != len(rows):
        return False
    return len(np.unique(np.ravel_multi_index(cells.T, shape))) == len(rows)


logger = logging.getLogger(__name__)


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
        return max(self.bytes_per_rank) / (total / len(self.bytes_per_rank)) if total else 1.0


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
        held_by_some: globs (as spec rules match: a parameter's optimizer state follows it) of keys only some
            ranks of a stage hold, as copies of each other (experts under their global ids, each on its DP
            ranks): their holders must agree on dtype, shape and values (compared by sample); one writes.
        replica_owner: ``"balanced"`` spreads replicated tensors over their replicas by bytes;
            ``"lowest"`` writes them all from the lowest rank of each group.
        enable_plan_caching: reuse this instance's plans while the state's structure is unchanged.
        dedup_tied: write a tensor held under several keys (tied parameters) once, under its first key,
            as the README's "Tied parameters" says; ``False`` writes each key's bytes.
        verify_replicas: compare the values of ranks holding the same piece of a tensor by a sample (the
            README's "Replica checks"); ``False`` for replicas meant to differ (``held_by_some`` keys stay
            compared).
        cache_scope: what the plan cache reuses (with ``enable_plan_caching``; the README's "Plan caching"):
            ``"global"`` (default) the coordinator's global plan too, every rank reusing its planner alike;
            ``"local"`` a rank's own local plan only (any mix of reused and fresh planners is correct, and
            object values may change without a re-plan).

    Every plan and cache lives on the instance (DCP's class-level plan cache is never used: it can hand
    one rank's plan to another when several planners share a process).

    Why reuse stays exact, even across failed saves: :mod:`smpckpt.planners._cache`."""

    def __init__(
        self,
        layout: ParallelLayout,
        specs: Mapping[str, SpecLike] | SpecRules | None = None,
        *,
        rank: int | None = None,
        name_map: NameMap | None = None,
        process_group: Any = None,
        rank_local: Sequence[str] = (),
        held_by_some: Sequence[str] = (),
        replica_owner: str = "balanced",
        enable_plan_caching: bool = True,
        cache_scope: Literal["global", "local"] = "global",
        dedup_tied: bool = True,
        verify_replicas: bool = True,
    ) -> None:
        super().__init__()
        self._set_scope(layout, specs, rank, name_map, process_group, rank_local, held_by_some)
        if replica_owner not in ("balanced", "lowest"):
            raise SpecError(f"replica_owner must be 'balanced' or 'lowest', got {replica_owner!r}")
        if cache_scope not in ("global", "local"):
            raise SpecError(f"cache_scope must be 'global' or 'local', got {cache_scope!r}")
        self.replica_owner = replica_owner
        self.enable_plan_caching = check_flag("enable_plan_caching", enable_plan_caching)
        self.cache_scope = cache_scope
        self.dedup_tied = check_flag("dedup_tied", dedup_tied)  # "False" read as True
        self.verify_replicas = check_flag("verify_replicas", verify_replicas)
        self.report: SaveReport | None = None
        self.entries: dict[str, Entry] = {}
        self.tied: dict[str, str] = {}
        self.dtensors = ""  #: this rank's DTensor layout (``LayoutScope.dtensor_layout``), sent in its plan
        self._cache = PlanCache(cache_scope if enable_plan_caching else "off")

    # -- 1. set up ---------------------------------------------------------------------------------
    @gc_paused()  # an entry and a chunk per key, no cycles to collect
    def set_up_planner(
        self, state_dict: dict[str, Any], storage_meta: StorageMeta | None = None, is_coordinator: bool = False
    ) -> None:
        """(all ranks, once per save) Resolve this rank's state dict against the layout: global keys
        (PP renaming), global chunks (specs, DTensor placements), objects."""
        self._cache.begin_round(self._rank_arg)
        self.entries, self.mappings = self._resolve(state_dict)
        if self.held_split:  # equal pieces (zeros at init) would pass the holders' value check (rev64f F2)
            raise SpecError(
                f"{self.held_split[0]}: held_by_some saves it whole, but a spec rule matches it too: narrow a glob "
                "meant for other layers; hold a TP-split expert as a DTensor (saved by its pieces) or stack them"
            )
        self.tied = saved_ties(self.entries) if self.dedup_tied else {}
        self.state_dict = state_dict
        self.dtensors = self.dtensor_layout(state_dict.get(RESERVED.model))
        self.is_coordinator = is_coordinator
        self._object_bytes: dict[str, bytes | ObjectBuffer] = {}

    # -- 2. local plan -----------------------------------------------------------------------------
    @gc_paused()
    def create_local_plan(self) -> SavePlan:
        """(all ranks) Only the items this rank writes (it owns its shards and, by a deterministic
        byte-balanced choice every replica computes alike, some replicas), plus a constant-size
        replica digest; an empty "cached" plan when the structure is unchanged since the last save.

        Every rank runs this at every save: its cost is O(own keys), whatever the world size."""
        object_digests = self._serialise_objects()
        props: dict[str, tuple[Any, ...]] = {}  # TensorProperties fields, read once for signature and items
        # the signature only serves the plan cache; the local scope leaves object values out (they change
        # the plan's object digests only, refreshed on a hit)
        signature = None
        if self.enable_plan_caching:
            signature = structure_signature(self, None if self.cache_scope == "local" else object_digests, props)
        # plain tensors every rank of the stage must agree on (the replica digest's rows), and of them the
        # replicas other ranks hold too (ownership and value checks); in key order, as both want them
        shared = [e for e in self.entries.values() if e.kind == "tensor" and not e.rank_local]
        shared.sort(key=lambda e: e.key)
        # a tied key split over TP or DP stays on its group's lists (ranks holding an empty piece of it cannot
        # tell the tie: the ties of split keys are agreed per group, check_tie_groups), writing nothing
        tied = self.tied
        replicas = [e for e in shared if e.sharded_axes != _SPLIT_OVER_BOTH and (e.sharded_axes or e.key not in tied)]
        checked, codes, fresh = self._replica_values(replicas, shared)
        hit = self._cache.hit(signature, self.rank, object_digests, fresh)
        if hit is not None:
            return hit

        # Tensor.nbytes: numel x itemsize, in one call (a view's, not its storage's)
        replicated = [(e.key, int(e.value.nbytes), e.sharded_axes) for e in replicas]
        if tied:  # a tied key (split: kept on the lists) writes nothing, its first key's bytes: weighs nothing
            replicated = [(k, 0, a) if k in tied else (k, n, a) for k, n, a in replicated]
        owners = assign_owners(self.layout, self.rank, replicated, lowest_rank=self.replica_owner == "lowest")
        items: list[WriteItem] = []
        properties: dict[tuple[Any, ...], TensorProperties] = {}
        objects: dict[str, str] = {}
        mappings: dict[str, Any] = {}
        original: dict[str, tuple[int, ...]] = {}
        rank, all_mappings, add = self.rank, self.mappings, items.append
        for entry in self.entries.values():
            key = entry.key
            if key in tied:  # its bytes are its first key's; only its name is recorded
                mappings[key] = all_mappings[key]
                continue
            kind = entry.kind
            if kind == "object":
                add(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
                objects[key] = object_digests[key]
            elif kind == "tensor" and not entry.rank_local and owners.get(key, rank) != rank:
                continue  # another replica writes it
            elif (kind == "dtensor" and not dtensor_is_owner(entry)) or carries_no_data(entry):
                continue
            else:
                add(_tensor_item(entry, properties, props.get(key)))
            mappings[key] = all_mappings[key]
            if entry.original_global_shape is not None:
                original[key] = entry.original_global_shape
        planner_data: dict[str, Any] = {
            "rank": self.rank,
            "matched": sum(1 for e in self.entries.values() if e.specs),  # keys a spec rule matched
            "digest": replica_digest(shared, self.tied),
            "objects": objects,
            "mappings": mappings,
            "original_shapes": original,
            "tied": dict(self.tied),
            "dtensors": self.dtensors,
            **fresh,
        }
        if axes := {a: sorted(self.entries[a].sharded_axes) for a in tied if self.entries[a].sharded_axes}:
            planner_data["tie_axes"] = axes  # split ties only: readers take .get("tie_axes") or ()
        coords = self.layout.coords(self.rank)
        if fresh["values"] is not None and coords.tp == 0 and coords.dp == 0:  # one key list per stage
            planner_data["value_keys"] = (tuple(e.key for e in checked), codes)
        plan = compact(SavePlan(items, planner_data=planner_data))  # gathered on the coordinator
        self._cache.remember(signature, plan)
        return plan

    def _replica_values(
        self, replicas: list[Entry], shared: list[Entry]
    ) -> tuple[list[Entry], bytes, dict[str, bytes | None]]:
        """The tensors whose values other ranks hold too (of ``replicas``, in key order; by the layout
        alone, ``checked_codes``), their split codes, and what this rank sends about their values
        (``planner_data`` fields; ``None``: nothing to compare); ``shared``: every plain tensor other
        ranks agree on (for the pieces other stages may hold, ``stage_values``)."""
        verify = self.verify_replicas  # held_by_some copies are compared even without it (rev64e F4)
        wanted = checked_codes(self.layout) if verify else ()
        checked: list[Entry] = []
        code_list: list[int] = []
        for e in replicas if wanted else ():  # in key order (the caller sorted them)
            code = SPLIT_CODES[e.sharded_axes]
            if code in wanted:
                checked.append(e)
                code_list.append(code)
        codes = bytes(code_list)
        try:
            values = rank_values(self.layout, self.rank, [e.value for e in checked], codes) if wanted else None
            dvalues = self._dtensor_values() if verify else None
            svalues = stage_values(self.layout, self.rank, self.name_map, shared, self.tied) if verify else None
            held = [self.entries[k] for k in self.held_keys]  # by piece, as DTensors: the holders are any ranks
            pieces = [(e.key, c.offsets, c.sizes, e.value) for e in held if e.kind == "tensor" and (c := e.chunk)]
            hvalues = dtensor_values(pieces) if pieces else None
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            raise undigestable([(e.key, e.value) for e in self.entries.values() if e.kind != "object"], exc) from exc
        fresh = {"values": values, "dtensor_values": dvalues, "stage_values": svalues, "held_values": hvalues}
        return checked, codes, fresh

    def _dtensor_values(self) -> bytes | None:
        """The value digests of the DTensor pieces this rank holds that other ranks may hold too (checked
        by piece at the coordinator: a DTensor's placements, not the layout, say which ranks hold the
        same piece); ``None`` when it holds no such piece."""
        pieces = []
        world = dist.get_world_size(self.process_group) if dist.is_available() and dist.is_initialized() else 1
        for e in self.entries.values():
            if e.kind == "dtensor" and not e.rank_local and e.chunk is not None and _replicated(e, world):
                pieces.append((e.key, e.chunk.offsets, e.chunk.sizes, e.value))
        return dtensor_values(pieces) if pieces else None

    def _serialise_objects(self) -> dict[str, str]:
        """Serialise this rank's objects once (``resolve_data`` hands out these bytes); their digests. Warns
        naming those a load takes only with ``allow_pickle``."""
        digests: dict[str, str] = {}
        memo: dict[bytes, bytes] = {}  # this save's plain values, each torch.save'd once
        odd: dict[bytes, set[int]] = {}  # the others (rare): each distinct blob checked once (2,000 groups' np lr)
        for entry in self.entries.values():
            if entry.kind != "object":
                continue
            value = entry.value
            if isinstance(value, ObjectBuffer):
                with value.getbuffer() as view:  # read in place, released: the writer takes it whole later
                    digests[entry.key] = hashlib.sha1(view).hexdigest()
                self._object_bytes[entry.key] = value
                continue
            raw = bytes(value) if isinstance(value, ObjectBytes) else encode_object(value, memo, odd)
            self._object_bytes[entry.key] = raw
            digests[entry.key] = hashlib.sha1(raw).hexdigest()
        if odd:  # stock DCP saves them too: a save says so, not the restart's load
            warn_pickled(odd, ((e.key, e.value) for e in self.entries.values()))
        return digests

    # -- 3. global plan (coordinator) --------------------------------------------------------------
    @gc_paused()
    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """(coordinator) Compare replica digests per stage, dedup objects, build the ``Metadata``
        (with the :class:`~smpckpt.model.layout.LayoutRecord`) and check that the chunks tile every tensor."""
        reused = self._cache.reuse_global(all_plans)
        if reused is not None:
            check_replica_values(all_plans, self._cache.all_plans or [], self.layout)
            check_held(all_plans, self._cache.all_plans or [])
            plans, empty, metadata = reused
            self.report = dataclasses.replace(self.report, cached=True) if self.report else None
            self.global_plan, self.metadata = plans, metadata
            return empty, metadata
        full = self._cache.substitute(all_plans)
        self.layout.check_world_size(len(full), "dcp.save's world")
        check_plan_ranks(full, self.layout, self.rules, "dcp.save")
        self.rules.check_matched(any((p.planner_data or {}).get("matched", 1) for p in full))
        check_replica_digests(self.layout, full)
        check_replica_values(all_plans, full, self.layout)  # this save's values; cached plans' key lists
        tied = gather_ties(full)
        deduped = dedup_plans(full, self._rank_local)  # refuses held_by_some keys of another dtype or shape
        check_held(all_plans, full)
        plans, metadata, per_rank = global_save_plan(deduped)
        mappings: dict[str, Any] = {}
        original: dict[str, tuple[int, ...]] = {}
        for plan in full:
            mappings.update(plan.planner_data["mappings"])
            original.update(plan.planner_data.get("original_shapes", {}))
        dtensors = LayoutRecord.world_dtensors([plan.planner_data.get("dtensors", "") for plan in full])
        rules, rank_local = tuple(self.rules.to_records()), self._rank_local_globs
        record = LayoutRecord(self.layout, rules, rank_local, original_shapes=original, tied=tied, dtensors=dtensors)
        mappings[METADATA_KEY] = record.to_json()
        metadata = dataclasses.replace(metadata, planner_data=mappings)
        errors = tiling_errors(plans, metadata)
        if errors:
            shown = "; ".join(errors[:5])
            raise SpecError(
                f"the ranks' shards do not tile their global tensors ({len(errors)} problems): {shown}. "
                "Check that every rank gives the same specs and sizes."
            )
        # held back until this rank's finish_plan: only a global plan every rank received may be reused
        gen = self._cache.stage_global(full, plans, metadata)
        plans = [compact(dataclasses.replace(p, planner_data=gen)) for p in plans]  # scattered to the ranks
        if plans:
            # the storage writer's coordinator reads the record here (full mode lays tensors out in
            # their original shapes); one copy, on the coordinator's own plan
            plans[0] = dataclasses.replace(plans[0], planner_data={**(gen or {}), METADATA_KEY: record.to_json()})
        self.report = SaveReport(per_rank, items=sum(len(p.items) for p in plans), cached=False)
        logger.info("save plan: %d items, max/mean bytes per rank %.2f", self.report.items, self.report.balance)
        self.global_plan, self.metadata = plans, metadata
        return plans, metadata

    # -- 4. finish ---------------------------------------------------------------------------------
    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """(all ranks) This rank's final plan: the coordinator's, or this instance's cached one. With the
        "global" cache, a usable plan promotes what this round staged (this rank's local plan; on the
        coordinator, the global plan) under the plan's generation."""
        plan = self._cache.finish(new_plan, self.rank)
        self.plan = plan
        return plan

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
        held_by_some: Sequence[str] = (),
    ) -> None:
        """(all ranks, between saves) Plan the next saves for this scope (the constructor's arguments).
        The local plan cache stays -- its signature holds the layout, rank and every key's geometry, so a
        plan is reused only where it is still exact -- while a "global" cache is dropped: it also
        depends on who the coordinator is."""
        self._set_scope(layout, specs, rank, name_map, process_group, rank_local, held_by_some)
        if self.cache_scope == "global":
            self._cache.drop()

    # -- 5. data -----------------------------------------------------------------------------------
    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        """(all ranks, from the storage writer's threads) The tensor or object bytes of one item."""
        entry = self.entries.get(write_item.index.fqn)
        if entry is None:
            raise SpecError(f"rank {self.rank} was asked to write {write_item.index.fqn!r}, which it does not hold")
        if entry.kind != "object":
            return entry.value
        raw = self._object_bytes[entry.key]
        if isinstance(raw, ObjectBuffer):
            raw.seek(0)  # the writer reads it in place (getbuffer): a large user_content is not copied
            return raw
        return io.BytesIO(raw)


#: a tensor split over both TP and DP is held by one rank: no replica to assign
_SPLIT_OVER_BOTH = frozenset({"tp", "dp"})


def _replicated(entry: Entry, world: int) -> bool:
    """Whether other ranks may hold this DTensor piece too: a ``Replicate`` mesh dim, or a mesh that
    spans only part of the job (each copy of it holds the same pieces)."""
    dt = entry.dtensor
    if dt is None:
        return False
    return any(isinstance(p, Replicate) for p in dt.placements) or dt.device_mesh.size() < world


def _tensor_item(
    entry: Entry, properties: dict[tuple[Any, ...], TensorProperties], fields: tuple[Any, ...] | None = None
) -> WriteItem:
    """The write item of a tensor entry; ``properties`` shares one ``TensorProperties`` per distinct value
    among a plan's items. ``fields``: the tensor's (dtype, layout, requires_grad, pinned), if read already."""
    chunk, shape = cast(ChunkStorageMetadata, entry.chunk), cast(torch.Size, entry.global_shape)
    whole = entry.kind == "tensor" and not entry.sharded_axes
    value = entry.value
    if fields is None:
        # the fields create_from_tensor reads (memory_format is always contiguous_format there)
        fields = (value.dtype, value.layout, value.requires_grad, value.is_pinned())
    props = properties.get(fields)
    if props is None:
        props = properties[fields] = TensorProperties.create_from_tensor(value)
    return tensor_write_item(entry.key, chunk, props, shape, WriteItemType.TENSOR if whole else WriteItemType.SHARD)

"""ParallelLoadPlanner: load any saved layout into the current one (resharding), strictly by default.

Call order (as ``dcp.load`` drives it)::

    1. (all)   set_up_planner(state_dict, metadata, is_coordinator)
    2. (all)   create_local_plan()            -> read items for this rank's pieces; key/shape/dtype checks
    3. (coord) create_global_plan(all_plans)  -> unexpected-key check over every rank's requests
    4. (all)   finish_plan(plan)
    5. (all)   resolve_tensor / commit_tensor / load_bytes, called by the storage reader

The fast path and the overlap search: the README's "Load"."""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import (
    _create_read_item_for_byteio,
    _create_read_item_for_tensor,
    create_read_items_for_chunk_list,
)

from smpckpt._checks import check_flag, compile_globs
from smpckpt._gc import gc_paused
from smpckpt.errors import CheckpointCorrupt, CheckpointError, LayoutMismatch, UnsafeCheckpoint, quantized_record_fits
from smpckpt.model.layout import (
    RESERVED,
    UNREAD_KEY,
    KeyMapper,
    LayoutRecord,
    NameMap,
    ParallelLayout,
    checkpoint_original_shapes,
    checkpoint_ties,
)
from smpckpt.model.specs import SpecLike, SpecRules, stateless_when_saved
from smpckpt.planners import _key_notes as notes  # the judgement of an artifact read as it is, hints
from smpckpt.planners._cache import check_plan_ranks, compact
from smpckpt.planners._entries import (
    Entry,
    LayoutScope,
    ObjectBytes,
    number_as_tensor,
    read_object,
    set_at_path,
    tensor_as_number,
    tied_entries,
)
from smpckpt.planners._key_notes import likely_causes, module_note, nesting_mismatches, refuse_unread, unread_note
from smpckpt.planners._key_notes import show_keys as _show
from smpckpt.planners._shared_memory import SharedMemoryLoads, TiedLoads, check_destination
from smpckpt.storage.format.manifest import LOAD_ID_PREFIX, RAW_DESCRIPTOR, WHOLE_TENSORS

__all__ = ["ParallelLoadPlanner", "LoadReport"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What the last load did on this rank (``unexpected_keys`` is filled on the coordinator only)."""

    fast_path: int  #: tensors whose piece matched a saved chunk exactly
    resharded: tuple[str, ...]  #: tensors assembled from overlapping saved chunks
    missing_keys: tuple[str, ...]  #: state-dict keys not in the checkpoint (allow_partial_load only)
    unexpected_keys: tuple[str, ...]  #: checkpoint keys no rank loads (allow_partial_load only)
    cast_keys: tuple[str, ...]  #: tensors converted from the saved dtype (allow_dtype_cast)
    saved_layout: ParallelLayout | None  #: the layout recorded in the checkpoint, when there is one
    skipped_optional: tuple[str, ...] = ()  #: keys matching ``optional`` globs absent from the checkpoint
    #: destination key -> the key read for it: a tied key the checkpoint stores once (under the key it
    #: is tied to), or a key tied in the destination itself (same tensor: loaded through the other key)
    tied: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: optimizer state keys of parameters the checkpoint holds param groups but no state for (they had
    #: none when saved): not refused as missing; the resume leaves those parameters without state
    stateless_saved: tuple[str, ...] = ()
    #: optimizer state keys (this rank's) saved in a dtype other than their parameter's: kept as loaded
    own_dtype: tuple[str, ...] = ()
    #: this rank's state-dict keys the load left unfilled (missing, skipped optional): they keep their values
    unfilled: tuple[str, ...] = ()


class ParallelLoadPlanner(LayoutScope, LoadPlanner):
    """Load planner for plain TP/PP shards, DTensors and objects, from any saved layout.

    Args:
        layout, specs, rank, name_map, process_group, rank_local, held_by_some: as for
            :class:`~smpckpt.planners.ParallelSavePlanner`, describing the layout *loading*.
        allow_partial_load: skip keys missing from the checkpoint and ignore checkpoint keys nobody
            asked for, instead of raising. Skipped keys keep their values and are listed in ``report``.
        allow_dtype_cast: convert tensors saved in another dtype instead of raising.
        allow_pickle: unpickle stored objects with arbitrary classes (trusted checkpoints only);
            by default objects load ``weights_only``.
        optional: globs (``fnmatch``, ``*`` crosses dots) of keys that may be absent on either side:
            a matching state-dict key missing from the checkpoint keeps its value (listed in
            ``report.skipped_optional``) and a matching checkpoint key nobody asks for is no error.
            Everything else stays strict unless ``allow_partial_load``.
        keep_tied: globs of checkpoint keys naming which of two keys the checkpoint holds apart for one
            tied destination tensor is loaded (else both are read and must be equal).

    Tied parameters load without ``allow_partial_load``, as the README's "Tied parameters" says
    (:class:`~smpckpt.planners._shared_memory.TiedLoads`)."""

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
        allow_partial_load: bool = False,
        allow_dtype_cast: bool = False,
        allow_pickle: bool = False,
        optional: Sequence[str] = (),
        keep_tied: Sequence[str] = (),
    ) -> None:
        self._set_scope(layout, specs, rank, name_map, process_group, rank_local, held_by_some)
        # checked: "False" would read as True, making every key optional or casting (hunt73c F1)
        self.allow_partial_load = check_flag("allow_partial_load", allow_partial_load)
        self.allow_dtype_cast = check_flag("allow_dtype_cast", allow_dtype_cast)
        self.allow_pickle = check_flag("allow_pickle", allow_pickle)
        self._optional = compile_globs(optional, "optional")
        self._ties = TiedLoads(compile_globs(keep_tied, "keep_tied"))
        self._shared = SharedMemoryLoads()
        self.report: LoadReport | None = None

    @property
    def loads_weights_only(self) -> bool:
        """Objects are unpickled weights-only here, so a storage reader need not check them first."""
        return not self.allow_pickle

    def _is_optional(self, key: str) -> bool:
        return self._optional is not None and self._optional.fullmatch(key) is not None

    # -- 1. set up ---------------------------------------------------------------------------------
    @gc_paused()
    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        """(all ranks, once per load) Resolve this rank's destinations against the layout and read the
        checkpoint's :class:`~smpckpt.model.layout.LayoutRecord`."""
        if metadata is None:
            raise CheckpointCorrupt("the storage reader returned no checkpoint metadata")
        self.entries, _ = self._resolve(state_dict, metadata.state_dict_metadata)
        for entry in self.entries.values():
            if entry.kind != "object":
                check_destination(entry.key, entry.value, entry.key in metadata.state_dict_metadata)
        #: destination keys that are another key's tensor (loaded through that key)
        self.dest_tied = tied_entries(self.entries)
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator
        self._numbers: dict[str, type] = {}  # keys read as 0-d tensors into a number's place: its type
        self._decoded: dict[bytes, Any] = {}  # this load's small objects by their bytes (decode_object)
        _refuse_raw_without_our_reader(metadata)
        self._as_is = isinstance(metadata.planner_data, dict) and UNREAD_KEY in metadata.planner_data  # judged keys
        record = LayoutRecord.from_metadata(metadata)
        #: checkpoint keys stored once under another key (read from that key's bytes)
        self.saved_tied = checkpoint_ties(metadata)
        self.saved_layout = record.layout if record is not None else None
        self._refuse_partition_off(metadata)
        #: shapes tensors saved under a ShardSpec view had before it (what a full artifact's files hold;
        #: a Hugging Face folder's fused tensors in the shape an unsharded model holds them); looked up with
        #: ``get`` (``None`` for none, never ``()``: a 0-d destination would pass for one a view was undone for)
        self.saved_original_shapes = checkpoint_original_shapes(metadata)

    # -- 2. local plan -----------------------------------------------------------------------------
    @gc_paused()
    def create_local_plan(self) -> LoadPlan:
        """(all ranks) Read items for this rank's pieces -- one read per exactly matching saved chunk,
        else DCP's overlap helper -- after key, shape and dtype checks (before any data is read)."""
        md_all = self.metadata.state_dict_metadata
        items: list[ReadItem] = []
        missing: list[str] = []
        empty: list[str] = []
        resharded: list[str] = []
        cast: list[str] = []
        fast = 0
        hints: dict[tuple[Any, ...], int] = {}  # for _exact_chunk
        ties = self._ties
        ties.plan(self.entries, self.dest_tied, self.saved_tied, md_all, self.rank, self.name_map)
        sources, through, tied_covered = ties.sources, ties.through, ties.covered
        # destinations overlapping another's memory (not tied: another view): read into scratch, checked
        shared = self._shared
        shared.plan(self.entries, through.keys() | ties.compare.keys())
        # state the reader left out of a translated artifact, or another family's names read as they are:
        # refused before any key's own checks (a coincident key's shape), never skipped as optional
        evidence: dict[str, Any] = {}  # an artifact read as it is: this rank's keys for the job's judgement
        if self._as_is:
            absent = [k for k in self.entries if k not in through and sources.get(k, k) not in md_all]
            if absent:
                refuse_unread(absent, self.metadata, self.entries)
            evidence = notes.as_is_evidence(self.metadata, absent, through)
        for entry in list(self.entries.values()):
            if entry.key in through:  # tied in the destination: loaded through another key of its tensor
                continue
            entry = self._reads_into(entry)
            source = sources.get(entry.key, entry.key)
            md = md_all.get(source)
            if md is None:
                missing.append(entry.key)
                continue
            if entry.kind == "object" or not isinstance(md, TensorStorageMetadata):
                entry, md = self._object_read(entry, md, items, source)
                if entry is None:
                    continue
            entry, md = self._check_tensor(entry, md, cast)
            chunk = entry.chunk
            assert chunk is not None
            if math.prod(chunk.sizes) == 0:
                empty.append(entry.key)
                continue
            # the saved chunk that is exactly this piece, if any: one read, no overlap search
            exact = _exact_chunk(md.chunks, (tuple(chunk.offsets), tuple(chunk.sizes)), hints)
            if exact is not None:
                fast += 1
                dest, saved = MetadataIndex(entry.key, chunk.offsets), MetadataIndex(source, chunk.offsets, exact)
                zeros = [0] * len(chunk.sizes)  # the piece is the saved chunk: both start at its origin
                items.append(_create_read_item_for_tensor(dest, zeros, saved, zeros, chunk.sizes))
                continue
            found = create_read_items_for_chunk_list(source, md, [chunk])
            if source != entry.key:  # reads of the tied key's bytes, landing in this key's tensor
                found = [
                    dataclasses.replace(r, dest_index=dataclasses.replace(r.dest_index, fqn=entry.key)) for r in found
                ]
            covered = sum(math.prod(r.lengths) for r in found)
            if covered != math.prod(chunk.sizes):
                raise CheckpointCorrupt(
                    f"{entry.key}: the checkpoint's chunks cover {covered} of the {math.prod(chunk.sizes)} "
                    f"elements this rank needs (offsets {tuple(chunk.offsets)}, sizes {tuple(chunk.sizes)})"
                )
            resharded.append(entry.key)
            items.extend(found)
        skipped = [k for k in missing if self._is_optional(k)]
        missing = [k for k in missing if not self._is_optional(k)]
        # judged by the key read (a tied copy's optimizer state is read from the copy kept: rev62g F6)
        read = [sources.get(k, k) for k in missing]
        # each destination name (before a name_map) -> the key read for it: one table for the judgements by those names
        asked = {e.local_key: sources.get(k, k) for k, e in self.entries.items()}
        never = self._stateless_when_saved(missing, asked, md_all)
        missing, read = [k for k in missing if k not in never], [r for k, r in zip(missing, read) if k not in never]
        if missing and not self.allow_partial_load:
            shown = [r if r == k else f"{r} (for {k})" for k, r in zip(missing, read)]
            raise LayoutMismatch(
                f"rank {self.rank}: {len(missing)} keys are not in the checkpoint: {_show(shown)} "
                "(pass allow_partial_load=True, or strict=False to resume_from_checkpoint, to skip them)"
                + nesting_mismatches(read, md_all)
                + module_note(read, md_all)
                + likely_causes(read, md_all)
                + unread_note(self.metadata, missing, self.entries)
            )
        ties.count(items)
        shared.count(items)
        tied = {**through, **sources, **ties.compare}
        self.report = LoadReport(
            fast,
            tuple(resharded),
            tuple(missing),
            (),
            tuple(cast),
            self.saved_layout,
            tuple(skipped),
            tied,
            tuple(sorted(never)),
            tuple(RESERVED.in_own_dtype(asked, md_all)),
            tuple(self.entries[k].local_key for k in (*missing, *skipped)),
        )
        if resharded:
            logger.info("rank %d: resharding %d tensors (fast path for %d)", self.rank, len(resharded), fast)
        else:
            logger.info("rank %d: layout unchanged for all %d tensors: fast path", self.rank, fast)
        if tied:
            logger.info("rank %d: tied keys loaded through another key: %s", self.rank, _show(sorted(tied)))
        # gathered on the coordinator; "empty" and "covered" keys count as asked for in its unexpected-key check
        return compact(LoadPlan(items, planner_data={"empty": empty + tied_covered, "rank": self.rank, **evidence}))

    def _stateless_when_saved(
        self, missing: list[str], asked: Mapping[str, str], md_all: Mapping[str, Any]
    ) -> set[str]:
        """The ``missing`` keys that are state of a parameter the checkpoint holds no optimizer state for, judged by
        the destination's names, ``asked``'s, beside the keys read for them (a name_map may move ``optim.``, fix72j)."""
        if not missing:
            return set()
        local = self.entries
        owners = {k: fqn for k, (fqn, _) in self.state_params.items()}  # the spec's pairing (under a name_map)
        keys = [local[k].local_key for k in missing]
        none = set(stateless_when_saved(keys, asked, sorted(md_all), owners, self.name_map))
        return {k for k in missing if local[k].local_key in none}

    def _reads_into(self, entry: Entry) -> Entry:
        """The entry to plan reads for: one reading into scratch for a tied key the checkpoint holds
        apart (compared, ``_ties``) or a destination sharing memory with another (``_shared``)."""
        if entry.key in self._ties.compare and entry.kind != "object":  # reads into a scratch tensor of its shape
            entry = self.entries[entry.key] = dataclasses.replace(entry, value=torch.empty_like(entry.value))
        elif entry.key in self._shared.dest:
            entry = self.entries[entry.key] = self._shared.scratch(entry)
        return entry

    def _reshaped(self, entry: Entry, md: TensorStorageMetadata) -> TensorStorageMetadata | None:
        """A whole tensor stored in another shape of the same size (a fused QKV kept as ``[3h, d]`` in a
        safetensors file, loaded into a ``ShardSpec(view=[3, h/tp, d])`` layout) is the same row-major
        bytes: its metadata is replaced by the layout's shape (returned). Only where the reader says its
        tensors are whole and reshapable (full artifacts, HF folders), and only when the shape is not a
        guess: a spec's view, or the shape the tensor had before the view it was saved under. Any other
        same-size shape (a transpose, say) stays a mismatch."""
        shape = tuple(entry.global_shape or ())
        whole = len(md.chunks) == 1 and tuple(md.chunks[0].sizes) == tuple(md.size)
        # Under a spec's view the stored tensor must have the model's own shape before that view (its
        # global ``[3h, d]`` for a ``[3, h/tp, d]`` view): equal element counts alone would read a
        # transposed ``[d, 3h]`` (GPT-2's Conv1D) as ``[3h, d]``, silently scrambled.
        before_view = entry.original_global_shape if any(s.view for s in entry.specs) else None
        if not (
            whole
            and math.prod(md.size) == math.prod(shape)
            and (
                (before_view is not None and tuple(md.size) == tuple(before_view))
                or self.saved_original_shapes.get(entry.key) == shape
            )
            and self._whole_tensors()
        ):
            return None
        size = torch.Size(shape)
        md = TensorStorageMetadata(md.properties, size, [ChunkStorageMetadata(torch.Size([0] * len(shape)), size)])
        self.metadata.state_dict_metadata[entry.key] = md
        return md

    def _whole_tensors(self) -> bool:
        """Whether the reader says its tensors are whole and reshapable (full artifacts, HF folders)."""
        return isinstance(self.metadata.planner_data, dict) and bool(self.metadata.planner_data.get(WHOLE_TENSORS))

    def _viewed_as_saved(self, entry: Entry, md: TensorStorageMetadata) -> Entry | None:
        """A destination without specs in the shape a tensor had before the ShardSpec view it was saved
        under (a plain ``[3h, d]`` model loading a fused QKV a TP layout saved as ``[3, h, d]``) is read
        viewed as the saved shape (the entry returned): the same row-major bytes, the save's view undone.
        The reverse too, where exact: a destination under a spec's view whose piece is the whole tensor
        (TP=1) reads a tensor saved before the view, in one whole chunk of the model's own shape (a Llama
        ``gate_up_proj.bias`` saved ``[2I]`` by a TP=1 run whose specs had no rule for it, resumed under
        ``view=(2, -1)``): the same bytes. A split piece (TP>1) stays a mismatch (not one box of the saved shape)."""
        shape = tuple(entry.global_shape or ())
        if entry.dtensor is not None or entry.kind != "tensor" or math.prod(md.size) != math.prod(shape):
            return None
        if entry.specs or entry.sharded_axes:
            chunk, saved = entry.chunk, md.chunks
            piece_whole = chunk is not None and not any(chunk.offsets) and tuple(chunk.sizes) == shape
            saved_whole = len(saved) == 1 and not any(saved[0].offsets) and tuple(saved[0].sizes) == tuple(md.size)
            if not (piece_whole and saved_whole and entry.original_global_shape == tuple(md.size)):
                return None
        elif self.saved_original_shapes.get(entry.key) != shape:
            return None
        size = torch.Size(md.size)
        try:
            viewed = entry.value.view(size)
        except RuntimeError as exc:
            raise LayoutMismatch(
                f"{entry.key}: saved viewed as {tuple(size)} from {shape}; the destination (strides "
                f"{entry.value.stride()}) cannot be viewed so in place: make it contiguous"
            ) from exc
        origin = torch.Size([0] * len(size))
        entry = dataclasses.replace(entry, value=viewed, chunk=ChunkStorageMetadata(origin, size), global_shape=size)
        self.entries[entry.key] = entry
        return entry

    def _check_tensor(
        self, entry: Entry, md: TensorStorageMetadata, cast: list[str]
    ) -> tuple[Entry, TensorStorageMetadata]:
        """Shape and dtype checks; the entry and metadata to plan from (a whole tensor read in the
        destination's shape, or the destination viewed as saved, when the shapes differ in those ways)."""
        if tuple(md.size) != tuple(entry.global_shape or ()):
            reshaped = self._reshaped(entry, md)
            if reshaped is not None:
                return self._check_tensor(entry, reshaped, cast)
            viewed = self._viewed_as_saved(entry, md)
            if viewed is not None:
                return self._check_tensor(viewed, md, cast)
            local = tuple(entry.value.shape)
            raise LayoutMismatch(
                f"{entry.key}: the checkpoint holds global shape {tuple(md.size)} but rank {self.rank}'s layout "
                f"implies {tuple(entry.global_shape or ())} (local piece {local}, specs {list(entry.specs) or 'none'})"
                + notes.reshape_hint(entry.global_shape, md, self._whole_tensors())
            )
        saved = md.properties.dtype
        fits = quantized_record_fits  # an old checkpoint's quantized integers: read as they are, or refused
        if saved != entry.value.dtype and not fits(entry.key, saved, tuple(md.size), entry.value.dtype):
            if not self.allow_dtype_cast:
                raise LayoutMismatch(
                    f"{entry.key}: saved as {saved} but the destination is {entry.value.dtype} "
                    "(pass allow_dtype_cast=True to convert)"
                )
            cast.append(entry.key)
        return entry, md

    # -- 3. global plan (coordinator) --------------------------------------------------------------
    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        """(coordinator) The unexpected-key check over every rank's requests (under PP each stage
        asks for its own keys only, so no single rank can make it)."""
        check_plan_ranks(global_plan, self.layout, self.rules, "dcp.load")
        self._refuse_layers_two_stages_load(global_plan)
        if self._as_is:  # another family's names, which a stage alone may not tell (rev72k): the job's keys
            notes.judge_job(self.metadata, global_plan)
        asked: set[str] = set()
        for plan in global_plan:
            asked.update(item.storage_index.fqn for item in plan.items)
            asked.update((plan.planner_data or {}).get("empty", ()))
        # Keys declared rank-local belong to one saving rank each; a world of another size loads only
        # some of them, which is expected rather than an error.
        unexpected = sorted(
            k
            for k in set(self.metadata.state_dict_metadata) - asked
            if not (self._rank_local is not None and self._rank_local.fullmatch(k)) and not self._is_optional(k)
        )
        if unexpected and not self.allow_partial_load:
            raise LayoutMismatch(
                f"{len(unexpected)} checkpoint keys are loaded by no rank: {_show(unexpected)} "
                "(pass allow_partial_load=True, or strict=False to resume_from_checkpoint, to ignore them)"
                + likely_causes(unexpected, self.metadata.state_dict_metadata, asked)
            )
        if self.report is not None:
            self.report = dataclasses.replace(self.report, unexpected_keys=tuple(unexpected))
        return [compact(dataclasses.replace(p, planner_data=None)) for p in global_plan]  # scattered

    def _refuse_partition_off(self, metadata: Metadata) -> None:
        """(each rank) A stage whose state dict names none of the keys of some of its layers (by its
        partition) while the checkpoint holds those layers: the partition does not match the model (two
        layers held under ``pp_layers=(3, 2)``), and the later stages' layers would be read one layer off,
        silently where keys may be skipped. A layer without state (an activation in a ``layers`` list) has
        no keys in the checkpoint either: not refused."""
        if not self.layers_missing:
            return
        first = self.layout.layer_offset(self.layout.coords(self.rank).pp)
        # evidence only from keys of the kinds this rank loads (an optimizer-only state dict of a model with
        # a frozen layer holds no optimizer key of it; the checkpoint's model keys of it are no evidence)
        kinds = {k.partition(".")[0] for k in self.entries if KeyMapper.names_a_layer(k)}
        saved = (k for k in metadata.state_dict_metadata if k.partition(".")[0] in kinds)
        held = KeyMapper.layer_numbers(saved) & {first + i for i in self.layers_missing}
        if not held:
            return
        local = [g - first for g in sorted(held)]
        raise LayoutMismatch(
            f"rank {self.rank}: pipeline stage {self.layout.coords(self.rank).pp} is given its local layer(s) "
            f"{local} by pp_layers={self.layout.pp_layers} (global {sorted(held)}, which the checkpoint holds), "
            "but its state dict has no key of them: the partition does not match the model, and the later "
            "stages' layers would be read off by as many; give the partition the model was built with (to load "
            "only some of a stage's layers, a name_map giving their global names)"
        )

    def _refuse_layers_two_stages_load(self, global_plan: Sequence[LoadPlan]) -> None:
        """(coordinator) A checkpoint saved with a partition (``pp_layers``: its layer keys are global) loaded
        at pp > 1 without one, or through a name map (which replaces the ``layers.<i>`` renumbering): two
        stages reading one ``layers.<i>`` key means stage-local names were read as global ones, and a later
        stage would get an earlier stage's layers -- silently under ``allow_partial_load``. Refused, strict
        or not. Only then: without a saved partition two stages may hold one such key as a replica (a
        layer tied across stages under its global name, a ``layers`` list inside a module every stage
        holds), which the save accepted."""
        layout, saved = self.layout, self.saved_layout
        if layout.pp == 1 or saved is None or saved.pp_layers is None:
            return
        if layout.pp_layers is not None and self.name_map is None:
            return  # renumbered by the partition: no two stages can ask for one layer
        first: dict[str, int] = {}  # key -> the first stage reading it
        shared: dict[str, tuple[int, int]] = {}
        for rank, plan in enumerate(global_plan):
            stage = layout.coords(rank).pp
            for item in plan.items:
                key = item.storage_index.fqn
                seen = first.setdefault(key, stage)
                if seen != stage and key not in shared and KeyMapper.names_a_layer(key):
                    shared[key] = (seen, stage)
        if not shared:
            return
        key, (a, b) = next(iter(shared.items()))
        more = f" (and {len(shared) - 1} more layer keys read by two stages)" if len(shared) > 1 else ""
        how = "its name_map maps them to one key" if self.name_map is not None else "it gives no partition"
        raise LayoutMismatch(
            f"pipeline stages {a} and {b} both load {key!r}{more}: the checkpoint records the partition "
            f"pp_layers={saved.pp_layers}, but the loading layout {layout} reads stage-local names as global "
            f"ones ({how}): pass the partition (ParallelLayout(..., pp_layers=...)) or a name_map giving "
            "each stage's layers their global names"
        )

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        """(all ranks) The plan as the coordinator returned it."""
        return central_plan

    # -- 5. data -----------------------------------------------------------------------------------
    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """(all ranks, from the storage reader) Unpickle one object (weights-only unless allow_pickle)."""
        entry = self.entries[read_item.dest_index.fqn]
        try:
            raw = isinstance(entry.value, ObjectBytes)
            obj = read_object(entry.value, value, self._decoded, weights_only=not self.allow_pickle)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpoint(
                f"{entry.key}: the stored object needs arbitrary code to unpickle ({exc}). Load it with "
                "allow_pickle=True only if you trust this checkpoint."
            ) from exc
        self._ties.object_read(entry.key, obj, self.rank)  # a tied copy's (its entry has no path: set nowhere)
        if entry.kind == "object" or raw:
            set_at_path(self.state_dict, entry.path, obj)
            return
        # a 0-d tensor destination (create_local_plan), checked only here, once the value is read
        with torch.no_grad():  # a 0-d Parameter
            entry.value.copy_(number_as_tensor(entry.key, obj, entry.value.dtype, self.allow_dtype_cast))

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """(all ranks, from the storage reader) The destination view of one read."""
        entry = self.entries[read_item.dest_index.fqn]
        return narrow_tensor_by_index(entry.value, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """(all ranks) Reads land in the destination's own memory; a tied key the checkpoint holds apart
        is compared with the key loaded once both are in (``_ties``); destinations sharing memory are
        read into scratch and written, then checked, once all of them are in (``_shared``)."""
        self._ties.committed(read_item, self.entries, self.rank)
        self._shared.committed(read_item, self.entries, self.rank)
        live = self._numbers.get(read_item.dest_index.fqn) if self._numbers else None
        if live is not None:  # a 0-d tensor into a number's place: exact, or cast with allow_dtype_cast
            entry = self.entries[read_item.dest_index.fqn]
            value = tensor_as_number(entry.key, entry.value, live, self.allow_dtype_cast)
            set_at_path(self.state_dict, entry.path, value)

    def _object_read(self, entry: Entry, md: Any, items: list[ReadItem], source: str) -> tuple[Any, Any]:
        """An object's read (appended to ``items``; ``(None, None)`` returned), or the entry and metadata to
        plan a tensor read from: a 0-d tensor saved where the state dict holds a number (a custom
        optimizer's Python ``step``) is read into scratch of the saved dtype, set as a number by
        ``commit_tensor``; a number saved where the state dict holds a 0-d tensor (a Python ``step``: older
        torch, custom optimizers) is read as an object, converted by ``load_bytes``."""
        saved_object = isinstance(md, BytesStorageMetadata)
        if entry.kind == "object" and not saved_object and type(entry.value) in (int, float) and not md.size:
            self._numbers[entry.key] = type(entry.value)
            none, value = torch.Size(()), torch.empty((), dtype=md.properties.dtype)
            entry = dataclasses.replace(entry, kind="tensor", value=value, chunk=ChunkStorageMetadata(none, none))
            self.entries[entry.key] = entry = dataclasses.replace(entry, global_shape=none)
            return entry, md
        if entry.kind == "object" and not saved_object:
            raise LayoutMismatch(
                f"{entry.key}: the checkpoint holds a tensor {tuple(md.size)} there but the state dict "
                f"holds a {type(entry.value).__name__}"
            )
        if entry.kind != "object" and (entry.kind != "tensor" or entry.value.dim() or entry.key in self._shared.dest):
            raise LayoutMismatch(f"{entry.key}: the checkpoint holds an object there, not a tensor")
        items.append(_create_read_item_for_byteio(MetadataIndex(entry.key), 0, MetadataIndex(source), 0, 0))
        return None, None


def _exact_chunk(
    chunks: Sequence[ChunkStorageMetadata], piece: tuple[tuple[int, ...], tuple[int, ...]], hints: dict[Any, int]
) -> int | None:
    """The position in ``chunks`` (a saved tensor's) of the chunk that is exactly ``piece`` (offsets,
    sizes), or None. Keys of one kind (every layer's ``q_proj`` state) have their chunks in one order,
    so the position found last for as many chunks and the same piece is tried first (``hints``, one per
    local plan): one scan per kind of key, not per key, however many chunks the world makes."""
    hint = (len(chunks), piece)
    at = hints.get(hint)
    if at is not None:
        c = chunks[at]
        if (tuple(c.offsets), tuple(c.sizes)) == piece:
            return at
    found = next((i for i, c in enumerate(chunks) if (tuple(c.offsets), tuple(c.sizes)) == piece), None)
    if found is not None:
        hints[hint] = found
    return found


def _refuse_raw_without_our_reader(metadata: Metadata) -> None:
    """A stock reader fails on our raw records with ``Unknown extension name='smpckpt.raw'`` and no hint;
    this planner sees the metadata first, so it says what to do instead."""
    load_id = str(getattr(metadata.storage_meta, "load_id", "") or "")
    if load_id.startswith(LOAD_ID_PREFIX):
        return
    if any(
        RAW_DESCRIPTOR in (getattr(info, "transform_descriptors", None) or ())
        for info in (metadata.storage_data or {}).values()
    ):
        raise CheckpointError(
            "this checkpoint was written in smpckpt's raw format, which stock DCP readers cannot decode: load "
            "it with storage_reader=smpckpt.storage.FsspecStorageReader(path), or export it for stock tools "
            "with `smpckpt convert PATH OUT --to dcp|torch_save` (smpckpt.tools.convert.convert_checkpoint)"
        )

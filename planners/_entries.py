"""Resolve a state dict into entries: each flattened key's global name, kind and place in the global tensor.

Shared by the save and the load planner, so both see a key, a spec and a layout the same way; also the
tied keys of both (:func:`tied_entries`, :class:`TiedLoads`: the rules are ``ParallelLoadPlanner``'s)."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import _version as _dcp_version
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.tensor import DTensor, Partial, Replicate

from smpckpt._checks import check_globs, check_int, check_process_group, compile_globs
from smpckpt.errors import LayoutMismatch, ReplicaMismatch, SpecError, not_plain, quantized_record_fits
from smpckpt.model.layout import KeyMapper, NameMap, ParallelLayout, RankCoords
from smpckpt.model.specs import OPTIMIZER_STATE_PREFIXES, ShardGeometry, ShardSpec, SpecLike, SpecRules, shard_geometry
from smpckpt.model.specs import nested_state as _nested
from smpckpt.model.specs import state_params as _state_params
from smpckpt.storage.format._safe_pickle import ViewFile, decode_object, encode_object

__all__ = ["Entry", "ObjectBytes", "dtensor_is_owner", "tied_entries", "carries_no_data"]
__all__ += ["saved_ties"]
__all__ += ["encode_object", "decode_object", "read_object"]  # the codec: _safe_pickle

SHOW = 20  #: keys an error message names at most


Kind = Literal["tensor", "dtensor", "object"]


class ObjectBytes(bytes):
    """An object its owner already serialised (``torch.save`` bytes), stored as it is and loaded back as its
    bytes, not unpickled (its owner decodes them, weights-only); stock ``torch.load`` reads it. Loaded back
    as ``ObjectBytes``, a copy; a subclass with ``as_read`` (a resume's user_content) takes the bytes read."""

    as_read = False


def read_object(slot: Any, value: io.BytesIO | ViewFile, memo: dict[bytes, Any], *, weights_only: bool) -> Any:
    """The object a key whose value is ``slot`` gets from its record ``value``: decoded (:func:`decode_object`),
    or for an :class:`ObjectBytes` slot its bytes: a copy, or as read (``as_read``: a resume's user_content,
    decoded once later; a large record's read buffer itself, not copied)."""
    if not isinstance(slot, ObjectBytes):
        return decode_object(value, memo, weights_only=weights_only)
    if not slot.as_read:
        return ObjectBytes(value.read())  # rev68g F1: re-saved as it is
    return value.view() if isinstance(value, ViewFile) else value.read()


@dataclasses.dataclass(slots=True)
class Entry:
    """One flattened key of one rank's state dict. Treat it as read-only: not ``frozen`` only because
    that is slower to build, one per key at every save (``_EntryMaker.entry`` passes the fields by
    position, for speed too: keep their order)."""

    local_key: str  #: key as this rank's state dict names it
    key: str  #: global key, as the checkpoint stores it
    path: tuple[Any, ...]  #: flatten path into this rank's (nested) state dict
    kind: Kind
    value: Any  #: the object, the local tensor (viewed per spec) or the DTensor's local tensor
    chunk: ChunkStorageMetadata | None = None  #: this rank's piece, in global (view) coordinates
    global_shape: torch.Size | None = None
    sharded_axes: frozenset[str] = frozenset()  #: layout axes the tensor is split over
    specs: tuple[ShardSpec, ...] = ()
    rank_local: bool = False  #: ``rank_local`` (this rank's alone) or ``held_by_some``: never a stage's replica
    dtensor: DTensor | None = None
    #: the global shape before a ShardSpec ``view`` (fused QKV ``[3h, d]`` for a stored ``[3, h, d]``),
    #: when the view only splits dimensions of the original; ``None`` without a view
    original_global_shape: tuple[int, ...] | None = None


_NOT_SPLIT: frozenset[str] = frozenset()
_STRIDED = torch.strided


def flatten(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]]]:
    """``torch.distributed.checkpoint._nested_dict.flatten_state_dict``'s result -- the same keys,
    values, paths and order, the same error on a duplicate key -- faster (every rank, every save and
    load). Lists keep DCP's rule (traversed only when they hold tensors or such containers); tuples and
    everything else are leaves. One difference: two keys of one mapping with one name (``0`` and
    ``"0"``) are refused (:func:`_named_children`), where DCP merges them."""
    # DCP's loader switches its flattening to the pre-2.4 key scheme for a moment: follow it there
    if getattr(_dcp_version, "_derived_version", None) is not None:
        return flatten_state_dict(dict(state_dict))
    flat: dict[str, Any] = {}
    paths: dict[str, tuple[Any, ...]] = {}
    for key, value in _named_children(state_dict, "the state dict"):
        _flatten_into(flat, paths, (key,), key, value)
    return flat, paths


def _flatten_into(
    flat: dict[str, Any], paths: dict[str, tuple[Any, ...]], path: tuple[Any, ...], fqn: str, value: Any
) -> None:
    if isinstance(value, torch.Tensor) or not (
        isinstance(value, Mapping) or (isinstance(value, list) and not _dcp_is_terminal(value))
    ):
        if fqn in flat:
            raise ValueError(f"duplicated flatten key {fqn}")
        flat[fqn] = value
        paths[fqn] = path
        return
    children = _named_children(value, fqn) if isinstance(value, Mapping) else enumerate(value)
    for k, v in children:
        # a tensor is always a leaf (most children are): stored here, without another call
        sub_fqn = f"{fqn}.{k}"
        if isinstance(v, torch.Tensor):
            if sub_fqn in flat:
                raise ValueError(f"duplicated flatten key {sub_fqn}")
            flat[sub_fqn] = v
            paths[sub_fqn] = (*path, k)
        else:
            _flatten_into(flat, paths, (*path, k), sub_fqn, v)


def _named_children(value: Mapping[Any, Any], fqn: str) -> Iterator[tuple[str, Any]]:
    """``(str(key), value)`` of a mapping's entries. Keys that are not ``str`` are named by their ``str``
    (as DCP names them); two keys of one mapping with one name (``0`` and ``"0"``, ``1.5`` and ``"1.5"``)
    are refused: their subtrees would merge in the checkpoint, and an object loaded by its path would land
    under the other key, silently (checked once per mapping that holds a key that is not a ``str``)."""
    checked = False
    for key, child in value.items():
        if type(key) is not str:
            if not checked:
                names = [str(k) for k in value]
                if len(set(names)) != len(names):
                    same = [k for k in value if names.count(str(k)) > 1]
                    raise ValueError(f"{fqn}: the keys {same!r} have one name in a checkpoint; rename one of them")
                checked = True
            key = str(key)
        yield key, child


def _dcp_is_terminal(value: Any) -> bool:
    """DCP's ``traverse_state_dict`` rule for a list: a leaf unless it holds a tensor or a non-leaf container."""
    for entry in value:
        if isinstance(entry, (Mapping, list)) and not (isinstance(entry, list) and _dcp_is_terminal(entry)):
            return False
        if isinstance(entry, torch.Tensor):
            return False
    return True


def set_at_path(root: Any, path: tuple[Any, ...], value: Any) -> None:
    """Put a loaded object where ``flatten`` found its destination: at each mapping level the key that
    is there whose ``str`` is the path's (DCP's ``set_element`` would add ``"0"`` beside an int ``0``,
    as an optimizer's ``state`` holds them, leaving the old value)."""
    container = root
    for depth, part in enumerate(path):
        if isinstance(container, Mapping) and part not in container:
            part = next((k for k in container if str(k) == part), part)
        if depth == len(path) - 1:
            container[part] = value
        else:
            container = container[part]


def carries_no_data(entry: Entry) -> bool:
    """A piece empty along a dim the global tensor is not (an uneven split's) is not written: its offset can
    be a neighbour's chunk's. An empty *global* tensor's other pieces are, so its key and shape are."""
    chunk, shape = entry.chunk, entry.global_shape
    if chunk is None or shape is None:
        return False
    return any(n == 0 and g != 0 for n, g in zip(chunk.sizes, shape))  # extents are never negative


def tied_entries(entries: Mapping[str, Entry]) -> dict[str, str]:
    """Keys whose tensor is one held under an earlier key (tied parameters: transformers ties
    ``lm_head.weight`` to the input embedding): later key -> first key, in state-dict order. Tied means
    the same memory seen the same way (device, address, shape, strides, dtype) at the same place of the
    same global tensor; a DTensor ties by its local tensor under the same placements on the same mesh.
    Only tensors with storage tie (meta, empty and Zero tensors all report address 0); a conjugate or
    negated view (``c.conj()``, ``c.conj().imag``) shows other values than its memory's: never tied to it.
    An empty piece of a split pair (a rank holding none of an uneven split) shows no tie and denies none:
    the ranks holding its values decide (``check_tie_groups``, :func:`gather_ties`)."""
    # Tied tensors share an address: only entries whose address another entry has too (few or none)
    # are compared in full; the usual untied state pays one ``data_ptr()`` per tensor.
    at: dict[int, Entry | list[Entry]] = {}
    for e in entries.values():
        if e.kind == "object" or e.rank_local or e.chunk is None:
            continue
        v = e.value
        ptr = v.data_ptr()
        if not ptr:  # no storage (meta, empty, ZeroTensor: all at address 0): never tied
            continue
        seen = at.setdefault(ptr, e)
        if seen is not e:
            if isinstance(seen, Entry):
                at[ptr] = seen = [seen]
            seen.append(e)
    shared = [e for group in at.values() if isinstance(group, list) for e in group]
    if not shared:
        return {}
    order = {key: i for i, key in enumerate(entries)}
    shared.sort(key=lambda e: order[e.key])  # state-dict order: the first key of a tie is its first
    first: dict[tuple[Any, ...], str] = {}
    tied: dict[str, str] = {}
    for e in shared:
        v = e.value
        chunk = e.chunk
        if v.numel() == 0 or v.is_meta or chunk is None:
            continue
        where: tuple[Any, ...] = (v.device, v.data_ptr(), v.dtype, tuple(v.shape), v.stride(), v.is_conj())
        where += (v.is_neg(), tuple(chunk.offsets), e.global_shape)
        if e.dtensor is not None:
            where += (tuple(e.dtensor.placements), id(e.dtensor.device_mesh))
        key = first.setdefault(where, e.key)
        if key != e.key:
            tied[e.key] = key
    return tied


class _EntryMaker:
    """What one rank's resolution shares between keys, with the geometry of each (specs, local shape)
    computed once: the layers of a model repeat a handful of shapes, and every rank does this each save."""

    def __init__(
        self,
        rules: SpecRules,
        prefixes: tuple[str, ...],
        by_global: Mapping[str, Any],
        coords: RankCoords,
        layout: ParallelLayout,
        stored: Mapping[str, Any] | None,
        to_global: Callable[[str], str] | None = None,
        params: Mapping[str, str] | None = None,
    ) -> None:
        self.rules, self.to_global = rules, to_global  # to_global: a name map's (optimizer-state inheritance)
        self.params = params or {}  # under a name map: a state key (before it) -> its own parameter's global key
        #: a load's checkpoint keys (``None`` at a save): a destination not plain is refused only where read
        self.stored = stored
        self.prefixes = prefixes
        self.by_global = by_global
        self.coords = coords
        self.degrees = {"tp": layout.tp, "dp": layout.dp, "pp": layout.pp}
        # keyed by the specs tuple's identity (the rules hold it for this call) and the local shape
        self._geometry: dict[tuple[int, torch.Size], tuple[ShardGeometry, tuple[int, ...] | None]] = {}
        self._origins: dict[int, torch.Size] = {}  # all-zero offsets by rank (torch.Size is immutable)

    def entry(self, local_key: str, key: str, path: tuple[Any, ...], value: Any, is_local: bool) -> Entry:
        if type(value) is not torch.Tensor:  # plain tensors (nearly every key) skip the subclass checks
            if isinstance(value, DTensor):
                return _dtensor_entry(local_key, key, path, value, is_local)
            if type(value).__name__ == "ShardedTensor":
                raise SpecError(
                    f"{key}: ShardedTensor is not supported: build FullyShardedDataParallel with a device_mesh= (its "
                    "state is DTensors then), or convert it to a DTensor or a plain local shard with a ShardSpec"
                )
            if not isinstance(value, torch.Tensor):
                return Entry(local_key, key, path, "object", value, rank_local=is_local)
        if value.layout is not _STRIDED or value.is_quantized or value.is_nested:  # the last two strided too
            stored = self.stored
            if stored is None or key in stored:
                saved: Any = stored[key] if stored is not None else None
                if value.is_quantized and hasattr(saved, "properties"):  # an old checkpoint's integers: how to read
                    quantized_record_fits(key, saved.properties.dtype, tuple(saved.size), value.dtype)
                raise not_plain(key, value)
            # a load's destination the checkpoint lacks is never read: missing (allow_partial_load, optional=)
            # as any other key, not refused (rev69f F3); an object entry asks nothing of its tensor
            return Entry(local_key, key, path, "object", value, rank_local=is_local)
        param = self.params.get(local_key) if self.params else None
        matched = None if is_local else self.rules.match(key, self.prefixes, local_key, self.to_global, param)
        shape = value.shape  # read once: every branch below needs it
        if matched is not None:
            specs, inherited_from = matched
            if inherited_from is not None and not self._inherits(shape, inherited_from):
                matched = None
        # Entries are built with positional arguments, in field order (faster than keywords)
        if matched is None:
            chunk = ChunkStorageMetadata(self._origin(len(shape)), shape)
            return Entry(local_key, key, path, "tensor", value, chunk, shape, _NOT_SPLIT, (), is_local)
        specs, _ = matched
        geometry, original = self._geometry_of(key, shape, specs)
        viewed = value
        if original is not None or geometry.view_shape != shape:
            try:
                viewed = value.view(geometry.view_shape)
            except RuntimeError as exc:
                raise SpecError(
                    f"{key}: the local tensor (shape {tuple(value.shape)}, strides {value.stride()}) cannot be "
                    f"viewed as {tuple(geometry.view_shape)} in place; make it contiguous"
                ) from exc
        chunk = ChunkStorageMetadata(geometry.offsets, geometry.view_shape)
        axes = geometry.sharded_axes
        return Entry(
            local_key, key, path, "tensor", viewed, chunk, geometry.global_shape, axes, specs, False, None, original
        )

    def _inherits(self, shape: torch.Size, param_key: str) -> bool:
        """Optimizer state (of local ``shape``) inherits its parameter's spec only with the parameter's
        local shape when the parameter is a plain tensor of this state dict; otherwise any tensor of
        rank >= 1 does (scalars such as Adam's ``step`` stay replicated)."""
        if not shape:  # a scalar
            return False
        param = self.by_global.get(param_key)
        if not isinstance(param, torch.Tensor) or isinstance(param, DTensor):
            return True
        return param.shape == shape

    def _origin(self, ndim: int) -> torch.Size:
        origin = self._origins.get(ndim)
        if origin is None:
            origin = self._origins[ndim] = torch.Size([0] * ndim)
        return origin

    def _geometry_of(
        self, key: str, shape: torch.Size, specs: tuple[ShardSpec, ...]
    ) -> tuple[ShardGeometry, tuple[int, ...] | None]:
        memo = (id(specs), shape)
        found = self._geometry.get(memo)
        if found is None:
            # only successes are kept: a failing (specs, shape) raises again, naming the same first key
            geometry = shard_geometry(key, shape, specs, self.coords, self.degrees)
            original = (
                original_global_shape(tuple(shape), tuple(geometry.view_shape), tuple(geometry.global_shape))
                if geometry.view_shape != shape
                else None
            )
            found = self._geometry[memo] = (geometry, original)
        return found


def dtensor_layout(model_state: Any) -> str:
    """This rank's DTensor layout: a digest of the distinct (mesh ranks and dimension names, placements)
    its model state's DTensors have (``''`` when it holds none). A parallelism change (FSDP over 4 -> FSDP x
    TP 2 x 2, or TP peers regrouped on a mesh of one shape) keeps the ``ParallelLayout`` a default
    ``Sharding`` records (dp = world) but changes this; a parameter added or removed under the same
    parallelism does not (rev63h F2, F3). The optimizer's state follows its parameters' placements, so the
    model's tell. One pass, a set insert per DTensor: the meshes and placements are few."""
    seen = {
        (v.device_mesh, v.placements)
        for v in (model_state.values() if isinstance(model_state, Mapping) else ())
        if isinstance(v, DTensor)
    }
    kinds = sorted(repr((mesh.mesh.tolist(), mesh.mesh_dim_names, placements)) for mesh, placements in seen)
    return hashlib.blake2b(repr(kinds).encode(), digest_size=8).hexdigest() if kinds else ""


class LayoutScope:
    """What both planners are told about the layout they plan for, and how they resolve a state dict."""

    layout: ParallelLayout
    rules: SpecRules
    name_map: NameMap | None
    process_group: Any
    rank: int
    held_keys: list[str]  #: this rank's keys ``held_by_some`` matches (as spec rules: optimizer state follows)
    held_split: list[str]  #: those a spec rule matches too (saved whole all the same: the save refuses them)
    state_params: dict[str, tuple[str, str]]  #: under a name map: state key -> (FQN, parameter key), names before it
    dtensor_layout = staticmethod(dtensor_layout)  # the save planner sends its rank's in its plan

    def _set_scope(
        self,
        layout: ParallelLayout,
        specs: Mapping[str, SpecLike] | SpecRules | None,
        rank: int | None,
        name_map: NameMap | None,
        process_group: Any,
        rank_local: Iterable[str],
        held_by_some: Iterable[str],
    ) -> None:
        if not isinstance(layout, ParallelLayout):
            raise SpecError(f"layout must be a ParallelLayout, got {type(layout).__name__}")
        check_process_group(process_group)
        check_int("rank", rank, minimum=0, optional=True)  # True or 1.0 failed later, by no name
        self.layout = layout
        self.rules = SpecRules.of(specs)
        self._rank_arg = rank
        self.name_map = name_map
        self.process_group = process_group
        # refused by name: a lone string (tuple("rng*") is the globs 'r', 'n', 'g', '*') or a non-string item
        self._rank_local_globs = check_globs("rank_local", rank_local)
        self._held_globs = check_globs("held_by_some", held_by_some)
        self._rank_local = compile_globs(self._rank_local_globs, "rank_local")
        self._held = SpecRules.of(dict.fromkeys(self._held_globs, ShardSpec(0)), also_under=self.rules.also_under)

    def _resolve(
        self, state_dict: Mapping[str, Any], stored: Mapping[str, Any] | None = None
    ) -> tuple[dict[str, Entry], dict[str, tuple[Any, ...]]]:
        """(all ranks, in set_up_planner) Set this rank -- explicit, else the process group's, else 0 -- and
        resolve its state dict against the layout: the entries, and each key's flatten path for the
        checkpoint's record, by global key. ``stored``: a load's checkpoint keys (its destinations that are not
        plain tensors are refused only under them)."""
        layout, rank = self.layout, self._rank_arg
        if rank is None:
            if dist.is_available() and dist.is_initialized():
                rank = dist.get_rank(self.process_group)
                layout.check_world_size(dist.get_world_size(self.process_group), "the process group")
            else:
                rank = 0
        if not 0 <= rank < layout.world_size:
            raise SpecError(f"rank {rank} is outside the layout's world of {layout.world_size} ({layout})")
        self.rank = rank
        coords = layout.coords(rank)
        mapper = KeyMapper(layout, coords.pp, self.name_map)
        flat, local_paths = flatten(state_dict)
        entries: dict[str, Entry] = {}
        mappings: dict[str, tuple[Any, ...]] = {}
        # global keys, and the values by them (parameters, for optimizer-state inheritance); without
        # renaming the local keys are the global ones, unique (the flattening refuses duplicates)
        global_keys: dict[str, str] | None = None
        by_global: Mapping[str, Any] = flat
        if mapper.active:
            global_keys = {local_key: mapper.to_global(local_key) for local_key in flat}
            by_global = {global_keys[k]: v for k, v in flat.items()}
        self.layers_missing = mapper.layers_missing()  # what the checkpoint holds decides (load)
        # top-level names under which parameters sit (``model``), for optimizer-state spec inheritance
        tops = {
            str(p[0]): 0 for k, p in local_paths.items() if len(p) > 1 and not k.startswith(OPTIMIZER_STATE_PREFIXES)
        }
        prefixes = tuple(tops)
        named = mapper.to_global if self.name_map is not None else None
        pairs = _state_params(flat.keys(), prefixes, not named)  # each state key's parameter, names before a map
        self.state_params = pairs if global_keys is not None and named else {}  # no map: params of nested only, rev73a
        params = {k: (global_keys or {}).get(p, p) for k, (f, p) in pairs.items() if named or _nested(k, f)}
        entry = _EntryMaker(self.rules, prefixes, by_global, coords, layout, stored, named, params).entry
        rank_local, held, self.held_keys, self.held_split = self._rank_local, self._held, [], []
        for local_key, value in flat.items():
            key = local_key
            path = local_paths[local_key]
            if global_keys is not None:
                key = global_keys[local_key]
                if key in entries:
                    raise SpecError(
                        f"keys {entries[key].local_key!r} and {local_key!r} both map to the global key {key!r} on "
                        f"rank {rank}"
                    )
                mappings[key] = mapper.global_path(path, local_key, key)
            else:
                mappings[key] = path
            is_local = rank_local is not None and rank_local.fullmatch(key) is not None
            # optimizer state is held as its own parameter is (under a name map: found by the names before it)
            if held and not is_local and held.match(key, prefixes, param=(own := params.get(local_key))) is not None:
                is_local = True  # planned by each holder (not in the stage's digest), compared by the save planner
                self.held_keys.append(key)
                self.held_split += [key] if self.rules.match(key, prefixes, param=own) is not None else []
            entries[key] = entry(local_key, key, path, value, is_local)
        return entries, mappings


def original_global_shape(
    local: tuple[int, ...], view: tuple[int, ...], global_view: tuple[int, ...]
) -> tuple[int, ...] | None:
    """The global shape a viewed tensor has in its original form: each original dimension is a run of
    consecutive view dimensions (``[3h/tp, d]`` viewed as ``[3, h/tp, d]``: runs ``(3, h/tp)``, ``(d,)``),
    and merging the same runs of the global view gives it (``[3, h, d]`` -> ``[3h, d]``). ``None`` when
    the view is not such a split. A view dimension of extent 1 joins the dimension before it (as the
    sharded part of a split dimension does), unless the dimensions after it need it."""
    bounds = _split_runs(tuple(local), tuple(view), 0, 0)
    if bounds is None:
        return None
    starts = [0, *bounds]
    return tuple(math.prod(global_view[a:b]) for a, b in zip(starts, bounds))


def _split_runs(local: tuple[int, ...], view: tuple[int, ...], li: int, vi: int) -> list[int] | None:
    """End indices (into ``view``) of the runs whose products are ``local[li:]``, the longest run first."""
    if li == len(local):
        return [] if vi == len(view) else None
    size = local[li]
    ends = [j for j in range(vi + 1, len(view) + 1) if math.prod(view[vi:j]) == size]
    for j in reversed(ends):
        rest = _split_runs(local, view, li + 1, j)
        if rest is not None:
            return [j, *rest]
    return None


def _dtensor_entry(local_key: str, key: str, path: tuple[Any, ...], value: DTensor, is_local: bool) -> Entry:
    if any(isinstance(p, Partial) for p in value.placements):
        raise SpecError(
            f"{key}: a DTensor with a Partial placement holds unreduced values; reduce it (redistribute to "
            "Replicate or Shard) before checkpointing"
        )
    chunks = value.__create_chunk_list__()
    if len(chunks) != 1:
        raise SpecError(f"{key}: DTensor yields {len(chunks)} local chunks; smpckpt supports one per rank")
    local = value.to_local()
    return Entry(local_key, key, path, "dtensor", local, chunks[0], value.size(), rank_local=is_local, dtensor=value)


def dtensor_is_owner(entry: Entry) -> bool:
    """Among the ranks holding the same DTensor shard (its Replicate mesh dims), is this one the writer
    (chosen by a stable hash of the key, so replicated DTensors do not all land on one rank)?"""
    import zlib

    dt = entry.dtensor
    if dt is None:
        return True
    mesh = dt.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return False
    index, count = 0, 1
    for dim, placement in enumerate(dt.placements):
        if isinstance(placement, Replicate):
            size = mesh.size(dim)
            index = index * size + coordinate[dim]
            count *= size
    return index == zlib.crc32(entry.key.encode()) % count


def saved_ties(entries: Mapping[str, Entry]) -> dict[str, str]:
    """The ties a save writes once (:func:`tied_entries`), less a key not split tied to a split key's piece
    (an uneven split with every row on one rank: that rank's piece is the whole tensor). The ranks whose
    piece is empty hold that key with values as a tensor of their own and cannot tell the tie, so the ranks
    would plan its writer and check its values differently: saved as held apart (written once, by the
    owner of its replicas), as the same pair in the other key order (the split key tied to the other) saves
    tied: a tie is split when either key is, and both orders save and load bit-exact (rev71a L1)."""
    tied = tied_entries(entries)
    kept: dict[str, str] = {}
    roots: dict[str, str] = {}  # split first key -> its tie's first unsplit key (the others tie to it)
    for a, f in tied.items():
        if entries[a].sharded_axes or not entries[f].sharded_axes:
            kept[a] = f
        elif roots.setdefault(f, a) != a:
            kept[a] = roots[f]
    return kept


def gather_ties(plans: list[SavePlan]) -> dict[str, str]:
    """(coordinator) Every rank's tied keys, checked: a key is tied to one key by every rank that ties it,
    and no rank writes bytes of its own under a key another rank ties (missing from its other pieces). A
    rank holding an empty piece of a split key ties nothing there and writes nothing: the ranks holding
    values of it decide its tie (those of one piece alike: ``check_tie_groups``)."""
    tied: dict[str, tuple[str, int]] = {}
    for i, plan in enumerate(plans):
        for alias, first in ((plan.planner_data or {}).get("tied") or {}).items():
            seen = tied.setdefault(alias, (first, i))
            if seen[0] != first:
                raise ReplicaMismatch(
                    f"{alias!r} is the tensor of {seen[0]!r} on rank {seen[1]} but of {first!r} on rank {i}: tie "
                    "parameters alike on every rank"
                )
    for i, plan in enumerate(plans):
        for item in plan.items:
            if item.index.fqn in tied:
                alias = item.index.fqn
                raise ReplicaMismatch(
                    f"{alias!r} is tied to {tied[alias][0]!r} (the same tensor) on rank {tied[alias][1]} but is a "
                    f"tensor of its own on rank {i}: tie (or untie) parameters alike on every rank"
                )
    return {alias: first for alias, (first, _) in tied.items()}


def number_as_tensor(key: str, obj: Any, dtype: torch.dtype, cast: bool) -> torch.Tensor:
    """A number saved as an object (a Python ``step``) as a 0-d ``dtype`` tensor: exact, or cast (``copy_``'s)."""
    if type(obj) not in (int, float):
        raise LayoutMismatch(f"{key}: the checkpoint holds a {type(obj).__name__} there, not a tensor")
    try:  # past int64 (2**70) nothing holds it
        got = torch.tensor(obj, dtype=torch.float64 if type(obj) is float else torch.int64).to(dtype)
    except (RuntimeError, OverflowError, ValueError) as exc:
        raise LayoutMismatch(f"{key}: the checkpoint holds the number {obj!r} there ({exc})") from None
    same = got.item() == obj or (got.item() != got.item() and obj != obj)  # NaN holds NaN exactly
    if not cast and not same:
        raise LayoutMismatch(
            f"{key}: the checkpoint holds the number {obj!r} there, which a {dtype} 0-d tensor does not hold "
            "exactly (pass allow_dtype_cast=True to convert)"
        )
    return got


def tensor_as_number(key: str, saved: torch.Tensor, live: type, cast: bool) -> Any:
    """A saved 0-d tensor as the state dict's Python number type ``live``: exact, or converted with ``cast``."""
    value = saved.item()
    try:
        got = live(value) if type(value) in (int, float) else None
    except (OverflowError, ValueError):  # inf or nan into an int
        got = None
    if got is None or (not cast and got != value and value == value):
        way = " (pass allow_dtype_cast=True to convert)" if got is not None else ""
        raise LayoutMismatch(
            f"{key}: the checkpoint holds a {saved.dtype} 0-d tensor {value!r} there, which the state dict's "
            f"{live.__name__} does not hold exactly{way}"
        )
    return got

"""Parallel layouts: how global ranks map to tensor-, data- and pipeline-parallel coordinates (rank
order, ``pp_layers`` and the renaming of stage-local keys: the README's "The layout model", "PP renaming").

The top-level keys :func:`~smpckpt.save_checkpoint` reserves are named here only (the API builds its
state dict, rank-local globs and optional-key globs from that one object; :func:`wrap_name_map` keeps them
out of a user's name_map). What such a map does to the pairing of optimizer state with its parameter is
:mod:`smpckpt.model.specs`'s.

What a checkpoint records about how it was partitioned is one type, :class:`LayoutRecord`: the save
planner stores its JSON in ``Metadata.planner_data`` under :data:`METADATA_KEY`, the storage writer
copies it verbatim into the commit manifest under :data:`MANIFEST_KEY` (so listing tools read it
without fetching ``.metadata``), and every reader parses it here and nowhere else.

Versions: 1 is the current record. Checkpoints written by smpckpt 0.1.0's ``save_checkpoint`` kept
``layout``/``specs``/``rank_local`` loose in the manifest's ``extra``; :meth:`LayoutRecord.from_manifest`
still reads those."""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from types import MappingProxyType
from typing import Any, NamedTuple

from smpckpt._formats import API_RECORD, API_RECORD_V1, FULL_API_RECORD, RECORD_VERSION  # noqa: F401 - named here too (their old home)
from smpckpt.errors import CheckpointCorrupt, SpecError

# the layout and pipeline renaming
__all__ = ["ParallelLayout", "RankCoords", "AXES", "KeyMapper", "NameMap", "wrapped"]
# the keys save_checkpoint reserves
__all__ += ["ReservedKeys", "RESERVED", "OPTIM_STATE_PREFIX", "FULL_ARTIFACTS", "wrap_name_map"]
# the layout record, and the format tags still named here (their old home)
__all__ += ["LayoutRecord", "METADATA_KEY", "MANIFEST_KEY", "RECORD_VERSION"]
__all__ += ["API_RECORD", "API_RECORD_V1", "FULL_API_RECORD"]
# what a checkpoint's planner_data says of its keys beside the record (plain Hugging Face folders, translations)
__all__ += ["TIED_KEY", "MERGED_KEY", "UNREAD_KEY", "checkpoint_ties", "checkpoint_original_shapes"]


#: Parallel axes a :class:`~smpckpt.ShardSpec` can name, in rank order (fastest first).
AXES = ("tp", "dp", "pp")


class RankCoords(NamedTuple):
    tp: int
    dp: int
    pp: int


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """Degrees of tensor (``tp``), pipeline (``pp``) and data (``dp``) parallelism.

    Args:
        tp: tensor-parallel degree.
        pp: pipeline-parallel degree (number of stages).
        dp: data-parallel degree (replicas of each model shard).
        pp_layers: layers held by each stage, one count per stage (the partition decision). ``None``
            means the layout records no partition and keys are not renamed by stage."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    _: dataclasses.KW_ONLY
    pp_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for axis in AXES:
            value = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecError(f"ParallelLayout.{axis} must be a positive int, got {value!r}")
        if self.pp_layers is not None:
            layers = tuple(self.pp_layers)
            object.__setattr__(self, "pp_layers", layers)
            if len(layers) != self.pp:
                raise SpecError(f"pp_layers has {len(layers)} entries but pp={self.pp}: give one layer count per stage")
            if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in layers):
                raise SpecError(f"pp_layers must be non-negative ints, got {layers!r}")

    # -- geometry ---------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def check_world_size(self, world_size: int, where: str) -> None:
        """Raise :class:`SpecError` unless ``world_size`` ranks (as ``where`` counts them) fit this layout
        (the one place a world size is compared with a layout)."""
        if world_size != self.world_size:
            raise SpecError(f"{where} has {world_size} ranks but the layout {self} describes {self.world_size}")

    def coords(self, rank: int) -> RankCoords:
        """Coordinates of global ``rank``."""
        if not 0 <= rank < self.world_size:
            raise SpecError(f"rank {rank} is outside a world of {self.world_size} ({self})")
        return RankCoords(rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp))

    def rank_of(self, tp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """Global rank at the given coordinates."""
        for axis, value in (("tp", tp), ("dp", dp), ("pp", pp)):
            if not 0 <= value < getattr(self, axis):
                raise SpecError(f"{axis} coordinate {value} out of range for {self}")
        return tp + self.tp * (dp + self.dp * pp)

    # -- pipeline partition -----------------------------------------------------------------------
    def layer_offset(self, pp_rank: int) -> int:
        """Global index of stage ``pp_rank``'s first layer (0 when no partition is recorded)."""
        return 0 if self.pp_layers is None else sum(self.pp_layers[:pp_rank])

    def stage_layers(self, pp_rank: int) -> range:
        """Global layer indices held by stage ``pp_rank``."""
        if self.pp_layers is None:
            raise SpecError("this layout records no pp_layers partition")
        start = self.layer_offset(pp_rank)
        return range(start, start + self.pp_layers[pp_rank])

    # -- records ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "pp_layers": list(self.pp_layers) if self.pp_layers is not None else None,
            "rank_order": "tp,dp,pp",
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ParallelLayout:
        layers = data.get("pp_layers")
        return cls(**{axis: int(data[axis]) for axis in AXES}, pp_layers=tuple(layers) if layers is not None else None)

    @classmethod
    def from_device_mesh(
        cls,
        mesh: Any,
        *,
        tp_dim: str = "tp",
        dp_dim: str = "dp",
        pp_dim: str = "pp",
        pp_layers: Sequence[int] | None = None,
    ) -> ParallelLayout:
        """Build a layout from a named ``DeviceMesh``; absent dimension names count as degree 1. A mesh
        whose rank order is not ours (TP fastest, then DP, then PP) is refused, not mislabelled."""
        names = tuple(mesh.mesh_dim_names or ())
        known = {tp_dim, dp_dim, pp_dim}
        extra = [n for n in names if n not in known]
        if extra:
            raise SpecError(f"mesh dimensions {extra} are not tp/dp/pp ({tp_dim!r}, {dp_dim!r}, {pp_dim!r})")

        def size(name: str) -> int:
            return int(mesh.size(names.index(name))) if name in names else 1

        pp_layers = tuple(pp_layers) if pp_layers is not None else None
        layout = cls(tp=size(tp_dim), dp=size(dp_dim), pp=size(pp_dim), pp_layers=pp_layers)
        grid = mesh.mesh
        order = [n for n in (pp_dim, dp_dim, tp_dim) if n in names]
        perm = [names.index(n) for n in order]
        flat = grid.permute(*perm).reshape(-1).tolist() if perm else [int(grid.item())]
        if flat != list(range(layout.world_size)):
            raise SpecError(
                f"DeviceMesh rank order {flat} differs from smpckpt's (tp fastest, then dp, then pp); "
                "build the mesh as (pp, dp, tp) over ranks 0..N-1"
            )
        return layout


@dataclasses.dataclass(frozen=True)
class ReservedKeys:
    model: str = "model"  #: model state (``model.<fqn>``)
    optim: str = "optim"  #: FQN-keyed optimizer state (``optim.state.<fqn>.<name>``)
    rng: str = "rng"  #: per-rank RNG states (``rng.rank<r>.<generator>``)
    user_content: str = "user_content"  #: rank 0's user_content, one weights-only object

    def rng_of(self, rank: int) -> str:
        """The sub-key holding ``rank``'s RNG states (under :attr:`rng`)."""
        return f"rank{rank}"

    @property
    def rank_local(self) -> tuple[str, ...]:
        """Globs of keys one rank holds for itself (never treated as replicas)."""
        return (f"{self.rng}.*", self.user_content)

    def optional(self, *, model: bool, optim: bool) -> tuple[str, ...]:
        """Globs of keys a load may skip: RNG states and user_content always; ``model``/``optim``
        parts when the caller passed no model or no optimizer."""
        globs = list(self.rank_local)
        if not model:
            globs.append(f"{self.model}.*")
        if not optim:
            globs.append(f"{self.optim}.*")
        return tuple(globs)

    @staticmethod
    def state_owner(rest: str, params: Set[str]) -> str | None:
        """The parameter (FQN, one of ``params``) an optimizer state key names: ``rest`` is the key after
        its ``state.`` prefix, ``<fqn>.<name>`` or nested ``<fqn>.<name>.<inner>``; the longest FQN in
        front wins (``layer.1`` and ``layer.1.x`` may both be parameters); ``None``: none of ``params``."""
        parts = rest.split(".")
        return next((f for f in (".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)) if f in params), None)

    def in_own_dtype(self, keys: Mapping[str, str], saved: Mapping[str, Any]) -> list[str]:
        """The optimizer state ``keys`` (a destination key -> the checkpoint key read for it, the model's
        keys too) saved in a dtype other than their parameter's, both as saved (``saved``: the checkpoint's
        metadata by key): an optimizer keeping fp32 moments of a bf16 model. torch's ``load_state_dict`` casts
        floating state to its parameter's dtype; the resume keeps these as loaded (only these: state saved in
        its parameter's dtype follows the parameter, a model cast with ``allow_dtype_cast`` included, hunt71d).
        A state's parameter is found by the destination keys (``model.<fqn>`` beside ``optim.state.<fqn>.``):
        the checkpoint's may be anything a name_map made them."""
        state, params = f"{self.optim}.state.", f"{self.model}."
        fqns = {k[len(params) :] for k in keys if k.startswith(params)}
        out = []
        for key, read in keys.items():
            if not key.startswith(state):
                continue
            rest = key[len(state) :]
            fqn: str | None = rest.rpartition(".")[0]  # <fqn>.<name>: state_owner's first guess, cheaply
            if fqn not in fqns:
                fqn = self.state_owner(rest, fqns)
                if fqn is None:
                    continue
            mine, its = _dtype(saved.get(read)), _dtype(saved.get(keys[params + fqn]))
            if mine is not None and its is not None and mine != its:
                out.append(key)
        return out


def _dtype(md: Any) -> Any:
    """A saved tensor's dtype from its metadata entry; ``None`` for an object or an absent key."""
    properties = getattr(md, "properties", None)
    return getattr(properties, "dtype", None)


RESERVED = ReservedKeys()
#: where FQN-keyed optimizer state lives (``get_state_dict`` with ``flatten_optimizer_state_dict=True``)
OPTIM_STATE_PREFIX = f"{RESERVED.optim}.state."
#: a full artifact's files: flattened-key prefix -> file stem, as Hugging Face names them
FULL_ARTIFACTS = MappingProxyType({f"{RESERVED.model}.": "model", OPTIM_STATE_PREFIX: "optimizer"})


NameMap = Callable[[str], str]
_LAYER = re.compile(r"(?:(?<=^)|(?<=\.))layers\.(\d+)(?=\.|$)")
#: path segments of module wrappers, which state dicts leave out (activation checkpointing, FSDP1, compile)
_WRAPPERS = re.compile(r"(?:^|\.)(?:_checkpoint_wrapped_module|_fsdp_wrapped_module|_orig_mod)(?=\.|$)")


#: wrappers by class name, and the attribute holding the module each wraps (the state dict keys it adds: _WRAPPERS)
_WRAPPED_BY: Mapping[str, str] = MappingProxyType(
    {
        "OptimizedModule": "_orig_mod",
        **dict.fromkeys(("DistributedDataParallel", "FullyShardedDataParallel", "DataParallel"), "module"),
        **dict.fromkeys(("CheckpointWrapper", "OffloadWrapper"), "_checkpoint_wrapped_module"),
    }
)


def wrapped(model: Any) -> list[Any]:
    """``model``, then each module under its torch.compile, DDP, FSDP, DataParallel and checkpoint_wrapper
    wrappers (a model wrapped after its resume meets the Checkpointer that resume kept, ``calls``)."""
    from torch import nn

    chain = [model]
    for _ in range(4):  # bounded: wrappers nest a few deep at most
        attr = _WRAPPED_BY.get(type(chain[-1]).__name__)  # by name; a user's own class so named may hold no module
        inner = getattr(chain[-1], attr, None) if attr and isinstance(chain[-1], nn.Module) else None
        if not isinstance(inner, nn.Module):
            break
        chain.append(inner)
    return chain


class KeyMapper:
    """Maps one rank's local keys to global keys (and flatten paths alike)."""

    def __init__(self, layout: ParallelLayout, pp_rank: int, name_map: NameMap | None = None) -> None:
        self.layout = layout
        self.pp_rank = pp_rank
        self.name_map = name_map
        self.active = name_map is not None or layout.pp_layers is not None
        self._offset = layout.layer_offset(pp_rank)
        self._count = layout.pp_layers[pp_rank] if layout.pp_layers is not None else None
        self._layers_seen: set[int] = set()  # stage-local layer numbers renumbered so far

    def to_global(self, key: str) -> str:
        if not self.active:
            return key
        if self.name_map is not None:
            mapped = self.name_map(key)
            if not isinstance(mapped, str) or not mapped:
                raise SpecError(f"name_map returned {mapped!r} for key {key!r}; it must return a non-empty str")
            return mapped
        # only the first `layers.<i>` segment is the stage's layer: a `layers` list inside a layer
        # (`layers.0.inner.layers.1.w`) keeps its own numbers
        return _LAYER.sub(self._shift, key, count=1)

    def renumbers(self, local_key: str) -> bool:
        """Whether ``local_key`` gets its stage's own global layer numbers from the ``layers.<i>`` rule (the
        layout records a partition, no name map overrides the rule): a key no other stage holds."""
        return self.name_map is None and self._count is not None and self.names_a_layer(local_key)

    @staticmethod
    def names_a_layer(key: str) -> bool:
        """Whether ``key`` has a ``layers.<i>`` segment: a pipeline stage's own layer, held by no other stage."""
        return _LAYER.search(key) is not None

    def _shift(self, match: re.Match[str]) -> str:
        local = int(match.group(1))
        if self._count is not None and local >= self._count:
            raise SpecError(
                f"stage {self.pp_rank} holds {self._count} layers (pp_layers={self.layout.pp_layers}) "
                f"but the state dict has stage-local layer {local} ({match.string!r})"
            )
        self._layers_seen.add(local)
        return f"layers.{local + self._offset}"

    def layers_missing(self) -> tuple[int, ...]:
        """(after mapping one rank's whole state dict) The stage's local layer numbers, by its partition, that
        no key named: a layer without state, or a partition that does not match the model (only the
        checkpoint can tell which). Empty without a partition, under a name map, or when no key names a
        layer at all (a subset of the state)."""
        if self._count is None or self.name_map is not None or not self._layers_seen:
            return ()
        return tuple(sorted(set(range(self._count)) - self._layers_seen))

    def check_model_layers(self, model_names: Iterable[str], state_names: Iterable[str]) -> None:
        """(every rank, before a save or resume through the API) The stage's ``layers`` lists against its
        partition, from the model's module and parameter names (``model_names``, wrapper segments dropped
        as the state dict drops them) and the names its state is saved under (``state_names``). State
        keys cannot tell a wrong ``pp_layers`` from layers without state (an activation); a list counts
        both. Past the first stage every list holding state must hold the stage's count exactly (the rule
        shifts them all); at offset 0 nothing is shifted, so one such list is enough (a vision tower's
        ``layers`` beside the text layers)."""
        if self._count is None or self.name_map is not None:
            return
        held: dict[str, set[int]] = {}
        for name in model_names:
            head, _, last = _WRAPPERS.sub("", name).lstrip(".").rpartition(".")
            if last.isdigit() and (head == "layers" or head.endswith(".layers")) and not _LAYER.search(head):
                held.setdefault(head, set()).add(int(last))
        stateful, state_names = set(), list(state_names)
        for name in state_names:
            if (m := _LAYER.search(key := _WRAPPERS.sub("", name).lstrip("."))) is not None:
                stateful.add(key[: m.start() + len("layers")])
        lists = {c: numbers for c, numbers in held.items() if c in stateful}
        if self._count and not stateful and state_names:  # no list (GPT-2's `h`): nothing renamed
            raise SpecError(
                f"stage {self.pp_rank} holds {self._count} layers by pp_layers={self.layout.pp_layers} but the "
                "model has no `layers` list holding state, so the rule renames no key and the stages' layers "
                "would be saved under one another's names: pass a name_map giving each key's global name"
            )
        wrong = [c for c, numbers in lists.items() if numbers != set(range(self._count))]
        if not wrong or (self._offset == 0 and len(wrong) < len(lists)):
            return
        container, numbers = wrong[0], lists[wrong[0]]
        others = f" (it holds {len(lists)} `layers` lists: {', '.join(sorted(lists))})" if len(lists) > 1 else ""
        raise SpecError(
            f"stage {self.pp_rank} holds {self._count} layers by pp_layers={self.layout.pp_layers} but the "
            f"model's {container!r} holds {len(numbers)} ({container}.{min(numbers)} .. {container}."
            f"{max(numbers)}){others}: give each stage's own layer count (the partition decision), or a "
            "name_map naming each key's global name"
        )

    @staticmethod
    def layer_numbers(keys: Iterable[str]) -> set[int]:
        """The numbers of the ``layers.<i>`` segments (the first in each key) of ``keys``."""
        return {int(m.group(1)) for k in keys if (m := _LAYER.search(k)) is not None}

    def global_path(self, local_path: tuple[object, ...], local_key: str, global_key: str) -> tuple[object, ...]:
        """Flatten path for ``global_key`` (DCP records ``key -> path`` so tools can re-nest a flat
        checkpoint): the leading elements both keys share, then the renamed rest as one string."""
        if global_key == local_key:
            return local_path
        prefix: list[object] = []
        text = ""
        for element in local_path:
            candidate = f"{text}{element}."
            if global_key.startswith(candidate) and local_key.startswith(candidate):
                prefix.append(element)
                text = candidate
            else:
                break
        return (*prefix, global_key[len(text) :])


#: Key in ``Metadata.planner_data`` (plain JSON-able values, so stock unpicklers read it).
METADATA_KEY = "__smpckpt__"
#: Key in the manifest's ``extra`` (a copy of the same JSON, made by the storage writer).
MANIFEST_KEY = "layout_record"
#: Key in ``Metadata.planner_data`` of a plain Hugging Face folder read through our storage reader: tied
#: heads the folder leaves out (``{"model.lm_head.weight": "model.transformer.wte.weight"}``). Our own
#: checkpoints record their ties in the :class:`LayoutRecord` instead.
TIED_KEY = "__smpckpt_tied__"
#: Key in ``Metadata.planner_data`` of a plain Hugging Face folder read through a translation: the shape
#: an unsharded model holds each fused tensor in (``[3d, d]`` for the stored view ``[3, d, d]``), as
#: :attr:`LayoutRecord.original_shapes` records it for our checkpoints.
MERGED_KEY = "__smpckpt_merged__"
#: Key in ``Metadata.planner_data`` of an artifact read through a translation that cannot present all of
#: it: ``{"refuse": {key prefix: why}}`` for state left out under names the translation does not rename
#: (an untranslated artifact's optimizer state; asking for a key under the prefix is refused in those words,
#: never skipped), ``{"as_is": judge}`` for an untranslated artifact whose layers no rule of it takes (none, or a
#: head renamed: both entries) (a load missing model keys of ours asks ``smpckpt.hf``'s wrong-family judge).
UNREAD_KEY = "__smpckpt_unread__"


@dataclasses.dataclass(frozen=True)
class LayoutRecord:
    """The partition a checkpoint was saved under; ``specs`` are the spec rules as JSON records
    (``SpecRules.to_records()``), kept as data for display and comparison."""

    layout: ParallelLayout
    specs: tuple[Mapping[str, Any], ...] = ()
    rank_local: tuple[str, ...] = ()
    version: int = RECORD_VERSION
    #: key -> shape before its ShardSpec ``view`` (the checkpoint stores the view shape); export tools
    #: reshape to it so a fused QKV comes out as ``[3h, d]``, not ``[3, h, d]``
    original_shapes: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    #: tied key -> the key whose stored bytes it is (one tensor held under two names, written once);
    #: a load into a model that holds the two apart reads the second for the first
    tied: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: the DTensors' meshes and placements over every rank, as a digest (:meth:`world_dtensors`): a resume
    #: whose own differs changed its parallelism though ``layout`` is the same (a default ``Sharding``:
    #: dp = world); ``None``: no DTensors, or saved before it was recorded
    dtensors: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = {
            "version": self.version,
            "layout": self.layout.to_dict(),
            "specs": [dict(s) for s in self.specs],
            "rank_local": list(self.rank_local),
            "original_shapes": {k: list(v) for k, v in sorted(self.original_shapes.items())},
        }
        if self.tied:  # absent otherwise: records without ties stay as every earlier version wrote them
            out["tied"] = dict(sorted(self.tied.items()))
        if self.dtensors is not None:  # likewise
            out["dtensors"] = self.dtensors
        return out

    @classmethod
    def from_json(cls, obj: Any, *, where: str = "layout record") -> LayoutRecord:
        """Parse; a malformed record is :class:`~smpckpt.errors.CheckpointCorrupt` naming ``where``."""
        try:
            if not isinstance(obj, Mapping):
                raise TypeError(f"expected an object, got {type(obj).__name__}")
            version = int(obj.get("version", RECORD_VERSION))
            if version > RECORD_VERSION:
                raise ValueError(f"record version {version} is newer than this smpckpt understands; upgrade smpckpt")
            specs = obj.get("specs") or ()
            rank_local = obj.get("rank_local") or ()
            if not isinstance(specs, Sequence) or not isinstance(rank_local, Sequence):
                raise TypeError("specs and rank_local must be lists")
            return cls(
                layout=ParallelLayout.from_dict(obj["layout"]),
                specs=tuple(dict(s) for s in specs),
                rank_local=tuple(str(g) for g in rank_local),
                version=version,
                original_shapes={
                    str(k): tuple(int(n) for n in v) for k, v in dict(obj.get("original_shapes") or {}).items()
                },
                tied={str(k): str(v) for k, v in dict(obj.get("tied") or {}).items()},
                dtensors=str(obj["dtensors"]) if obj.get("dtensors") is not None else None,
            )
        except (KeyError, TypeError, ValueError, SpecError, OverflowError, RecursionError) as exc:
            raise CheckpointCorrupt(f"{where} is malformed: {exc}") from exc

    @classmethod
    def from_metadata(cls, metadata: Any) -> LayoutRecord | None:
        """The record in a DCP ``Metadata`` (``None`` for checkpoints saved without our planner)."""
        data = getattr(metadata, "planner_data", None)
        if not isinstance(data, Mapping) or METADATA_KEY not in data:
            return None
        return cls.from_json(data[METADATA_KEY], where=f"Metadata.planner_data[{METADATA_KEY!r}]")

    @classmethod
    def from_manifest(cls, manifest: Any) -> LayoutRecord | None:
        """The record in a manifest's ``extra`` (``None`` when the save recorded none)."""
        extra = getattr(manifest, "extra", None) or {}
        if MANIFEST_KEY in extra:
            return cls.from_json(extra[MANIFEST_KEY], where=f"manifest extra[{MANIFEST_KEY!r}]")
        if isinstance(extra.get("layout"), Mapping):  # smpckpt 0.1.0's save_checkpoint
            fields = {name: extra.get(name) for name in ("layout", "specs", "rank_local")}
            return cls.from_json({"version": 1, **fields}, where="manifest extra (0.1.0 layout fields)")
        return None

    @staticmethod
    def world_dtensors(per_rank: Sequence[str]) -> str | None:
        """:attr:`dtensors` of every rank's ``planners._entries.dtensor_layout`` (by rank); ``None``: none held one."""
        return hashlib.blake2b(",".join(per_rank).encode(), digest_size=8).hexdigest() if any(per_rank) else None

    @staticmethod
    def json_in_metadata(metadata: Any) -> Mapping[str, Any] | None:
        """The raw JSON of the record in ``metadata`` (what the storage writer copies into the manifest)."""
        data = getattr(metadata, "planner_data", None)
        if isinstance(data, Mapping) and isinstance(data.get(METADATA_KEY), Mapping):
            return data[METADATA_KEY]
        return None


def checkpoint_ties(metadata: Any) -> dict[str, str]:
    """Tied keys a checkpoint stores once (key -> the key holding its bytes): from our record, or from
    what the storage reader found missing in a plain Hugging Face folder (:data:`TIED_KEY`)."""
    return {str(k): str(v) for k, v in _recorded(metadata, "tied", TIED_KEY).items()}


def checkpoint_original_shapes(metadata: Any) -> dict[str, tuple[int, ...]]:
    """Shapes tensors stored in a view had before it (key -> shape): from our record, or from what the
    storage reader knows of a Hugging Face folder's fused tensors (:data:`MERGED_KEY`)."""
    return {str(k): tuple(int(n) for n in v) for k, v in _recorded(metadata, "original_shapes", MERGED_KEY).items()}


def _recorded(metadata: Any, field: str, key: str) -> Mapping[str, Any]:
    """``field`` of the checkpoint's record, else the mapping under ``planner_data[key]`` (a plain
    Hugging Face folder read through our storage reader), else none."""
    record = LayoutRecord.from_metadata(metadata)
    if record is not None:
        return getattr(record, field)
    data = getattr(metadata, "planner_data", None)
    found = data.get(key) if isinstance(data, Mapping) else None
    return found if isinstance(found, Mapping) else {}


def wrap_name_map(name_map: NameMap | None) -> NameMap | None:
    """The user's map sees model/optimizer keys only; our own keys (rng, user_content) pass through."""
    if name_map is None:
        return None
    own = (f"{RESERVED.rng}.", RESERVED.user_content)

    def mapped(key: str) -> str:
        if key.startswith(own[0]) or key == own[1]:
            return key
        return name_map(key)

    return mapped

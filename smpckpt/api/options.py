"""The options of a :class:`~smpckpt.Checkpointer` and of its calls: one frozen dataclass per concern, a
docstring per field (the one place each is documented), each validated once in ``__post_init__``; the
layers below trust them. Per job: :class:`Location`, :class:`Sharding`, :class:`FastTier`,
:class:`Retention`, :class:`AsyncOptions`; per call: :class:`SaveOptions`, :class:`ExportOptions`,
:class:`ResumeOptions`. Each field's metadata says whether every rank must pass the same value (``same``:
compared by one digest at every call).
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.distributed.checkpoint.state_dict import _get_fqns
from torch.distributed.tensor import DTensor

from smpckpt._checks import check_flag, check_globs, check_int, check_process_group
from smpckpt.catalog.root import validate_keep
from smpckpt.errors import LayoutMismatch, SpecError
from smpckpt.model.layout import FULL_ARTIFACTS, RESERVED, NameMap, ParallelLayout
from smpckpt.model.specs import SpecLike, SpecRules, spec_rules
from smpckpt.model.translation import Translation, check_translation_function
from smpckpt.storage import FullOptions
from smpckpt.storage.backends._fs import OwnedOptions

if TYPE_CHECKING:
    from smpckpt.api._resume import ResumeRequest

__all__ = [
    "Location",
    "Sharding",
    "FastTier",
    "Retention",
    "AsyncOptions",
    "SaveOptions",
    "ExportOptions",
    "ResumeOptions",
]


def _opt(default: Any = dataclasses.MISSING, *, same: bool | Callable[[Any], Any] = True) -> Any:
    """A field; ``same``: compared across ranks (``True``), not (``False``; a rank's own value: a node's
    folder, credentials, a callable), or compared as ``same(value)`` (a picklable stand-in)."""
    return dataclasses.field(default=default, metadata={"same": same})


def config_value(config: Any, name: str) -> Any:
    """``config.<name>`` of a transformers config or a dict (``None`` when absent)."""
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)


class _Options:
    """What every option class shares: flags are checked booleans; :meth:`compared`."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if isinstance(f.default, bool):
                check_flag(f.name, getattr(self, f.name))

    def compared(self) -> dict[str, Any]:
        """The fields every rank must pass alike, by name (picklable stand-ins where ``same`` says)."""
        return {
            f.name: key(getattr(self, f.name)) if callable(key) else getattr(self, f.name)
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if (key := f.metadata.get("same", True))
        }


@dataclasses.dataclass(frozen=True)
class Location(_Options):
    """Where the checkpoints of a job live."""

    path: str
    """The checkpoint root: a local path (or ``os.PathLike``) or any URL the storage supports
    (``s3://bucket/run``), smp's folder layout under it. A local path (or ``file://``, ``local://`` URL) is made
    absolute, ``~`` expanded, when the Location is built (a later ``os.chdir`` moves no checkpoint)."""

    storage_options: Mapping[str, Any] | None = _opt(None, same=False)
    """fsspec options of ``path`` (S3: ``key``, ``secret``, ``client_kwargs``...)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(self.path).__name__}")
        if not os.fspath(self.path):
            raise ValueError("path must not be empty")
        # a local root is resolved once, here: a relative one followed the process's cwd at every call (a
        # chdir between saves, or before a background save wrote, put checkpoints under another root)
        object.__setattr__(self, "path", _absolute_local(os.fspath(self.path)))
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise TypeError(f"storage_options must be a mapping or None, got {type(self.storage_options).__name__}")
        if self.storage_options is not None and not isinstance(self.storage_options, OwnedOptions):
            # the filesystems built from them serve this location for its life (hunt66b L1); the caller's own
            object.__setattr__(self, "storage_options", OwnedOptions(self.storage_options))

    def __reduce__(self) -> Any:  # unpickled or deep-copied: its options (a plain dict then) owned again (rev67b F4)
        return (type(self), (self.path, self.storage_options))


@dataclasses.dataclass(frozen=True)
class Sharding(_Options):
    """How the state is laid out over the ranks."""

    layout: ParallelLayout | None = _opt(None, same=lambda layout: layout.to_dict() if layout is not None else None)
    """The parallel layout (:class:`~smpckpt.ParallelLayout`; recorded in every checkpoint). ``None``: pure
    data parallel over the world -- also right for models whose parameters are all DTensors (FSDP2,
    ``parallelize_module``): they carry their own layout."""

    specs: Mapping[str, SpecLike] | SpecRules | None = _opt(None, same=False)  # compared as ``rules``
    """glob -> :class:`~smpckpt.ShardSpec` for plain sharded tensors (Megatron-style local shards), matched
    against stored keys (``model.layers.3.qkv.weight``) or the model's own names (``layers.3.qkv.weight``,
    as :func:`smpckpt.hf.llama.tp_specs` writes rules); the first match wins. Optimizer state inherits its
    parameter's spec."""

    name_map: NameMap | None = _opt(None, same=lambda fn: fn is not None)
    """Stage-local -> global key map for pipeline stages (sees ``model.*``/``optim.*`` keys), used both ways."""

    process_group: Any = _opt(None, same=False)
    """The group that saves and loads (``None``: the default group; without one, a world of one)."""

    held_by_some: tuple[str, ...] = _opt((), same=tuple)
    """Globs (matched as ``specs`` are; a parameter's optimizer state follows it) of keys only some ranks hold,
    as copies of each other: experts under their global ids (``experts.*``), each on its expert's DP ranks.
    Their holders must agree on dtype, shape and values (else refused by key and ranks); one writes each."""

    join_timeout: float | None = None  # compared: whether a rank makes the join group must not differ
    """Seconds a save waits for every rank of the group to enter it (``None``: unchecked, the caller's group's
    own timeout). A save made by some ranks only (from a SIGTERM handler, or on a flag only they check) meets
    the others inside their training collectives, and every rank hangs: with a bound those ranks fail in this
    time instead, naming the ranks that did not join (README, "Preemption"). Off by default: ranks reaching a
    save legitimately further apart (rank 0 evaluating alone before it) would fail it and every later one."""

    rules: SpecRules = dataclasses.field(
        init=False, repr=False, compare=False, metadata={"same": lambda rules: rules.to_records()}
    )
    #: ``specs`` as the planners take them (derived, compared across ranks)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layout is not None and not isinstance(self.layout, ParallelLayout):
            raise TypeError(f"layout must be a ParallelLayout or None, got {type(self.layout).__name__}")
        if self.name_map is not None and not callable(self.name_map):
            raise TypeError(f"name_map must be callable (str -> str), got {type(self.name_map).__name__}")
        check_process_group(self.process_group)
        wait = self.join_timeout
        if wait is not None and (
            isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 < wait < math.inf
        ):
            raise ValueError(f"join_timeout must be a positive number of seconds or None, got {wait!r}")
        # a lone string (tuple("experts.*") is one glob a character) or a non-string item is refused by name
        object.__setattr__(self, "held_by_some", check_globs("held_by_some", self.held_by_some))
        object.__setattr__(self, "rules", spec_rules(self.specs))
        if isinstance(self.specs, Mapping):
            # a copy: the rules were derived once, so a later change to the caller's dict must not show in
            # ``specs`` while the rules still say the old (options are read once, at the edge)
            object.__setattr__(self, "specs", dict(self.specs))


def _absolute_local(path: str) -> str:
    """``path`` made absolute (``~`` expanded, as fsspec does) when local or a ``file://`` or ``local://`` URL."""
    for scheme in ("file://", "local://"):  # fsspec's two names of local disk (rev72a M3: local:// was left)
        if path.startswith(scheme):
            return scheme + os.path.abspath(os.path.expanduser(path[len(scheme) :]))
    if "://" in path or "::" in path:  # a URL, or an fsspec chain (``simplecache::s3://...``)
        return path
    return os.path.abspath(os.path.expanduser(path))


def check_local_path(path: Any) -> str:
    """``local_path``: a folder on this node (a path, ``file://`` or ``local://`` URL), as an absolute path."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise TypeError(f"local_path must be a non-empty str or os.PathLike, got {path!r}")
    text = str(os.fspath(path))
    scheme = next((s for s in ("file://", "local://") if text.startswith(s)), "")  # fsspec's names of local disk
    text = text[len(scheme) :]
    if not scheme and "://" in text:
        raise ValueError(f"local_path must be a folder on this node (NVMe, /dev/shm), not a URL: {text!r}")
    if not text:  # "local://" alone: not the working directory (rev72o)
        raise ValueError(f"local_path {os.fspath(path)!r} names no folder")
    return os.path.abspath(os.path.expanduser(text))


@dataclasses.dataclass(frozen=True)
class FastTier(_Options):
    """Tiered checkpoints: every save to the nodes' own fast storage first, every few to ``path``
    (README, "Tiered checkpoints")."""

    local_path: str = _opt(same=False)
    """This node's fast tier (node-local NVMe or ``/dev/shm``; the same on every rank of a node; kept
    absolute). Every save commits there first, each rank's files also copied to ``replicas - 1`` other
    nodes; every ``durable_every``-th save is then drained to ``path`` in the background. Copies live in a
    folder of this ``path``'s own (``{local_path}/smpckpt-job-<hash of path>``). A resume loads the newest
    checkpoint complete across the surviving fast tiers or in ``path`` (:attr:`ResumeInfo.tier`)."""

    replicas: int = 2
    """Copies of each rank's files in the fast tiers, each on a different node (``LOCAL_WORLD_SIZE``
    ranks per node); at most the number of nodes."""

    durable_every: int = 1
    """Every N-th save of the job (counted across restarts) is also drained to ``path`` in the background;
    a drain that did not commit (a killed job, a failure) is retried by the next save that is not itself due
    (never one older than a drain still running)."""

    num_kept_local: int | None = 2
    """Keep the N newest checkpoints complete across the fast tiers (never one a drain is copying, nor, of
    those due for ``path`` whose drain did not commit, the one the next save drains again and one whose drain
    was running when the save was planned: the others go, warned); ``None`` keeps all."""

    drain_memory: int = _opt(384 << 20, same=False)
    """Bytes of host memory a rank's drain may hold at once (the fast-tier files' reads it has not written
    yet; on object stores, the parts uploading): the files copied at once (4 to filesystems, 16 to object
    stores) wait for room. One file always proceeds, so a cap below one file's need (a 16 MiB read; on
    object stores, plus three 32 MiB parts) copies a file at a time, above the cap; a check unit larger
    than a read (a tile's row group of rows past 8 MiB) is read whole, past it. Below the default, a
    drain to S3 took longer (README, the fast tier's "Memory")."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "local_path", check_local_path(self.local_path))
        check_int("replicas", self.replicas, minimum=1)
        check_int("durable_every", self.durable_every, minimum=1)
        check_int("drain_memory", self.drain_memory, minimum=1 << 20)
        validate_keep(self.num_kept_local, "num_kept_local")


@dataclasses.dataclass(frozen=True)
class Retention(_Options):
    """What is removed under ``path`` after each save (rank 0, only after the new one committed)."""

    num_kept_partial_checkpoints: int | None = None
    """Keep only the N newest committed partial checkpoints of the job's history (N >= 1; by sequence
    number, never by a clock; the saves a roll-back by ``tag=`` abandoned are kept, uncounted), never the
    tag ``newest`` names; ``None`` keeps all. Full checkpoints are never counted or removed."""

    remove_uncommitted_older_than: float | None = None
    """Seconds: also remove uncommitted folders (debris of killed saves) with no write for that long and
    abort S3 multipart uploads under ``path`` started that long ago. Make it longer than any save
    (``6 * 3600``); ``None`` leaves them (``smpckpt prune`` removes them)."""

    def __post_init__(self) -> None:
        validate_keep(self.num_kept_partial_checkpoints)
        stale = self.remove_uncommitted_older_than
        # NaN passes "< 0" and is unequal to itself: every rank would then seem to pass another value
        if stale is not None and (
            isinstance(stale, bool) or not isinstance(stale, (int, float)) or math.isnan(stale) or stale < 0
        ):
            raise ValueError(f"remove_uncommitted_older_than must be seconds >= 0 or None, got {stale!r}")


@dataclasses.dataclass(frozen=True)
class AsyncOptions(_Options):
    """Saves that return before the state is written (README, "Async saves")."""

    enabled: bool = False
    """Partial saves return a ``concurrent.futures.Future`` once the state is staged (copied into reused
    host buffers), and are written, committed and retained on a background thread with a gloo group of
    its own (one in flight per Checkpointer); :attr:`SaveOptions.async_save` overrides it per save."""

    overlap_staging: bool = False
    """``True``: the parameters and optimizer state of the optimizers passed to a save are staged on the
    background thread, overlapping the next forward and backward; every optimizer's ``step`` waits (a
    global step pre-hook) only for staging still unfinished. Everything else is staged before the save returns.

    Off by default because the contract is the caller's: until staged, those tensors may change only
    through the optimizers' ``step``. An in-place change through autograd-visible ops fails the save
    naming it (its version counter moved, once the op finished), but writes that bypass the counter
    (``p.data`` writes, in-place collectives such as ``dist.broadcast(p)``, numpy or dlpack views,
    CUDA-graph replays, custom kernels) reach the checkpoint."""

    exit_status: int | None = _opt(1, same=False)
    """The exit status of a process whose background save failed and was never raised to it; ``None``
    keeps the interpreter's own (the failure is logged at ERROR). A non-zero status ends the process with
    ``os._exit`` once the other exit hooks ran; a program's own ``sys.exit(N)``, ``N`` non-zero, is kept."""

    def __post_init__(self) -> None:
        super().__post_init__()
        status = self.exit_status
        if status is not None and (isinstance(status, bool) or not isinstance(status, int) or not 0 <= status <= 255):
            raise ValueError(f"exit_status must be an exit status 0..255 or None, got {status!r}")


@dataclasses.dataclass(frozen=True)
class SaveOptions(_Options):
    """The options of one partial save (:meth:`smpckpt.Checkpointer.save`)."""

    async_save: bool | None = None
    """This save in the background (:class:`AsyncOptions`); ``None``: :attr:`AsyncOptions.enabled`."""

    wait_for_previous: bool = _opt(True, same=False)
    """A save first waits for the background save in flight, logging how long; ``False`` raises
    :class:`~smpckpt.errors.CheckpointError` instead."""

    overwrite: bool = False
    """Replace a committed checkpoint of the same tag (not with a fast tier)."""

    save_rng: bool = True
    """Save every rank's RNG states; resume restores them under an unchanged layout."""

    format: Literal["raw", "torch_save"] = "raw"
    """``"raw"`` (fast, range-readable) or ``"torch_save"`` (stock-DCP-readable)."""

    sync_files: bool = True
    """fsync data before the commit (``False`` accepts losing a "committed" checkpoint to a power loss)."""

    freeze_gc: bool = _opt(True, same=False)
    """Run a synchronous save inside :func:`smpckpt.gc_frozen` (README, "Garbage collection")."""

    verify_replicas: bool = True
    """Ranks holding the same piece of a tensor (replicas) must hold the same values (a sampled digest), or
    the save fails naming keys and ranks: one replica is written, so a forgotten TP spec would lose data.
    Keys under ``Sharding(held_by_some=...)`` are compared across their holders even when this is off."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.async_save is not None:
            check_flag("async_save", self.async_save)
        if self.format not in ("raw", "torch_save"):
            hint = (
                " ('safetensors' is a format of full checkpoints: ExportOptions)"
                if self.format == "safetensors"
                else ""
            )
            raise ValueError(f"format must be 'raw' or 'torch_save', got {self.format!r}{hint}")


@dataclasses.dataclass(frozen=True)
class ExportOptions(_Options):
    """The options of a full artifact (:meth:`smpckpt.Checkpointer.export`; ``save_checkpoint(...,
    partial=False)``): the Hugging Face shaped files README "Full checkpoints" describes."""

    format: Literal["safetensors", "torch_save"] = "safetensors"
    """``"safetensors"`` (``model.safetensors``...) or ``"torch_save"`` (``pytorch_model.bin``..., see
    :attr:`smpckpt.storage.FullOptions.format`)."""

    include_optimizer: bool = False
    """Also write the optimizer's tensor state to ``optimizer.safetensors``, keyed ``<param fqn>.<name>``
    (not its hyper-parameters). Needs ``optimizer=`` (or a partial checkpoint saved with one)."""

    dtype: torch.dtype | None = _opt(None, same=str)
    """Cast floating-point tensors on export (fp32 -> ``torch.bfloat16``), as
    :attr:`smpckpt.storage.FullOptions.dtype`."""

    hf_config: Any = _opt(None, same=lambda c: config_value(c, "tie_word_embeddings"))
    """A Hugging Face config (or dict) written as ``config.json`` (rank 0's), as
    :attr:`smpckpt.storage.FullOptions.hf_config`; a head tied to its embedding is left out unless it says
    ``tie_word_embeddings: false`` (that flag must agree across ranks)."""

    translate_function: Translation | None = _opt(None, same=lambda t: t and t.name)
    """A :class:`~smpckpt.model.translation.Translation` (``smpckpt.hf.gpt2.TRANSLATION``): the artifact
    gets Hugging Face names and layouts, translated shard by shard (a plain callable would need the whole
    state dict on one rank)."""

    max_shard_size: int | str | None = None
    """Bytes (or ``"5GB"``) per file; ``None``: :attr:`smpckpt.storage.FullOptions.max_shard_size`'s
    default, the one default of every full export (API, ``consolidate_checkpoint``, CLI)."""

    sync_files: bool = True
    """As :attr:`SaveOptions.sync_files`."""

    freeze_gc: bool = _opt(True, same=False)
    """As :attr:`SaveOptions.freeze_gc`."""

    verify_replicas: bool = True
    """As :attr:`SaveOptions.verify_replicas`."""

    out_storage_options: Mapping[str, Any] | None = _opt(None, same=False)
    """fsspec options of ``out`` when it is given (default: :attr:`Location.storage_options`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.out_storage_options is not None and not isinstance(self.out_storage_options, Mapping):
            raise TypeError(
                f"out_storage_options must be a mapping or None, got {type(self.out_storage_options).__name__}"
            )
        check_translation_function(self.translate_function)
        if self.dtype is not None and (not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point):
            raise ValueError(
                f"dtype must be a floating-point torch.dtype (it casts floating tensors), got {self.dtype!r}"
            )
        self.artifact()  # the artifact's own checks (format, max_shard_size, config and translation), once

    def artifact(self, architecture: str | None = None) -> FullOptions:
        """The full artifact's layout; ``architecture``: see :class:`FullOptions`."""
        return FullOptions(
            format=self.format,
            max_shard_size=self.max_shard_size,
            dtype=self.dtype,
            artifacts=FULL_ARTIFACTS,
            translation=self.translate_function,
            hf_config=self.hf_config,
            architecture=architecture,
        )


@dataclasses.dataclass(frozen=True)
class ResumeOptions(_Options):
    """The options of one resume (:meth:`smpckpt.Checkpointer.resume`)."""

    partial: bool = True
    """``True``: a partial checkpoint ``{path}/{tag}_partial``. ``False``: a full one, ``{path}/{tag}/``
    (``tag=None``: ``path`` itself; or a plain Hugging Face folder, read unverified), with optimizer tensor
    state when it has some and ``optimizer`` is given; no RNG, no :func:`~smpckpt.last_resume_info`."""

    translate_function: Callable[[dict[str, Any]], dict[str, Any]] | Translation | None = _opt(None, same=False)
    """``partial=True``: ``state_dict -> state_dict`` applied to the loaded model state before it is set
    into ``model`` (Hugging Face <-> our names). ``partial=False``: a
    :class:`~smpckpt.model.translation.Translation` (``smpckpt.hf.gpt2.TRANSLATION``), applied box by box
    while reading."""

    missing_ok: bool = False
    """Return ``None`` (start fresh) instead of raising :class:`~smpckpt.errors.CheckpointNotFound` when
    nothing committed exists (``partial=True`` only); not when ``newest`` names a damaged checkpoint."""

    strict: bool = True
    """Refuse, before reading data, when model/optimizer keys are missing from the checkpoint or
    checkpoint keys would be left unloaded; ``False`` skips them (:attr:`ResumeInfo.skipped_keys`; from a
    full artifact, a warning). A parameter the checkpoint holds no optimizer state for resumes without state
    into an optimizer that had none."""

    load_rng: bool = True
    """Restore the saved RNG states when the layout (and world size) is unchanged (``partial=True`` only)."""

    allow_pickle: bool = False
    """Load stored objects (``user_content``) with arbitrary classes: trusted checkpoints only."""

    allow_dtype_cast: bool = False
    """Convert tensors saved in another dtype instead of refusing."""

    keep_tied: Sequence[str] = _opt((), same=tuple)
    """Globs (``*`` crosses dots) of checkpoint keys (``model.`` first): when the model ties two keys that
    the checkpoint holds apart with different values (a Hugging Face folder of an untied model), the load
    is refused naming both unless one matches here: that one is loaded, the other ignored
    (``["model.lm_head.weight"]``). Values held apart but equal load without it."""

    verify_checksums: bool = True
    """Check every byte read against its checksum."""

    freeze_gc: bool = _opt(True, same=False)
    """Run the load inside :func:`smpckpt.gc_frozen`."""

    def __post_init__(self) -> None:
        super().__post_init__()
        tied = self.keep_tied
        if isinstance(tied, str) or not isinstance(tied, Sequence) or not all(isinstance(g, str) for g in tied):
            raise TypeError(f"keep_tied must be a list of key globs, got {tied!r}")
        object.__setattr__(self, "keep_tied", tuple(tied))
        fn = self.translate_function
        if self.partial:
            if fn is not None and not callable(fn):
                raise TypeError("translate_function must be callable (state_dict -> state_dict)")
            return
        check_translation_function(self.translate_function, "with partial=False, ")
        wrong = [
            name for name, default in (("missing_ok", False), ("load_rng", True)) if getattr(self, name) != default
        ]
        if wrong:
            verb = "applies" if len(wrong) == 1 else "apply"
            raise ValueError(f"{', '.join(wrong)} {verb} only to partial checkpoints (partial=True)")


# -- a partial resume's checks of the optimizers and translate_function before the apply; the function applied --


def check_groups(req: ResumeRequest, state: dict[str, Any]) -> tuple[str, ...]:
    """(all ranks, in ``ctx.all_ok`` before :func:`apply_state`: a lone failure in ``set_state_dict`` would hang
    its collectives or leave ranks on different checkpoints) Refuse a param group saved with differing
    hyper-parameters (``strict``; else warn: ``set_state_dict`` gives all the first one's), then put the
    ``translate_function``'s state dict in ``state``'s model entry. Returns the keys it left unloaded."""
    model, optim_sd = req.model, state.get(RESERVED.optim, {})
    present = {k[len("param_groups.") :].rpartition(".")[0] for k in optim_sd if k.startswith("param_groups.")}
    names: dict[int, list[str]] = {}
    if model is not None and req.optimizers:
        for name, param in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).extend(sorted(f for f in _get_fqns(model, name) if f in present))
    for o, opt in enumerate(req.optimizers):
        for g, group in enumerate(opt.param_groups):
            if not group["params"]:  # DCP's set_state_dict fails on it with a bare IndexError
                raise SpecError(
                    f"optimizer {o}'s param group {g} holds no parameters: torch.distributed.checkpoint's "
                    "set_state_dict cannot load an optimizer with an empty group. Build the optimizer without "
                    "it (add groups with add_param_group when their parameters exist)"
                )
            fqns = [names[id(p)][0] for p in group["params"] if names.get(id(p))]
            for hp in group:
                if hp == "params":
                    continue
                values = {f: optim_sd[k] for f in fqns if (k := f"param_groups.{f}.{hp}") in optim_sd}
                first = next(iter(values.values()), None)
                differ = {f: v for f, v in values.items() if not _same_value(v, first)}
                if not differ:
                    continue
                shown = ", ".join(f"{f}: {v!r}" for f, v in [(next(iter(values)), first), *list(differ.items())[:4]])
                message = (
                    f"optimizer {o}, param group {g}: its parameters were saved with different {hp!r} ({shown}); "
                    "one group takes one value. Build the optimizer's param groups as they were saved"
                )
                if req.opts.strict:
                    raise LayoutMismatch(message + " (or resume with strict=False to give the group the first value)")
                # the caller's line: below it resume (or resume_from_checkpoint), _resume, all_ok, its lambda
                warnings.warn(message + f"; strict=False: the group takes {first!r}", stacklevel=6)
    if model is None or not callable(req.opts.translate_function):  # partial=True: a callable (ResumeOptions)
        return ()
    state[RESERVED.model], untranslated = translated(
        req.opts.translate_function, state[RESERVED.model], req.opts.strict, stateful_keys(model, req.optimizers)
    )
    return untranslated


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    try:
        # NaN equals nothing, itself included: a NaN every parameter saved alike prints alike
        return bool(a == b) or (type(a) is type(b) and repr(a) == repr(b))
    except (RuntimeError, TypeError, ValueError):  # containers of tensors (tensor betas): compare as printed
        return repr(a) == repr(b)


def stateful_keys(model: Any, optimizers: Sequence[Any]) -> frozenset[str]:
    """The model keys whose parameters hold optimizer state (a value moved between them changes its moments)."""
    held = {id(p) for o in optimizers for p, s in o.state.items() if s}
    named = model.named_parameters(remove_duplicate=False)
    return frozenset(f for n, p in named if id(p) in held for f in _get_fqns(model, n))


def translated(
    fn: Any, loaded: Mapping[str, Any], strict: bool, held: frozenset[str] = frozenset()
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``fn(loaded)``, what the model loads (smp's meaning), and the keys not loaded: those it dropped (the
    model keeps its values: they were loaded aside, :func:`aside`) and those it returned that the model
    lacks; ``strict`` refuses both, naming them (not torch's bare ``RuntimeError`` from the apply). With
    keys holding optimizer state (``held``), a value it moved from or to one of them (a swap, a rename) is
    refused under ``strict``, else warned: the optimizer state stays by key, the parameter would take the other's."""
    given = dict(loaded)  # what it was given: a function may swap or rename in the dict itself (rev66e F1)
    out = fn(loaded)
    if not isinstance(out, Mapping):
        raise TypeError(f"translate_function returned {type(out).__name__}, not a state dict")
    was = {id(v): k for k, v in given.items() if held and isinstance(v, torch.Tensor)}  # tied keys share one
    moved = [(was[id(v)], k) for k, v in out.items() if k in given and v is not given[k] and id(v) in was]
    moved = [(a, b) for a, b in moved if a in held or b in held]  # buffers, stateless parameters: no moments
    if moved:  # the optimizer state is resumed by key: each would take its new value with the old moments
        note = (
            f"translate_function moved values between model keys ({', '.join(f'{a} -> {b}' for a, b in moved[:8])})"
            ": the optimizer's state is resumed by key, so each parameter would take the other key's value with its "
            "own optimizer state"
        )
        if strict:
            raise LayoutMismatch(note + "; resume without optimizer=, or with strict=False to load so")
        warnings.warn(note + "; strict=False: loaded so", stacklevel=7)  # the caller's line, as check_groups'
    dropped, added = sorted(k for k in given if k not in out), sorted(k for k in out if k not in given)
    if strict and (dropped or added):
        said = [f"dropped {', '.join(dropped[:8])} (the model holds them)"] if dropped else []
        said += [f"returned {', '.join(added[:8])}, which the model lacks"] if added else []
        raise LayoutMismatch(
            f"translate_function {'; '.join(said)}: strict=True loads every model key from what it returns "
            "(strict=False: a dropped key keeps the model's value, an unknown one is skipped; both are listed "
            "in ResumeInfo.skipped_keys)"
        )
    return {k: v for k, v in out.items() if k in given}, tuple(f"{RESERVED.model}.{k}" for k in (*dropped, *added))


def aside(model_sd: Mapping[str, Any]) -> dict[str, Any]:
    """(a resume with a translate_function) Fresh destinations for the model's state, tied keys still tied:
    the load lands in them, not in the model, which takes only what the function returns -- a key it
    drops, or one the load skips (``strict=False``), keeps the model's value (copies: rev66e F0), and a value it
    moves to another key (a swap, a transposed view) is never read from a parameter already overwritten."""
    made: dict[Any, torch.Tensor] = {}
    out = dict(model_sd)
    for key, value in model_sd.items():
        if isinstance(value, torch.Tensor):
            at = _where(value) if value.numel() else key  # empty tensors share address 0
            if at not in made:
                made[at] = value.detach().clone()
            out[key] = made[at]
    return out


def _where(value: torch.Tensor) -> tuple[Any, ...]:
    """Where a tensor's local memory is and how it is seen: another dtype, conj or neg view is another tensor."""
    local = value.to_local() if isinstance(value, DTensor) else value
    at = local.untyped_storage().data_ptr(), local.data_ptr(), tuple(local.shape), local.stride()
    return (*at, local.dtype, local.is_conj(), local.is_neg())

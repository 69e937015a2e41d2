"""The options of :func:`~smpckpt.save_checkpoint` and :func:`~smpckpt.resume_from_checkpoint`: one
frozen dataclass each, a docstring per field (the one place they are documented), validated once in
``__post_init__``, before anything runs. The functions' keywords of the same names build them (or pass
one as ``options=``).

Each field's metadata says which mode it applies to (``only=True``: ``partial=True``; ``only=False``:
``partial=False``; unmarked: both): a value other than the default in the other mode is refused by name
(:class:`ValueError`) rather than ignored -- ``dtype=`` on a partial save would write fp32 without a
word. And whether every rank must pass the same value (``same``): the API compares those fields across
ranks (:meth:`SaveOptions.compared`), naming the one that differs.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch

from smpckpt._checks import check_flag, check_int
from smpckpt.catalog.retention import validate_keep
from smpckpt.model.keys import FULL_ARTIFACTS
from smpckpt.model.translation import Translation
from smpckpt.storage import FullOptions

__all__ = ["SaveOptions", "ResumeOptions"]


def _opt(default: Any, *, only: bool | None = None, same: bool | Callable[[Any], Any] = True) -> Any:
    """A field: ``only`` = the ``partial`` value it applies to (``None``: both); ``same``: compared across
    ranks (``True``), not (``False``), or compared as ``same(value)`` (a picklable stand-in)."""
    return dataclasses.field(default=default, metadata={"only": only, "same": same})


def config_value(config: Any, name: str) -> Any:
    """``config.<name>`` of a transformers config or a dict (``None`` when absent)."""
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)


def check_local_path(path: Any) -> str:
    """``local_path``: a folder on this node (a path or ``file://`` URL), as an absolute path."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise TypeError(f"local_path must be a non-empty str or os.PathLike, got {path!r}")
    text = str(os.fspath(path))
    if text.startswith("file://"):
        text = text[len("file://") :]
    elif "://" in text:
        raise ValueError(f"local_path must be a folder on this node (NVMe, /dev/shm), not a URL: {text!r}")
    return os.path.abspath(text)


class _Options:
    """What both option classes share: flags are booleans, options of the other mode are refused,
    ``local_path`` is a folder on this node, ``partial=False`` translates by a :class:`Translation`."""

    partial: bool
    local_path: str | os.PathLike[str] | None
    translate_function: Any

    def __post_init__(self) -> None:
        if self.local_path is not None:
            check_local_path(self.local_path)
        fn = self.translate_function
        if not self.partial and fn is not None and not isinstance(fn, Translation):
            raise TypeError(
                "with partial=False, translate_function must be a smpckpt.model.translation.Translation (for example "
                "smpckpt.hf.llama.TRANSLATION): full checkpoints are translated shard by shard (plain callables would "
                f"need the whole state dict on one rank); got {type(fn).__name__}"
            )
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if isinstance(f.default, bool):
                check_flag(f.name, getattr(self, f.name))
        only = {f.name: f.metadata["only"] for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        given = [name for name in self.given() if only[name] not in (None, self.partial)]
        if given:
            verb, kind = "applies" if len(given) == 1 else "apply", "full" if self.partial else "partial"
            raise ValueError(f"{', '.join(given)} {verb} only to {kind} checkpoints (partial={not self.partial})")

    def given(self) -> list[str]:
        """The fields set to something other than their default."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]  # type: ignore[arg-type]

    def compared(self) -> dict[str, Any]:
        """The fields every rank must pass alike, by name (picklable stand-ins where ``same`` says)."""
        return {
            f.name: key(getattr(self, f.name)) if callable(key) else getattr(self, f.name)
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if (key := f.metadata["same"])
        }


@dataclasses.dataclass(frozen=True)
class SaveOptions(_Options):
    """The options of :func:`~smpckpt.save_checkpoint`."""

    partial: bool = _opt(True)
    """``True``: a partial checkpoint ``{path}/{tag}_partial`` (every rank saves its own shards; resumable
    under any layout), then named by ``{path}/newest``. ``False``: one full artifact ``{path}/{tag}/``
    readable without smpckpt (README, "Full checkpoints"), which ``newest`` and retention ignore."""

    num_kept_partial_checkpoints: int | None = _opt(None)
    """Keep only the N newest committed partial checkpoints (N >= 1), deleting older ones on rank 0 after
    this one committed; ``None`` keeps all. Accepted (and checked) with ``partial=False``, as smp accepts
    it: there it changes nothing (full checkpoints are never counted or removed)."""

    overwrite: bool = _opt(False, only=True)
    """Replace a committed checkpoint of the same tag (a full artifact's file names are fixed: it is never
    overwritten)."""

    save_rng: bool = _opt(True, only=True)
    """Save every rank's RNG states (torch, CUDA, python, numpy); resume restores them under an unchanged
    layout."""

    format: Literal["raw", "torch_save", "safetensors"] = _opt("raw")
    """Partial checkpoints: ``"raw"`` (fast, range-readable) or ``"torch_save"`` (stock-DCP-readable).
    Full ones: ``"safetensors"`` (``"raw"`` means the same) or ``"torch_save"`` (``pytorch_model.bin``...,
    see :attr:`smpckpt.storage.FullOptions.format`)."""

    sync_files: bool = _opt(True)
    """fsync data before the commit (``False`` accepts losing a "committed" checkpoint to a power loss)."""

    remove_uncommitted_older_than: float | None = _opt(None, only=True)
    """Seconds: after the commit, rank 0 also removes uncommitted folders (debris of killed saves) with no
    write for that long and aborts S3 multipart uploads under ``path`` started that long ago. Make it
    longer than any save (``6 * 3600``); ``None`` leaves them (``smpckpt prune`` removes them)."""

    include_optimizer: bool = _opt(False, only=False)
    """Also write the optimizer's tensor state to ``optimizer.safetensors``, keyed ``<param fqn>.<name>``
    (hyper-parameters are not saved). Needs ``optimizer=``."""

    dtype: torch.dtype | None = _opt(None, only=False, same=str)
    """Cast floating-point tensors on export (fp32 -> ``torch.bfloat16``), as
    :attr:`smpckpt.storage.FullOptions.dtype`."""

    hf_config: Any = _opt(None, only=False, same=lambda c: config_value(c, "tie_word_embeddings"))
    """A Hugging Face config (or dict) written as ``config.json`` (rank 0's), as
    :attr:`smpckpt.storage.FullOptions.hf_config`; a head tied to its embedding is left out unless it
    says ``tie_word_embeddings: false`` (that flag must agree across ranks)."""

    translate_function: Translation | None = _opt(None, only=False, same=lambda t: t and t.name)
    """A :class:`~smpckpt.model.translation.Translation` (``smpckpt.hf.gpt2.TRANSLATION``): the artifact
    gets Hugging Face names and layouts, translated shard by shard."""

    max_shard_size: int | str | None = _opt(None, only=False)
    """Bytes (or ``"5GB"``) per file; ``None``: :attr:`smpckpt.storage.FullOptions.max_shard_size`'s
    default, the one default of every full export (API, ``consolidate_checkpoint``, CLI)."""

    async_save: bool = _opt(False, only=True)
    """Return a ``concurrent.futures.Future`` once the state is staged (copied into reused host buffers)
    and write, commit, point ``newest`` and apply retention on a background thread with a gloo group of
    its own (README, "Async saves"). One save is in flight at a time; :func:`smpckpt.wait_for_saves`
    finishes it (call it before ``destroy_process_group()``); a resume waits for it first."""

    wait_for_previous: bool = _opt(True, same=False)
    """A save first waits for the background save in flight, logging how long; ``False`` raises
    :class:`~smpckpt.errors.CheckpointError` instead."""

    freeze_gc: bool = _opt(True, same=False)
    """Run a synchronous save inside :func:`smpckpt.gc_frozen` (README, "Garbage collection")."""

    verify_replicas: bool = _opt(True)
    """Ranks holding the same piece of a tensor (replicas; a key two pipeline stages hold) must hold the
    same values (a 4-byte digest of 16 sampled elements), or the save fails on every rank naming keys
    and ranks: one replica is written, so a forgotten TP spec would lose data silently."""

    local_path: str | os.PathLike[str] | None = _opt(None, only=True, same=False)
    """This node's fast tier (node-local NVMe or ``/dev/shm``; each process passes its own node's folder,
    the same on every rank of a node). Every save commits to the fast tiers first, each rank's files also
    copied to ``replicas - 1`` other nodes over the process group; every ``durable_every``-th save is then
    copied from there to ``path`` in the background (README, "Tiered checkpoints"). The copies live in a
    folder of this ``path``'s own (``{local_path}/smpckpt-job-<hash of path>``): jobs sharing
    ``local_path`` never see each other's. ``None``: every save goes to ``path`` directly."""

    replicas: int = _opt(2, only=True)
    """With ``local_path``: copies of each rank's files in the fast tiers, each on a different node
    (``LOCAL_WORLD_SIZE`` ranks per node); at most the number of nodes."""

    durable_every: int = _opt(1, only=True)
    """With ``local_path``: every N-th save of the job (counted across restarts from the saves already in
    either tier) is also committed to ``path``, drained in the background from the fast tier's files. A
    drain that did not commit (a killed job) is retried by the next save that is not itself due."""

    num_kept_local: int | None = _opt(2, only=True)
    """With ``local_path``: keep the N newest checkpoints complete across the nodes' fast tiers (never the
    one a drain is copying, nor one due for ``path`` whose drain did not commit); ``None`` keeps all.
    ``num_kept_partial_checkpoints`` governs ``path``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        validate_keep(self.num_kept_partial_checkpoints)
        self._check_tiers()
        stale = self.remove_uncommitted_older_than
        # NaN passes "< 0" and is unequal to itself: every rank would then seem to pass another value
        if stale is not None and (
            isinstance(stale, bool) or not isinstance(stale, (int, float)) or math.isnan(stale) or stale < 0
        ):
            raise ValueError(f"remove_uncommitted_older_than must be seconds >= 0 or None, got {stale!r}")
        if self.partial:
            if self.format not in ("raw", "torch_save"):
                full = self.format == "safetensors"
                hint = " ('safetensors' is a format of full checkpoints, partial=False)" if full else ""
                raise ValueError(f"format must be 'raw' or 'torch_save', got {self.format!r}{hint}")
            return
        if self.format not in ("raw", "safetensors", "torch_save"):
            raise ValueError(
                f"with partial=False, format must be 'safetensors' (or 'raw') or 'torch_save', got {self.format!r}"
            )
        if self.dtype is not None and (not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point):
            raise ValueError(
                f"dtype must be a floating-point torch.dtype (it casts floating tensors), got {self.dtype!r}"
            )
        self.artifact()  # the artifact's own checks (max_shard_size...), once, here

    def _check_tiers(self) -> None:
        if self.local_path is None:
            tiered = [n for n in ("replicas", "durable_every", "num_kept_local") if n in self.given()]
            if tiered:
                raise ValueError(f"{', '.join(tiered)} apply only with local_path= (tiered checkpoints)")
            return
        check_int("replicas", self.replicas, minimum=1)
        check_int("durable_every", self.durable_every, minimum=1)
        validate_keep(self.num_kept_local, "num_kept_local")
        if self.overwrite:
            raise ValueError("overwrite does not apply with local_path= (a tiered save never replaces a tag)")

    def artifact(self, architecture: str | None = None) -> FullOptions:
        """The full artifact's layout (``partial=False``); ``architecture``: see :class:`FullOptions`."""
        return FullOptions(
            format="torch_save" if self.format == "torch_save" else "safetensors",
            max_shard_size=self.max_shard_size,
            dtype=self.dtype,
            artifacts=FULL_ARTIFACTS,
            translation=self.translate_function,
            hf_config=self.hf_config,
            architecture=architecture,
        )


@dataclasses.dataclass(frozen=True)
class ResumeOptions(_Options):
    """The options of :func:`~smpckpt.resume_from_checkpoint` (``freeze_gc`` as :class:`SaveOptions`)."""

    partial: bool = _opt(True)
    """``True``: a partial checkpoint ``{path}/{tag}_partial`` (``tag=None``: the one ``newest`` names).
    ``False``: a full one, ``{path}/{tag}/`` (``tag=None``: ``path`` itself), written by
    ``save_checkpoint(partial=False)`` or a plain Hugging Face folder (read unverified); optimizer tensor
    state is loaded when the artifact has it and ``optimizer`` is given; RNG is not restored and
    :func:`~smpckpt.last_resume_info` is not updated."""

    translate_function: Callable[[dict[str, Any]], dict[str, Any]] | Translation | None = _opt(None, same=False)
    """``partial=True``: ``state_dict -> state_dict`` applied to the loaded model state before it is set
    into ``model`` (Hugging Face <-> our names). ``partial=False``: a
    :class:`~smpckpt.model.translation.Translation` (``smpckpt.hf.gpt2.TRANSLATION``), applied box by box
    while reading."""

    missing_ok: bool = _opt(False, only=True)
    """Return ``None`` (start fresh) instead of raising :class:`~smpckpt.errors.CheckpointNotFound` when
    nothing committed exists."""

    strict: bool = _opt(True)
    """Refuse, before reading data, when model/optimizer keys are missing from the checkpoint or
    checkpoint keys would be left unloaded; ``False`` skips them (:attr:`ResumeInfo.skipped_keys`)."""

    load_rng: bool = _opt(True, only=True)
    """Restore the saved RNG states when the layout (and world size) is unchanged."""

    allow_pickle: bool = _opt(False)
    """Load stored objects (``user_content``) with arbitrary classes: trusted checkpoints only."""

    allow_dtype_cast: bool = _opt(False)
    """Convert tensors saved in another dtype instead of refusing."""

    keep_tied: Sequence[str] = _opt((), same=tuple)
    """Globs (``*`` crosses dots) of checkpoint keys, as the state dict names them (``model.`` first):
    when the model ties two keys (``lm_head.weight`` to the input embedding) that the checkpoint holds
    apart with different values -- a Hugging Face folder of an untied model, a partial checkpoint saved
    untied -- the load is refused naming both, unless one matches here: that one is loaded, the other
    ignored (``["model.lm_head.weight"]`` keeps the head, ``["*embed*"]`` the embedding). Values held
    apart but equal load without it."""

    verify_checksums: bool = _opt(True)
    """Check every byte read against its checksum."""

    freeze_gc: bool = _opt(True, same=False)
    """Run the load inside :func:`smpckpt.gc_frozen`."""

    local_path: str | os.PathLike[str] | None = _opt(None, only=True, same=False)
    """This node's fast tier, as given to :func:`~smpckpt.save_checkpoint`: the newest checkpoint complete
    and verified across the surviving fast tiers (parts a node lacks, or holds corrupt, fetched from peers)
    or in ``path``, whichever is newer, is loaded (:attr:`ResumeInfo.tier`); a fast-tier copy that cannot
    be loaded gives way to the next one, then to ``path``'s."""

    def __post_init__(self) -> None:
        super().__post_init__()
        tied = self.keep_tied
        if isinstance(tied, str) or not isinstance(tied, Sequence) or not all(isinstance(g, str) for g in tied):
            raise TypeError(f"keep_tied must be a list of key globs, got {tied!r}")
        object.__setattr__(self, "keep_tied", tuple(tied))
        if self.partial and self.translate_function is not None and not callable(self.translate_function):
            raise TypeError("translate_function must be callable (state_dict -> state_dict)")

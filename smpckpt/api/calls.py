"""smp-style checkpoint API: :func:`save_checkpoint` / :func:`resume_from_checkpoint` on top of DCP.

Folder structure under ``path`` (as SageMaker smp lays it out)::

    {path}/newest              # names the newest committed tag (rank 0 writes it, after the commit)
    {path}/{tag}_partial/      # a partial checkpoint: one committed smpckpt/DCP folder holding
                               #   model.*            model state (plain shards via ShardSpecs, DTensors)
                               #   optim.*            FQN-keyed optimizer state (inherits model specs)
                               #   rng.rank<r>.*      rank r's RNG states (rank-unique keys)
                               #   user_content       user_content: one torch.save record
                               #   smpckpt.manifest.json  commit marker; its "extra" holds the
                               #                      LayoutRecord (layout, specs) and the API record
                               #                      (tag, save time, user_content keys)

``user_content`` is stored *inside* the DCP checkpoint, as one ``torch.save`` record written by rank 0,
so it is checksummed and committed together with the tensors; it is serialised once on save and
loaded once, weights-only by default (``allow_pickle=True`` for trusted checkpoints holding arbitrary
objects).

The steps live in :mod:`smpckpt.api._save` and :mod:`smpckpt.api._resume`; this module only wires them.

Call order of :func:`save_checkpoint` (every rank calls it; "rank 0" = rank 0 of ``process_group``):

    1. (all)    arguments validated; tag/options/layout compared across ranks (mismatch: error on all)
    2. (all)    local state built (get_state_dict, RNG, user_content on rank 0); failure: error on all
    3. (all)    ``dcp.save`` with ParallelSavePlanner + FsspecStorageWriter; rank 0 commits the manifest
    4. (rank 0) ``newest`` := tag (only after the commit); its success/failure is broadcast
    5. (rank 0) retention: the oldest committed partial checkpoints beyond N are deleted (failures logged)

Call order of :func:`resume_from_checkpoint`:

    1. (all)    arguments compared across ranks
    2. (rank 0) the tag is resolved (``newest``, else the newest committed tag, with a warning) and its
                manifest read; the answer is broadcast (one reader, not N ranks listing S3)
    3. (all)    ``dcp.load`` in place with ParallelLoadPlanner (strict key checks before any data is read)
    4. (all)    set_state_dict, RNG restore (layout unchanged only), user_content decoded; failures on
                any rank raise on every rank
    5. (all)    :func:`last_resume_info` says which tag, fast path or reshard, and what was restored

Works the same without a process group (one process: a notebook, conversion scripts).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torch import nn

from smpckpt._checks import check_flag
from smpckpt._gc import gc_frozen
from smpckpt.api._args import check_partial, peer_failures
from smpckpt.api._async import async_used, check_previous, submit, wait_for_saves
from smpckpt.api._dist import DistContext
from smpckpt.api._full import resume_full, save_full
from smpckpt.api._resume import (
    ResumeInfo,
    apply_state,
    build_resume_state,
    choose_target,
    load_checkpoint,
    not_found_hint,
    resolve_resume,
    restores_rng,
    summarize,
)
from smpckpt.api._save import build_save_state, publish_newest, resolve_save, retain, write_checkpoint
from smpckpt.catalog.retention import validate_keep
from smpckpt.errors import CheckpointNotFound
from smpckpt.model.layout import ParallelLayout
from smpckpt.model.naming import NameMap
from smpckpt.model.specs import SpecLike, SpecRules
from smpckpt.model.translation import Translation

__all__ = ["save_checkpoint", "resume_from_checkpoint", "last_resume_info", "ResumeInfo"]

log = logging.getLogger("smpckpt.api")  # one logger for the API, whichever module logs

# Per thread (and per asyncio task): concurrent resumes in one process never see each other's report.
_last_resume: contextvars.ContextVar[ResumeInfo | None] = contextvars.ContextVar("smpckpt_last_resume", default=None)


def last_resume_info() -> ResumeInfo | None:
    """The :class:`ResumeInfo` of the last successful :func:`resume_from_checkpoint` in this thread."""
    return _last_resume.get()


def _shown(path: Any) -> str:
    """``path`` for an error message (validated later, so anything may arrive here)."""
    return os.fspath(path) if isinstance(path, (str, os.PathLike)) else repr(path)


# -- save ------------------------------------------------------------------------------------------
#: the options of full checkpoints only, and their defaults (a partial save given another value refuses it)
_FULL_ONLY = {
    "include_optimizer": False,
    "dtype": None,
    "hf_config": None,
    "translate_function": None,
    "max_shard_size": None,
}


def _check_save_options(partial: Any, flags: Mapping[str, Any], full_only: Mapping[str, Any], keep: Any) -> None:
    """Every rank, before anything runs: booleans are booleans, counts are counts, and an option that
    does not apply to the mode asked for is refused by name rather than silently ignored (``dtype=`` on
    a partial save would have written fp32 without a word). ``num_kept_partial_checkpoints`` is
    accepted (and checked) with ``partial=False``, as smp accepts it; it changes nothing there."""
    check_partial(partial)
    for name, value in flags.items():
        check_flag(name, value)
    validate_keep(keep)
    if partial:
        given = [name for name, value in full_only.items() if value is not _FULL_ONLY[name]]
        if given:
            raise ValueError(
                f"{', '.join(given)} apply to full checkpoints only (partial=False); a partial checkpoint stores "
                "every tensor as it is in memory"
            )
    dtype = full_only["dtype"]
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch.dtype (it casts floating tensors), got {dtype!r}")


def _frozen(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """``gc_frozen()`` when ``enabled`` (``freeze_gc``), else nothing."""
    return gc_frozen() if enabled else contextlib.nullcontext()


def save_checkpoint(
    path: str | os.PathLike[str],
    tag: str,
    partial: bool = True,
    model: nn.Module | None = None,
    optimizer: Any = None,
    user_content: Any = None,
    num_kept_partial_checkpoints: int | None = None,
    layout: ParallelLayout | None = None,
    specs: Mapping[str, SpecLike] | SpecRules | None = None,
    name_map: NameMap | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    process_group: Any = None,
    save_rng: bool = True,
    format: Literal["raw", "torch_save", "safetensors"] = "raw",
    sync_files: bool = True,
    remove_uncommitted_older_than: float | None = None,
    include_optimizer: bool = False,
    dtype: torch.dtype | None = None,
    hf_config: Any = None,
    translate_function: Translation | None = None,
    max_shard_size: int | str | None = None,
    async_save: bool = False,
    wait_for_previous: bool = True,
    freeze_gc: bool = True,
    verify_replicas: bool = True,
) -> concurrent.futures.Future[None] | None:
    """Save a partial checkpoint ``{path}/{tag}_partial`` and point ``{path}/newest`` at it; with
    ``partial=False``, one consolidated artifact ``{path}/{tag}/`` instead (see below).

    Every rank of ``process_group`` (default group; or the single process) must call it with the
    same ``path``, ``tag`` and options.

    Args:
        path: checkpoint root: a local path or any URL the storage supports (``s3://bucket/run``).
        tag: checkpoint name (validated: no ``/``, ``..``, control characters, not empty).
        partial: ``True``: every rank saves its own shards (resume under any layout). ``False``: a
            full checkpoint ``{path}/{tag}/``: every tensor full-size under its global name in
            ``model.safetensors`` (or ``model-0000i-of-0000N.safetensors`` + index above
            ``max_shard_size``), readable by ``safetensors``/``transformers`` without smpckpt;
            ``user_content`` beside it as ``user_content.pt``. Every rank writes its own shards at
            their offsets (no rank holds the whole model; on object stores each file is streamed by
            an owner rank that receives the others' shard bytes); committed by the same manifest.
            ``format="torch_save"`` writes ``torch.save`` files instead (``pytorch_model.bin``...).
            ``newest`` and retention ignore full checkpoints; RNG is not saved.
        model: a ``torch.nn.Module`` (plain, Megatron-style local shards with ``specs``, or
            DTensor/FSDP2 parameters); saved under ``model.<fqn>``.
        optimizer: an optimizer (or a sequence) over ``model``'s parameters; its state is saved
            FQN-keyed under ``optim.state.<param fqn>.<name>`` and inherits the parameter's spec.
        user_content: any picklable value (step counters, scheduler/dataloader state); rank 0's is
            saved. Values that weights-only loading rejects need ``allow_pickle=True`` on resume
            (a warning says so at save time).
        num_kept_partial_checkpoints: keep only the N newest committed partial checkpoints (N >= 1),
            deleting older ones after this one committed, on rank 0. ``None`` keeps all.
        layout: the parallel layout (default: pure data parallel over the world).
        specs: glob -> :class:`~smpckpt.ShardSpec` for plain sharded tensors, matched against keys
            such as ``model.layers.3.qkv.weight`` (first match wins, in mapping order).
        name_map: stage-local -> global key map for pipeline stages (sees ``model.*``/``optim.*`` keys).
        storage_options: fsspec options (S3: ``key``, ``secret``, ``client_kwargs``...).
        overwrite: replace an existing committed checkpoint with the same tag.
        process_group: the group that saves (default: the default group).
        save_rng: save every rank's RNG states (restored on resume under an unchanged layout).
        format: partial checkpoints: ``"raw"`` (fast, range-readable) or ``"torch_save"``
            (stock-DCP-readable). Full ones (``partial=False``): ``"safetensors"`` (default; ``"raw"``
            means the same) or ``"torch_save"``: each file is what ``torch.save`` writes for a flat
            ``{key: tensor}`` dict (``torch.load(f, weights_only=True)``, ``mmap=True`` too), named
            ``pytorch_model.bin`` (or ``pytorch_model-0000i-of-0000N.bin`` + index) and ``optimizer.bin``.
        sync_files: fsync data before the commit (keep ``True`` unless you accept losing a
            "committed" checkpoint to a power loss).
        include_optimizer: (``partial=False``) also write the optimizer's tensor state to
            ``optimizer.safetensors``, keyed ``<param fqn>.<name>`` (hyper-parameters are not saved).
        dtype: (``partial=False``) cast floating-point tensors on export (fp32 -> ``torch.bfloat16``);
            scalars (0-dim: optimizer step counters) keep their dtype.
        hf_config: (``partial=False``) a Hugging Face config written as ``config.json`` beside the
            weights, so ``AutoModelForCausalLM.from_pretrained(folder)`` opens the artifact.
        translate_function: (``partial=False``) a :class:`smpckpt.model.translation.Translation` such as
            ``smpckpt.hf.gpt2.TRANSLATION``: the artifact gets Hugging Face names and layouts.
        max_shard_size: (``partial=False``) bytes (or ``"5GB"``) per safetensors file; ``None``: see
            :class:`smpckpt.storage.FullOptions` (5 GB, fewer for multi-rank saves of large models).
        async_save: return as soon as the state is staged (copied into host buffers reused across
            saves; pinned for CUDA tensors), and write, commit, point ``newest`` and apply retention
            on a background thread with a gloo process group of its own. Returns a
            ``concurrent.futures.Future`` that completes only when all of that is durable; a failure
            is raised by the future and again by the next ``save_checkpoint`` call. One save is in
            flight at a time (see ``wait_for_previous``); :func:`smpckpt.wait_for_saves` (also run at
            exit) finishes it: call it before ``destroy_process_group()``, which a multi-rank save in
            flight still needs. A resume waits for it first. Partial checkpoints only.
        wait_for_previous: a save (sync or async) first waits for the background save in flight,
            logging how long; ``False`` raises :class:`CheckpointError` instead of waiting.
        freeze_gc: while a synchronous save runs, leave the objects the process already holds out of
            Python's cyclic garbage collections (``gc.freeze``, lifted at return): the collections a
            save of thousands of tensors sets off then walk only the save's own objects (README,
            "Garbage collection"). Skipped where the collector is off or the process froze objects
            itself; not applied to async saves.
        verify_replicas: ranks that hold the same piece of a tensor (replicas, and a global key two
            pipeline stages hold) must hold the same values, or the save fails on every rank naming
            the keys and ranks: only one replica is written, so a TP shard whose spec was forgotten, or
            a stage-local key not renumbered, would otherwise lose data silently. Each rank sends a
            4-byte digest of a 16-element sample per tensor. ``False`` for replicas meant to differ.
        remove_uncommitted_older_than: seconds; after the commit, rank 0 also removes uncommitted
            folders (debris of killed or failed saves) with no write for that long, and aborts S3
            multipart uploads under ``path`` started that long ago. Make it longer than any save
            (e.g. ``6 * 3600``). ``None`` (default) leaves them (``smpckpt prune`` can remove them).

    Raises:
        ValueError: an invalid tag or N, or arguments that differ between ranks.
        CheckpointExists: the tag exists and ``overwrite`` is false.
        CheckpointError: any other failure, on every rank (DCP's ``CheckpointException`` is the
            ``__cause__``).
    """
    _check_save_options(
        partial,
        dict(
            overwrite=overwrite,
            save_rng=save_rng,
            sync_files=sync_files,
            include_optimizer=include_optimizer,
            async_save=async_save,
            wait_for_previous=wait_for_previous,
            freeze_gc=freeze_gc,
            verify_replicas=verify_replicas,
        ),
        dict(
            include_optimizer=include_optimizer,
            dtype=dtype,
            hf_config=hf_config,
            translate_function=translate_function,
            max_shard_size=max_shard_size,
        ),
        num_kept_partial_checkpoints,
    )
    ctx = DistContext(process_group)
    if async_save or async_used():  # one collective more, only in jobs that save asynchronously
        with peer_failures(ctx, f"saving checkpoint {tag!r} under {_shown(path)}"):
            ctx.all_ok(lambda: check_previous(wait_for_previous))
    if async_save and partial is False:
        raise ValueError("async_save=True saves partial checkpoints; save full ones (partial=False) synchronously")
    if partial is False:
        with peer_failures(ctx, f"saving full checkpoint {tag!r} under {_shown(path)}"), _frozen(freeze_gc):
            save_full(
                ctx,
                path,
                tag,
                dict(
                    model=model,
                    optimizer=optimizer,
                    user_content=user_content,
                    layout=layout,
                    specs=specs,
                    name_map=name_map,
                    storage_options=storage_options,
                    process_group=process_group,
                    sync_files=sync_files,
                    include_optimizer=include_optimizer,
                    dtype=dtype,
                    hf_config=hf_config,
                    translate_function=translate_function,
                    max_shard_size=max_shard_size,
                    format=format,
                    verify_replicas=verify_replicas,
                ),
            )
        return None
    with peer_failures(ctx, f"saving checkpoint {tag!r} under {_shown(path)}"), _frozen(freeze_gc and not async_save):
        req = resolve_save(
            ctx,
            path,
            tag,
            partial,
            model=model,
            optimizer=optimizer,
            user_content=user_content,
            num_kept_partial_checkpoints=num_kept_partial_checkpoints,
            layout=layout,
            specs=specs,
            name_map=name_map,
            storage_options=storage_options,
            overwrite=overwrite,
            process_group=process_group,
            save_rng=save_rng,
            format=format,
            sync_files=sync_files,
            remove_uncommitted_older_than=remove_uncommitted_older_than,
            async_save=async_save,
            verify_replicas=verify_replicas,
        )
        started = time.monotonic()
        state, extra = ctx.all_ok(lambda: build_save_state(req, ctx))
        if async_save:

            def in_background(staged: dict[str, Any], group: Any) -> None:
                breq, bctx = dataclasses.replace(req, process_group=group), DistContext(group)
                with peer_failures(bctx, f"saving checkpoint {req.tag!r} under {req.root} in the background"):
                    write_checkpoint(breq, staged, extra)
                    publish_newest(breq, bctx)
                    log.info("saved checkpoint %s in the background", req.url)
                    retain(breq, bctx)

            return submit(req.tag, ctx, process_group, state, in_background)
        write_checkpoint(req, state, extra)
        publish_newest(req, ctx)
        log.info("saved checkpoint %s (%s) in %.2fs", req.url, req.layout, time.monotonic() - started)
        retain(req, ctx)
    return None


# -- resume ----------------------------------------------------------------------------------------
def resume_from_checkpoint(
    path: str | os.PathLike[str],
    tag: str | None = None,
    partial: bool = True,
    model: nn.Module | None = None,
    optimizer: Any = None,
    translate_function: Callable[[dict[str, Any]], dict[str, Any]] | Translation | None = None,
    layout: ParallelLayout | None = None,
    specs: Mapping[str, SpecLike] | SpecRules | None = None,
    name_map: NameMap | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
    missing_ok: bool = False,
    strict: bool = True,
    process_group: Any = None,
    load_rng: bool = True,
    allow_pickle: bool = False,
    allow_dtype_cast: bool = False,
    verify_checksums: bool = True,
    freeze_gc: bool = True,
) -> Any:
    """Load ``{path}/{tag}_partial`` (``newest`` when ``tag`` is None) into ``model``/``optimizer``
    in place, under the current ``layout`` (resharding when it differs), and return its ``user_content``.

    Every rank of ``process_group`` calls it with the same arguments. With ``tag=None``: if ``newest``
    is missing, unreadable or names a checkpoint without a commit marker, the newest committed
    checkpoint is used instead (a warning on rank 0; :attr:`ResumeInfo.fell_back`). Nothing committed:
    :class:`~smpckpt.errors.CheckpointNotFound`, or ``None`` with ``missing_ok=True`` (start fresh).

    RNG states (torch, CUDA, python, numpy) are restored when the saved layout equals ``layout``;
    after a layout change they are not (a warning; each rank keeps its current generators).

    Args:
        partial: ``False`` loads a full checkpoint: ``{path}/{tag}/`` (``tag=None``: ``path`` itself),
            written by ``save_checkpoint(partial=False)`` or a plain Hugging Face folder
            (``model.safetensors`` or index + shards; read unverified). Each rank reads only its own
            shards' bytes. Optimizer tensor state is loaded when the artifact has it and ``optimizer``
            is given; RNG is not restored; :func:`last_resume_info` is not updated.
        translate_function: ``state_dict -> state_dict`` applied to the loaded model state before it
            is set into ``model`` (e.g. an HF <-> smp key/format translation). With ``partial=False``
            it must be a :class:`smpckpt.model.translation.Translation` (``smpckpt.hf.gpt2.TRANSLATION``),
            applied box by box while reading.
        strict: refuse (before reading data) when model/optimizer keys are missing from the
            checkpoint or checkpoint keys would be left unloaded; ``False`` skips them
            (listed in :attr:`ResumeInfo.skipped_keys`).
        allow_pickle: load stored objects (``user_content``) with arbitrary classes: trusted
            checkpoints only.
        allow_dtype_cast: convert tensors saved in another dtype instead of refusing.
        Other arguments (``freeze_gc`` too: for the whole load) as for :func:`save_checkpoint`.
    """
    for name, value in (
        ("missing_ok", missing_ok),
        ("strict", strict),
        ("load_rng", load_rng),
        ("allow_pickle", allow_pickle),
        ("allow_dtype_cast", allow_dtype_cast),
        ("verify_checksums", verify_checksums),
        ("freeze_gc", freeze_gc),
    ):
        check_flag(name, value)
    ctx = DistContext(process_group)
    if async_used():
        # this process's background save may be committing, updating newest or removing the checkpoint
        # retention would pick: resume from what it leaves (its failure stays for the next save to raise)
        wait_for_saves(raise_errors=False)
    if partial is False:
        with peer_failures(ctx, f"loading full checkpoint from {_shown(path)}"), _frozen(freeze_gc):
            return resume_full(
                ctx,
                path,
                tag,
                dict(
                    model=model,
                    optimizer=optimizer,
                    translate_function=translate_function,
                    layout=layout,
                    specs=specs,
                    name_map=name_map,
                    storage_options=storage_options,
                    strict=strict,
                    process_group=process_group,
                    allow_pickle=allow_pickle,
                    allow_dtype_cast=allow_dtype_cast,
                    verify_checksums=verify_checksums,
                ),
            )
    with peer_failures(ctx, f"resuming from {_shown(path)}"), _frozen(freeze_gc):
        req = resolve_resume(
            ctx,
            path,
            tag,
            partial,
            model=model,
            optimizer=optimizer,
            translate_function=translate_function,
            layout=layout,
            specs=specs,
            name_map=name_map,
            storage_options=storage_options,
            missing_ok=missing_ok,
            strict=strict,
            process_group=process_group,
            load_rng=load_rng,
            allow_pickle=allow_pickle,
            allow_dtype_cast=allow_dtype_cast,
            verify_checksums=verify_checksums,
        )
        target = choose_target(req, ctx)
        if target is None:
            if req.missing_ok:
                log.info("no committed checkpoint under %s: starting fresh (missing_ok=True)", req.root)
                return None
            what = f"checkpoint {req.tag!r}" if req.tag is not None else "committed checkpoint"
            hint = ctx.on_coordinator(lambda: not_found_hint(req.root, req.storage_options)) if req.tag is None else ""
            raise CheckpointNotFound(f"no {what} under {req.root}{hint}")
        rng = restores_rng(req, target, ctx)
        state = ctx.all_ok(lambda: build_resume_state(req, ctx, rng))
        planner = load_checkpoint(req, target, state)
        user_content, restored = ctx.all_ok(lambda: apply_state(req, target, ctx, state, planner.report, rng))
        _last_resume.set(summarize(req, target, ctx, planner, restored))
        return user_content

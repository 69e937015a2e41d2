"""smp-style checkpoint API: :func:`save_checkpoint` / :func:`resume_from_checkpoint` on top of DCP.

Folder structure under ``path`` (as SageMaker smp lays it out)::

    {path}/newest              # names the newest committed tag (rank 0 writes it, after the commit)
    {path}/{tag}_partial/      # a partial checkpoint: one committed smpckpt/DCP folder holding
                               #   model.*            model state (plain shards via ShardSpecs, DTensors)
                               #   optim.*            FQN-keyed optimizer state (inherits model specs)
                               #   rng.rank<r>.*      rank r's RNG states (rank-unique keys)
                               #   user_content       torch.save bytes of user_content (one object)
                               #   smpckpt.manifest.json  commit marker; its "extra" records layout,
                               #                      specs, tag, save time, world size, user_content keys

``user_content`` is stored *inside* the DCP checkpoint, as one object (``torch.save`` bytes written by
rank 0), so it is checksummed and committed together with the tensors; it is loaded weights-only by
default (pass ``allow_pickle=True`` for trusted checkpoints holding arbitrary objects).

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

import dataclasses
import datetime
import logging
import os
import re
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

import smpckpt
from smpckpt._args import (
    OPTIONS,
    RANK_LOCAL,
    USER_CONTENT,
    check_model,
    check_partial,
    encode_user_content,
    optimizers as as_optimizers,
    peer_failures,
    quiet_no_dist,
    resolve_layout,
    root_url,
    spec_rules,
    train_state,
    translate_dcp,
    wrap_name_map,
)
from smpckpt._dist import DistContext
from smpckpt._resume import ApiLoadPlanner, decode_user_content, resolve_target, saved_layout as read_saved_layout
from smpckpt.catalog import API_RECORD
from smpckpt.errors import CheckpointError, CheckpointNotFound
from smpckpt.layout import ParallelLayout
from smpckpt.naming import NameMap
from smpckpt.planners import ParallelSavePlanner
from smpckpt.retention import apply_retention, validate_keep
from smpckpt.rng import get_rng_state, set_rng_state
from smpckpt.specs import SpecLike, SpecRules
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter
from smpckpt.tags import open_root, partial_url, validate_tag, write_newest

__all__ = ["save_checkpoint", "resume_from_checkpoint", "last_resume_info", "ResumeInfo"]

log = logging.getLogger(__name__)


# -- resume report ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ResumeInfo:
    """What the last :func:`resume_from_checkpoint` in this process did (same on every rank).

    ``path_taken`` is ``"fast"`` when every rank's pieces matched saved chunks exactly (same
    partition), ``"reshard"`` when some rank assembled tensors from overlapping saved chunks.
    RNG states are restored only when the layout (and world size) is unchanged; otherwise
    ``rng_restored`` is empty and a warning was issued: RNG streams do not map across layouts.
    """

    path: str  #: checkpoint root
    tag: str
    checkpoint_url: str
    path_taken: Literal["fast", "reshard"]
    layout: ParallelLayout
    saved_layout: ParallelLayout | None
    layout_changed: bool
    fast_path_tensors: int  #: summed over ranks
    resharded_tensors: int  #: summed over ranks
    rng_restored: tuple[str, ...]  #: generators restored on this rank ("torch", "python", ...)
    fell_back: bool  #: ``newest`` was unusable and the newest committed tag was used instead
    skipped_keys: tuple[str, ...] = ()  #: keys not loaded (``strict=False`` only)

    @property
    def resharded(self) -> bool:
        return self.path_taken == "reshard"


_LAST_RESUME: ResumeInfo | None = None


def last_resume_info() -> ResumeInfo | None:
    """The :class:`ResumeInfo` of the last successful :func:`resume_from_checkpoint` in this process."""
    return _LAST_RESUME


# -- save ------------------------------------------------------------------------------------------
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
    format: Literal["raw", "torch_save"] = "raw",
    sync_files: bool = True,
    remove_uncommitted_older_than: float | None = None,
) -> None:
    """Save a partial checkpoint ``{path}/{tag}_partial`` and point ``{path}/newest`` at it.

    Every rank of ``process_group`` (default group; or the single process) must call it with the
    same ``path``, ``tag`` and options.

    Args:
        path: checkpoint root: a local path or any URL the storage supports (``s3://bucket/run``).
        tag: checkpoint name (validated: no ``/``, ``..``, control characters, not empty).
        partial: must be ``True``; full-gather checkpoints are a later feature.
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
        format: ``"raw"`` (fast, range-readable) or ``"torch_save"`` (stock-DCP-readable).
        sync_files: fsync data before the commit (keep ``True`` unless you accept losing a
            "committed" checkpoint to a power loss).
        remove_uncommitted_older_than: seconds; after the commit, rank 0 also removes uncommitted
            folders (debris of killed or failed saves) with no write for that long, and aborts S3
            multipart uploads under ``path`` started that long ago. Make it longer than any save
            (e.g. ``6 * 3600``). ``None`` (default) leaves them (``smpckpt prune`` can remove them).

    Raises:
        NotImplementedError: ``partial=False``.
        ValueError: an invalid tag or N, or arguments that differ between ranks.
        CheckpointExists: the tag exists and ``overwrite`` is false.
        CheckpointError: any other failure, on every rank (DCP's ``CheckpointException`` is the
            ``__cause__``).
    """
    check_partial(partial)
    root = root_url(path)
    keep = validate_keep(num_kept_partial_checkpoints)
    if remove_uncommitted_older_than is not None and not (
        isinstance(remove_uncommitted_older_than, (int, float)) and remove_uncommitted_older_than >= 0
    ):
        raise ValueError(
            f"remove_uncommitted_older_than must be seconds >= 0 or None, got {remove_uncommitted_older_than!r}"
        )
    optimizers = as_optimizers(optimizer)
    check_model(model, optimizers)
    rules = spec_rules(specs)
    if format not in ("raw", "torch_save"):
        raise ValueError(f"format must be 'raw' or 'torch_save', got {format!r}")
    ctx = DistContext(process_group)
    with peer_failures(ctx, f"saving checkpoint {tag!r} under {root}"):
        layout = resolve_layout(layout, ctx)
        # Compare before validating: a tag bad on one rank only must fail every rank, not hang the others.
        ctx.check_identical(
            (tag, root, keep, bool(overwrite), format, layout.to_dict(), bool(save_rng), remove_uncommitted_older_than),
            "save_checkpoint(path, tag, num_kept_partial_checkpoints, overwrite, format, layout, save_rng, "
            "remove_uncommitted_older_than)",
        )
        validate_tag(tag)
        url = partial_url(root, tag)

        def build() -> tuple[dict[str, Any], dict[str, Any]]:
            state = train_state(model, optimizers)
            if save_rng:
                state["rng"] = {f"rank{ctx.rank}": get_rng_state()}
            extra: dict[str, Any] = {}
            if ctx.is_coordinator:
                payload = encode_user_content(user_content)
                state[USER_CONTENT] = payload
                now = time.time_ns()
                extra = {
                    "api": API_RECORD,
                    "tag": tag,
                    "saved_at_ns": now,
                    "saved_at": datetime.datetime.fromtimestamp(now / 1e9, datetime.timezone.utc).isoformat(),
                    "layout": layout.to_dict(),
                    "specs": rules.to_records(),
                    "name_map": name_map is not None,
                    "world_size": ctx.world_size,
                    "rank_local": list(RANK_LOCAL),
                    "parts": sorted(k for k in ("model", "optim", "rng") if k in state),
                    "rng": bool(save_rng),
                    "user_content_type": type(user_content).__name__,
                    "user_content_keys": [str(k) for k in user_content] if isinstance(user_content, Mapping) else None,
                    "smpckpt_version": smpckpt.__version__,
                    "torch_version": torch.__version__,
                }
            return state, extra

        state, extra = ctx.all_ok(build)
        writer = FsspecStorageWriter(
            url, storage_options=storage_options, overwrite=overwrite, manifest_extra=extra, format=format,
            sync_files=sync_files,
        )
        planner = ParallelSavePlanner(
            layout, rules, name_map=wrap_name_map(name_map), process_group=process_group,
            rank_local=RANK_LOCAL, enable_plan_caching=False,
        )
        started = time.monotonic()
        try:
            with quiet_no_dist():
                dcp.save(state, storage_writer=writer, planner=planner, process_group=process_group)
        except CheckpointException as exc:
            raise translate_dcp(exc, f"saving checkpoint {url}") from exc

        # The checkpoint is committed on every rank's word (dcp.save returns only after the coordinator's
        # finish succeeded). Only now may `newest` move.
        def point_newest() -> None:
            fs, root_path = open_root(root, storage_options)
            write_newest(fs, root_path, tag, sync=sync_files)

        try:
            ctx.on_coordinator(point_newest)
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint {url} is committed but {root}/newest could not be updated: {exc}"
            ) from exc
        log.info("saved checkpoint %s (%s) in %.2fs", url, layout, time.monotonic() - started)

        # Retention runs on rank 0 only, after the broadcast above, so the other ranks go on training.
        if (keep is not None or remove_uncommitted_older_than is not None) and ctx.is_coordinator:
            try:
                result = apply_retention(
                    root, keep, storage_options=storage_options, protected={tag},
                    uncommitted_older_than=remove_uncommitted_older_than,
                )
                if result.removed:
                    log.info("retention kept %d checkpoint(s); removed %s", keep, list(result.removed))
                if result.removed_uncommitted or result.aborted_uploads:
                    log.info(
                        "removed stale uncommitted folders %s and aborted %d multipart upload(s)",
                        list(result.removed_uncommitted), len(result.aborted_uploads),
                    )
            except Exception as exc:  # noqa: BLE001 - retention never fails a committed save
                log.warning("retention after saving %s failed (nothing else affected): %s", url, exc)


# -- resume ----------------------------------------------------------------------------------------
def resume_from_checkpoint(
    path: str | os.PathLike[str],
    tag: str | None = None,
    partial: bool = True,
    model: nn.Module | None = None,
    optimizer: Any = None,
    translate_function: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
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
        translate_function: ``state_dict -> state_dict`` applied to the loaded model state before it
            is set into ``model`` (e.g. an HF <-> smp key/format translation).
        strict: refuse (before reading data) when model/optimizer keys are missing from the
            checkpoint or checkpoint keys would be left unloaded; ``False`` skips them
            (listed in :attr:`ResumeInfo.skipped_keys`).
        allow_pickle: load stored objects (``user_content``) with arbitrary classes: trusted
            checkpoints only.
        allow_dtype_cast: convert tensors saved in another dtype instead of refusing.
        Other arguments as for :func:`save_checkpoint`.
    """
    check_partial(partial)
    root = root_url(path)
    optimizers = as_optimizers(optimizer)
    check_model(model, optimizers)
    rules = spec_rules(specs)
    if translate_function is not None and not callable(translate_function):
        raise TypeError("translate_function must be callable (state_dict -> state_dict)")
    ctx = DistContext(process_group)
    global _LAST_RESUME
    with peer_failures(ctx, f"resuming from {root}"):
        layout = resolve_layout(layout, ctx)
        ctx.check_identical(
            (tag, root, bool(strict), bool(missing_ok), layout.to_dict(), bool(load_rng)),
            "resume_from_checkpoint(path, tag, strict, missing_ok, layout, load_rng)",
        )
        if tag is not None:
            validate_tag(tag)

        target = ctx.on_coordinator(lambda: resolve_target(root, tag, storage_options))
        if target is None:
            if missing_ok:
                log.info("no committed checkpoint under %s: starting fresh (missing_ok=True)", root)
                return None
            what = f"checkpoint {tag!r}" if tag is not None else "committed checkpoint"
            raise CheckpointNotFound(f"no {what} under {root}")

        saved_layout = read_saved_layout(target.extra)
        same_layout = (
            saved_layout is not None and saved_layout == layout and target.extra.get("world_size") == ctx.world_size
        )
        restore_rng = load_rng and same_layout and bool(target.extra.get("rng"))
        if load_rng and target.extra.get("rng") and not same_layout and ctx.is_coordinator:
            warnings.warn(
                f"the layout changed ({saved_layout} -> {layout}): RNG states are not restored (they do not map "
                "across layouts); every rank keeps its current generators",
                stacklevel=2,
            )

        def build() -> dict[str, Any]:
            state = train_state(model, optimizers)
            state[USER_CONTENT] = b""  # placeholder; the load puts the stored object here
            if restore_rng:
                state["rng"] = {f"rank{ctx.rank}": get_rng_state()}
            return state

        state = ctx.all_ok(build)
        ignore = [r"rng\..*"]
        if model is None:
            ignore.append(r"model\..*")
        if not optimizers:
            ignore.append(r"optim\..*")
        planner = ApiLoadPlanner(
            layout, rules, name_map=wrap_name_map(name_map), process_group=process_group, rank_local=RANK_LOCAL,
            allow_dtype_cast=allow_dtype_cast, allow_pickle=allow_pickle, strict=strict,
            ignore_unexpected=re.compile("|".join(f"(?:{p})$" for p in ignore)),
        )
        reader = FsspecStorageReader(
            target.url, storage_options=storage_options, verify_checksums=verify_checksums, allow_pickle=allow_pickle
        )
        try:
            with quiet_no_dist():
                dcp.load(state, storage_reader=reader, planner=planner, process_group=process_group)
        except CheckpointException as exc:
            raise translate_dcp(exc, f"loading checkpoint {target.url}", metadata_error=reader.metadata_error) from exc

        report = planner.report
        missing = set(report.missing_keys if report else ())

        def apply() -> tuple[Any, tuple[str, ...]]:
            if model is not None:
                model_sd = state["model"]
                if translate_function is not None:
                    model_sd = translate_function(model_sd)
                    if not isinstance(model_sd, Mapping):
                        raise TypeError(f"translate_function returned {type(model_sd).__name__}, not a state dict")
                opts = dataclasses.replace(OPTIONS, strict=strict)
                if optimizers:
                    set_state_dict(
                        model, optimizers, model_state_dict=model_sd, optim_state_dict=state["optim"], options=opts
                    )
                else:
                    set_model_state_dict(model, model_sd, options=opts)
            restored: tuple[str, ...] = ()
            if restore_rng:
                mine = f"rng.rank{ctx.rank}."
                complete = tuple(
                    c for c in state["rng"][f"rank{ctx.rank}"] if not any(k.startswith(f"{mine}{c}") for k in missing)
                )
                restored = set_rng_state(state["rng"][f"rank{ctx.rank}"], complete)
            return decode_user_content(state[USER_CONTENT], USER_CONTENT in missing, allow_pickle), restored

        user_content, restored = ctx.all_ok(apply)
        counts = ctx.all_gather_object(
            (report.fast_path if report else 0, len(report.resharded) if report else 0, planner.real_missing)
        )
        fast = sum(c[0] for c in counts)
        resharded = sum(c[1] for c in counts)
        skipped = sorted({k for c in counts for k in c[2]} | set(ctx.broadcast_object(planner.real_unexpected)))
        info = ResumeInfo(
            path=root, tag=target.tag, checkpoint_url=target.url, path_taken="reshard" if resharded else "fast",
            layout=layout, saved_layout=saved_layout, layout_changed=not same_layout, fast_path_tensors=fast,
            resharded_tensors=resharded, rng_restored=restored, fell_back=target.fell_back, skipped_keys=tuple(skipped),
        )
        _LAST_RESUME = info
        if info.resharded:
            log.info(
                "resumed %s: resharded %d tensor(s) from %s to %s (fast path for %d)",
                target.url, resharded, saved_layout, layout, fast,
            )
        else:
            log.info("resumed %s: fast path for all %d tensor(s) (%s)", target.url, fast, layout)
        return user_content

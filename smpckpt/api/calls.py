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

``user_content`` is stored inside the checkpoint (one ``torch.save`` record by rank 0: checksummed and
committed with the tensors; loaded once, weights-only unless ``allow_pickle=True``).

Both calls first validate their options (:mod:`smpckpt.api.options`) and compare them, the tag, path
and layout across ranks (``_agreed``); the steps that follow live in :mod:`smpckpt.api._save`,
:mod:`smpckpt.api._resume` and :mod:`smpckpt.api._full` (each says which rank does what), and this
module only wires them. Works the same without a process group.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import dataclasses
import logging
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from smpckpt._gc import gc_frozen
from smpckpt.api._args import CommonRequest, peer_failures, resolve_common
from smpckpt.api._async import async_used, check_previous, submit, submit_drain, wait_for_saves
from smpckpt.api._dist import DistContext
from smpckpt.api._drain import drain
from smpckpt.api._fast_resume import choose_tier, load_tiered
from smpckpt.api._fast_save import TierPlan, hold_for_drain, plan_tier_save, release_hold, save_fast
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
from smpckpt.api._save import SaveRequest, build_save_state, publish_newest, resolve_save, retain, write_checkpoint
from smpckpt.api.options import ResumeOptions, SaveOptions
from smpckpt.catalog.tags import partial_url
from smpckpt.errors import CheckpointNotFound
from smpckpt.model.layout import ParallelLayout
from smpckpt.model.naming import NameMap
from smpckpt.model.specs import SpecLike, SpecRules
from smpckpt.model.translation import Translation
from smpckpt.storage.tier import PeerFetchingReader

__all__ = ["save_checkpoint", "resume_from_checkpoint", "last_resume_info", "ResumeInfo"]

log = logging.getLogger("smpckpt.api")  # one logger for the API, whichever module logs

# Per thread (and per asyncio task): concurrent resumes in one process never see each other's report.
_last_resume: contextvars.ContextVar[ResumeInfo | None] = contextvars.ContextVar("smpckpt_last_resume", default=None)

_O = TypeVar("_O", SaveOptions, ResumeOptions)


def last_resume_info() -> ResumeInfo | None:
    """The :class:`ResumeInfo` of the last successful :func:`resume_from_checkpoint` in this thread."""
    return _last_resume.get()


def _shown(path: Any) -> str:
    """``path`` for an error message (validated later, so anything may arrive here)."""
    return os.fspath(path) if isinstance(path, (str, os.PathLike)) else repr(path)


def _agreed(ctx: DistContext, cls: type[_O], args: dict[str, Any], what: str) -> tuple[CommonRequest, _O]:
    """(all ranks) Validate a call's arguments (``args``: its parameters by name): the options ``options=``
    gives (then no option keyword may differ from its default) or the option keywords build, and the
    arguments both calls share; then compare across ranks the tag, path, layout and the options'
    :meth:`~smpckpt.api.options.SaveOptions.compared` fields (by :meth:`DistContext.agreed`, before the tag
    is validated: a tag bad on one rank only must fail every rank, not hang the others)."""

    def validated() -> tuple[tuple[CommonRequest, _O], dict[str, Any]]:
        keywords, opts = cls(**{f.name: args[f.name] for f in dataclasses.fields(cls)}), args["options"]
        if opts is None:
            opts = keywords
        elif not isinstance(opts, cls):
            raise TypeError(f"options must be a {cls.__name__}, got {type(opts).__name__}")
        elif keywords.given():
            raise ValueError(f"{', '.join(keywords.given())}: pass options as keywords or as options=, not both")
        common = resolve_common(ctx, args)
        shared = {"tag": args["tag"], "path": common.root, "layout": common.layout.to_dict(), **opts.compared()}
        return (common, opts), shared

    return ctx.agreed(validated, what)


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
    local_path: str | os.PathLike[str] | None = None,
    replicas: int = 2,
    durable_every: int = 1,
    num_kept_local: int | None = 2,
    options: SaveOptions | None = None,
) -> concurrent.futures.Future[None] | None:
    """Save a partial checkpoint ``{path}/{tag}_partial`` and point ``{path}/newest`` at it; with
    ``partial=False``, one full artifact ``{path}/{tag}/`` instead. Every rank of ``process_group`` (or
    the single process) calls it with the same ``path``, ``tag``, layout and options (compared: a
    mismatch is a :class:`ValueError` on every rank naming what differs). ``tag``: letters, digits and
    ``. _ - + = @ ,`` (validated up front). ``user_content``: any picklable value, rank 0's is saved
    (values that weights-only loading rejects need ``allow_pickle=True`` on resume: a warning says so).
    With ``async_save=True`` returns a ``concurrent.futures.Future`` that completes when the save is
    durable; else ``None``. With ``local_path=`` the save is tiered: committed to every node's fast tier
    (with replicas on other nodes), every ``durable_every``-th one drained to ``path`` in the background
    (README, "Tiered checkpoints"; an async save's future completes when the fast tier is committed).

    Args:
        path: checkpoint root: a local path or any URL the storage supports (``s3://bucket/run``).
        model: a ``torch.nn.Module`` (plain, Megatron-style local shards with ``specs``, or
            DTensor/FSDP2 parameters); its state is stored under ``model.<fqn>``.
        optimizer: an optimizer (or a sequence) over ``model``'s parameters; its state is stored
            FQN-keyed under ``optim.state.<param fqn>.<name>`` and inherits the parameter's spec.
        layout: the parallel layout (default: pure data parallel over the world).
        specs: glob -> :class:`~smpckpt.ShardSpec` for plain sharded tensors, matched against keys
            such as ``model.layers.3.qkv.weight`` or the model's own names (first match wins).
        name_map: stage-local -> global key map for pipeline stages (sees ``model.*``/``optim.*`` keys).
        storage_options: fsspec options (S3: ``key``, ``secret``, ``client_kwargs``...).
        process_group: the group that saves (default: the default group).
        options: a :class:`SaveOptions` instead of the option keywords (not both). Every other keyword
            is the field of the same name of :class:`SaveOptions`, documented there; one that does not
            apply to the mode (``partial``) raises :class:`ValueError` naming it.

    Raises:
        ValueError: an invalid tag or option, or arguments that differ between ranks.
        CheckpointExists: the tag exists and ``overwrite`` is false.
        CheckpointError: any other failure, on every rank (DCP's ``CheckpointException`` is the
            ``__cause__``).
    """
    args, ctx = dict(locals()), DistContext(process_group)  # the parameters by name: nothing else is bound yet
    with peer_failures(ctx, f"saving checkpoint {tag!r} under {_shown(path)}"):
        common, opts = _agreed(ctx, SaveOptions, args, "save_checkpoint's arguments")
    action = f"saving {'' if opts.partial else 'full '}checkpoint {tag!r} under {_shown(path)}"
    if opts.async_save or async_used():  # one collective more, only in jobs that save asynchronously
        with peer_failures(ctx, action):
            ctx.all_ok(lambda: check_previous(opts.wait_for_previous))
    with peer_failures(ctx, action), _frozen(opts.freeze_gc and not opts.async_save):
        if not opts.partial:
            save_full(ctx, common, tag, opts, user_content)
            return None
        req = resolve_save(common, tag, opts, user_content)
        tier = plan_tier_save(req, ctx) if opts.local_path is not None else None
        started = time.monotonic()
        state, extra = ctx.all_ok(lambda: build_save_state(req, ctx))

        def save(sreq: SaveRequest, staged: dict[str, Any], how: str) -> None:
            """Write, commit, point ``newest``, retain on ``sreq.process_group`` (or the tiered save)."""
            if tier is not None:
                _save_tiered(sreq, staged, extra, tier)
                return
            sctx = DistContext(sreq.process_group)
            write_checkpoint(sreq, staged, extra)
            publish_newest(sreq, sctx)
            log.info("saved checkpoint %s (%s) %s", req.url, req.layout, how)
            retain(sreq, sctx)

        if opts.async_save:

            def in_background(staged: dict[str, Any], group: Any) -> None:
                with peer_failures(
                    DistContext(group), f"saving checkpoint {req.tag!r} under {req.root} in the background"
                ):
                    save(dataclasses.replace(req, process_group=group), staged, "in the background")

            return submit(req.tag, ctx, process_group, state, in_background)
        save(req, state, f"in {time.monotonic() - started:.2f}s")
    return None


def _save_tiered(req: SaveRequest, state: dict[str, Any], extra: dict[str, Any], tier: TierPlan) -> None:
    """(all ranks) The fast tiers, then (every ``durable_every``-th save, or a save whose drain never
    committed) the drain, in the background."""
    started = time.monotonic()
    prepared = save_fast(req, state, extra, tier)
    log.info(
        "saved checkpoint %r to the fast tier %s (save %d, %d replica(s)) in %.2fs%s; phases: %s",
        req.tag,
        tier.local_path,
        tier.seq,
        tier.replicas,
        time.monotonic() - started,
        f"; draining to {req.url}" if tier.durable else "",
        ", ".join(f"{name} {s:.3f}s" for name, s in tier.phases.items()),
    )
    if tier.durable:
        hold_for_drain(tier.job, req.tag)

        def work() -> None:
            try:
                with peer_failures(DistContext(tier.drain_group), f"draining checkpoint {req.tag!r} to {req.url}"):
                    drain(req, tier, prepared)
            finally:
                release_hold(tier.job, req.tag)

        submit_drain(req.tag, work)
    elif tier.retry is not None:
        retry = tier.retry
        rreq = dataclasses.replace(req, tag=retry.tag, url=partial_url(req.root, retry.tag))
        if DistContext(req.process_group).is_coordinator:
            message = (
                f"checkpoint {retry.tag!r} (save {retry.seq}) was due for the durable tier and its drain never "
                f"committed (a job stopped while draining?): draining it to {rreq.url} again, in the background"
            )
            log.warning(message)
            warnings.warn(message, stacklevel=4)
        hold_for_drain(tier.job, retry.tag)

        def again() -> None:
            try:
                with peer_failures(DistContext(tier.drain_group), f"draining checkpoint {retry.tag!r} to {rreq.url}"):
                    drain(rreq, tier, retry.prepared, seq=retry.seq, held_by=retry.held_by)
            finally:
                release_hold(tier.job, retry.tag)

        submit_drain(retry.tag, again)


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
    local_path: str | os.PathLike[str] | None = None,
    keep_tied: Sequence[str] = (),
    options: ResumeOptions | None = None,
) -> Any:
    """Load ``{path}/{tag}_partial`` (``newest`` when ``tag`` is None) into ``model``/``optimizer``
    in place, under the current ``layout`` (resharding when it differs), and return its ``user_content``.

    Every rank of ``process_group`` calls it with the same arguments. With ``tag=None``: if ``newest``
    is missing, unreadable or names a checkpoint without a commit marker, the newest committed
    checkpoint is used instead (a warning on rank 0; :attr:`ResumeInfo.fell_back`). Nothing committed:
    :class:`~smpckpt.errors.CheckpointNotFound`, or ``None`` with ``missing_ok=True`` (start fresh).
    RNG states (torch, CUDA, python, numpy) are restored when the saved layout equals ``layout``;
    after a layout change they are not (a warning; each rank keeps its current generators).

    The arguments are :func:`save_checkpoint`'s; the option keywords (or ``options=``) are the fields of
    :class:`ResumeOptions`, documented there.
    """
    args, ctx = dict(locals()), DistContext(process_group)  # the parameters by name: nothing else is bound yet
    if async_used():
        # this process's background save may be committing, updating newest or removing the checkpoint
        # retention would pick: resume from what it leaves (its failure stays for the next save to raise)
        wait_for_saves(raise_errors=False)
    with peer_failures(ctx, f"resuming from {_shown(path)}"):
        common, opts = _agreed(ctx, ResumeOptions, args, "resume_from_checkpoint's arguments")
    action = f"{'resuming' if opts.partial else 'loading full checkpoint'} from {_shown(path)}"
    with peer_failures(ctx, action), _frozen(opts.freeze_gc):
        if not opts.partial:
            return resume_full(ctx, common, tag, opts)
        req = resolve_resume(common, tag, opts)
        reader: PeerFetchingReader | None = None
        if opts.local_path is not None:
            loaded = load_tiered(req, ctx, choose_tier(req, ctx))
            target = loaded.target if loaded is not None else None
        else:
            target = choose_target(req, ctx)
        if target is None:
            if opts.missing_ok:
                log.info("no committed checkpoint under %s: starting fresh (missing_ok=True)", req.root)
                return None
            what = f"checkpoint {req.tag!r}" if req.tag is not None else "committed checkpoint"
            hint = ctx.on_coordinator(lambda: not_found_hint(req.root, req.storage_options)) if req.tag is None else ""
            raise CheckpointNotFound(f"no {what} under {req.root}{hint}")
        if opts.local_path is not None and loaded is not None:
            rng, state, planner, reader = loaded.rng, loaded.state, loaded.planner, loaded.reader
        else:
            rng = restores_rng(req, target, ctx)
            state = ctx.all_ok(lambda: build_resume_state(req, ctx, rng))
            planner = load_checkpoint(req, req.opts, target.url, state)
        chosen = target
        user_content, restored = ctx.all_ok(lambda: apply_state(req, chosen, ctx, state, planner.report, rng))
        info = summarize(req, target, ctx, planner, restored)
        if reader is not None:
            peers = tuple((t.name, t.src, t.dst) for t in reader.fetched)
            info = dataclasses.replace(info, tier="fast", from_peers=peers)
        _last_resume.set(info)
        return user_content

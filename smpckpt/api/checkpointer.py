"""The :class:`Checkpointer`: one per job, built from a few option objects, owning what lives between its
calls -- its async lanes and their gloo groups, the staging buffers, the kept save planners, the sequence
counter of its root, its fast tier, the last resume's report.

Folder structure under ``path`` (as SageMaker smp lays it out)::

    {path}/newest              # names the newest committed tag (rank 0 writes it, after the commit)
    {path}/{tag}_partial/      # a partial checkpoint: one committed smpckpt/DCP folder holding
                               #   model.*            model state (plain shards via ShardSpecs, DTensors)
                               #   optim.*            FQN-keyed optimizer state (inherits model specs)
                               #   rng.rank<r>.*      rank r's RNG states (rank-unique keys)
                               #   user_content       user_content: one torch.save record
                               #   smpckpt.manifest.json  commit marker; its "extra" holds the
                               #                      LayoutRecord (layout, specs) and the API record
                               #                      (tag, sequence number, save time, user_content keys)
    {path}/{tag}/              # a full artifact (export)

``user_content`` is stored inside the checkpoint (one ``torch.save`` record by rank 0: checksummed and
committed with the tensors; loaded once, weights-only unless ``allow_pickle=True``).

Every call first compares its tag and options (one digest) across ranks; the steps that follow live in
:mod:`smpckpt.api._save`, :mod:`smpckpt.api._resume`, :mod:`smpckpt.api._full` and the fast tier's
:mod:`smpckpt.api._fast_save` and :mod:`smpckpt.api._fast_resume` (each says which rank does what).
Works the same without a process group.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import dataclasses
import logging
import time
import weakref
from typing import Any

from smpckpt._gc import gc_frozen
from smpckpt.api._async import (
    DrainStatus,
    GlooGroups,
    Lane,
    check_previous,
    live_lanes,
    register_exit_wait,
    wait_lanes,
)
from smpckpt.api._dist import CommonRequest, DistContext, check_state, peer_failures
from smpckpt.api._fast_save import FastTierPart
from smpckpt.api._full import full_url, resume_full, save_full
from smpckpt.api._resume import (
    InventedState,
    ResumeInfo,
    ResumeRequest,
    apply_state,
    check_groups,
    choose_target,
    load_checkpoint,
    not_found_hint,
    resume_state,
    stateless_at_save,
    summarize,
)
from smpckpt.api._save import PlannerCache, SaveRequest, build_save_state, publish_newest, retain, write_checkpoint
from smpckpt.api._staging import Stager, StagingGate, owned_storages
from smpckpt.api.options import (
    AsyncOptions,
    ExportOptions,
    FastTier,
    Location,
    ResumeOptions,
    Retention,
    SaveOptions,
    Sharding,
)
from smpckpt.catalog.root import SequenceCounter, newest_record, partial_url, validate_tag
from smpckpt.errors import CheckpointCorrupt, CheckpointError, CheckpointNotFound, UnsafeCheckpoint
from smpckpt.model.layout import KeyMapper, ParallelLayout
from smpckpt.storage.backends._fs import location_key

__all__ = ["Checkpointer", "last_resume_info", "ResumeInfo"]

log = logging.getLogger("smpckpt.api")  # one logger for the API, whichever module logs

# Per thread (and per asyncio task): concurrent resumes in one process never see each other's report.
_last_resume: contextvars.ContextVar[ResumeInfo | None] = contextvars.ContextVar("smpckpt_last_resume", default=None)


def last_resume_info() -> ResumeInfo | None:
    """The :class:`ResumeInfo` of the last successful partial resume in this thread (any Checkpointer's;
    ``Checkpointer.last_resume_info`` holds one Checkpointer's)."""
    return _last_resume.get()


class Checkpointer:
    """Saves, resumes and exports the checkpoints of one job under one root (README, "Checkpointer").

    Build it once, after the process group, from its options: ``where`` (a path, a URL or a
    :class:`Location`), ``sharding`` (:class:`Sharding`: layout, specs, name map, process group; default:
    pure data parallel over the world), ``fast_tier`` (:class:`FastTier`: tiered checkpoints),
    ``retention`` (:class:`Retention`) and ``async_options`` (:class:`AsyncOptions`). Every rank of the
    process group builds it alike and makes the same calls with the same arguments (compared: a mismatch
    is a :class:`ValueError` on every rank naming what differs, never a hang). Use it as a context manager,
    or :meth:`close` it at the end of the job (:meth:`wait` before ``destroy_process_group()``).
    """

    def __init__(
        self,
        where: str | Any,
        sharding: Sharding | None = None,
        *,
        fast_tier: FastTier | None = None,
        retention: Retention | None = None,
        async_options: AsyncOptions | None = None,
    ) -> None:
        location = where if isinstance(where, Location) else Location(where)
        for name, value, cls in (
            ("sharding", sharding, Sharding),
            ("fast_tier", fast_tier, FastTier),
            ("retention", retention, Retention),
            ("async_options", async_options, AsyncOptions),
        ):
            if value is not None and not isinstance(value, cls):
                raise TypeError(f"{name} must be a smpckpt.{cls.__name__} or None, got {type(value).__name__}")
        self.location, self.sharding, self.fast_tier = location, sharding or Sharding(), fast_tier
        self.retention, self.async_options = retention or Retention(), async_options or AsyncOptions()
        ctx = DistContext(self.sharding.process_group)
        self._world = ctx.world_size
        layout = self.sharding.layout
        if layout is None:
            layout = ParallelLayout(dp=ctx.world_size)
        else:
            layout.check_world_size(
                ctx.world_size, "the process group" if ctx.active else "the world (no process group)"
            )
        self.layout = layout  #: the layout saved and loaded under
        #: what every rank must configure alike (compared at every call, with the call's own options)
        self._compared = {
            **self.location.compared(),
            **self.sharding.compared(),
            "layout": layout.to_dict(),
            "fast_tier": fast_tier is not None,
            **(fast_tier.compared() if fast_tier is not None else {}),
            **self.retention.compared(),
            **self.async_options.compared(),
        }
        self._counter = SequenceCounter(location.path, location.storage_options)
        #: the root as one string whatever its spelling ('/x', '/x/', 'file:///x'): other Checkpointers of
        #: the same root finish their background work before this one saves
        try:
            self._root_key = location_key(location.path, location.storage_options)
        except (OSError, ValueError):  # refused by name where the location is first used
            self._root_key = str(location.path).rstrip("/")
        self._planners = PlannerCache()
        self._stager, self._gate = Stager(), StagingGate()
        self._save_lane = Lane("save", "the background save", self)
        self._drain_lane = Lane("drain", "the drain to the durable tier", self)
        self._groups = GlooGroups(self.sharding.process_group)
        self._tier = FastTierPart(fast_tier, self._groups, self._counter, self._drain_lane) if fast_tier else None
        self._exit_wait = False
        self._closed = False  # close() ended its threads and groups: a later call would quietly rebuild them
        self.last_resume_info: ResumeInfo | None = None  #: this Checkpointer's last partial resume
        # dropped without close(): its lanes end once their work is done, its optimizer hooks go
        weakref.finalize(self, _release, (self._save_lane, self._drain_lane), self._gate)

    def __repr__(self) -> str:
        return f"Checkpointer({self.location.path!r}, {self.layout})"

    # -- the calls ---------------------------------------------------------------------------------
    def save(
        self,
        tag: str,
        model: Any = None,
        optimizer: Any = None,
        user_content: Any = None,
        *,
        options: SaveOptions | None = None,
    ) -> concurrent.futures.Future[None] | None:
        """Save a partial checkpoint ``{path}/{tag}_partial`` of ``model`` (its state under ``model.<fqn>``),
        ``optimizer`` (one or a sequence: FQN-keyed state under ``optim.*``, inheriting its parameter's
        spec), every rank's RNG states and ``user_content`` (rank 0's: any picklable value; one that
        weights-only loading rejects needs ``allow_pickle=True`` on resume, a warning says so), then point
        ``{path}/newest`` at it and apply :class:`Retention`. ``tag``: letters, digits and
        ``. _ - + = @ ,`` (validated up front). With a :class:`FastTier`, into the fast tiers first
        (README, "Tiered checkpoints").

        Returns ``None``, or, saving asynchronously (:class:`AsyncOptions`, ``SaveOptions.async_save``), a
        ``concurrent.futures.Future`` that completes when the save is durable (with a fast tier: when the
        fast tier is committed).

        Raises:
            ValueError: an invalid tag, or arguments that differ between ranks.
            CheckpointExists: the tag exists and ``overwrite`` is false.
            CheckpointError: any other failure, on every rank (DCP's ``CheckpointException`` is the
                ``__cause__``).
        """
        return self._save(tag, model, optimizer, user_content, options, "Checkpointer.save's arguments")

    def resume(
        self, tag: str | None = None, model: Any = None, optimizer: Any = None, *, options: ResumeOptions | None = None
    ) -> Any:
        """Load ``{path}/{tag}_partial`` (``tag=None``: the one ``newest`` names) into ``model`` and
        ``optimizer`` in place, under this Checkpointer's layout (resharding when the saved one differs),
        and return its ``user_content``.

        With ``tag=None``: if ``newest`` is missing, unreadable or names a checkpoint without a commit
        marker, or a checkpoint committed after it exists, the newest committed checkpoint is used instead
        (a warning on rank 0; :attr:`ResumeInfo.fell_back`). Nothing committed:
        :class:`~smpckpt.errors.CheckpointNotFound`, or ``None`` with ``ResumeOptions(missing_ok=True)``.
        RNG states are restored when the saved layout equals this one; after a layout change they are not
        (a warning). ``ResumeOptions(partial=False)`` loads a full artifact instead (README, "Full
        checkpoints"). What the resume did: :attr:`last_resume_info`.
        """
        return self._resume(tag, model, optimizer, options, "Checkpointer.resume's arguments")

    def export(
        self,
        tag: str,
        out: str | None = None,
        *,
        model: Any = None,
        optimizer: Any = None,
        user_content: Any = None,
        options: ExportOptions | None = None,
    ) -> str:
        """Write a full artifact (README, "Full checkpoints and Hugging Face") and return its folder.

        With ``model``: of the live state, every rank writing its own shards into ``out`` (default
        ``{path}/{tag}``; ``newest`` and retention ignore it) -- ``save_checkpoint(..., partial=False)``.
        Without: of the committed partial checkpoint ``tag`` under ``path``, into ``out`` (required), on
        rank 0 in one process, a tensor at a time (:func:`smpckpt.consolidate_checkpoint`)."""
        return self._export(tag, out, model, optimizer, user_content, options, "Checkpointer.export's arguments")

    def wait(self) -> None:
        """Block until the background save in flight (if any) and then the drain to the durable tier have
        finished; a failure of either is raised here (and not again by the next save)."""
        wait_lanes(self._save_lane, self._drain_lane, raise_errors=True)

    def _rebind_sharding(self, sharding: Sharding) -> bool:
        """(smp's face) Take ``sharding`` in place of this Checkpointer's when only what compares by identity
        differs (a ``name_map`` lambda or ``specs`` rules built afresh at every call): same process group,
        same layout. Rebuilding instead would leave a background gloo group, an exit hook and the staging
        buffers behind at every call. ``False``: it does not fit; build another Checkpointer."""
        if sharding.process_group is not self.sharding.process_group:
            return False
        layout = sharding.layout if sharding.layout is not None else ParallelLayout(dp=self._world)
        if layout != self.layout:
            return False
        self.wait()  # the save in flight used the old mapping; its failure is raised here, as a rebuild would
        self.sharding = sharding
        self._compared = {**self._compared, **sharding.compared()}
        self._planners = PlannerCache()  # plans made under the old mapping are not reused
        return True

    def _retain(self, retention: Retention) -> None:
        """(smp's face) The retention of this Checkpointer's next saves: ``save_checkpoint`` takes
        ``num_kept_partial_checkpoints`` per call, and a resume none; a rebuild at every change left a gloo
        group, an exit hook and the staging buffers behind. A save in flight keeps the retention it had."""
        self.retention = retention
        self._compared = {**self._compared, **retention.compared()}

    def close(self) -> None:
        """(every rank) :meth:`wait`, then end the lanes' threads, remove the optimizer step hooks, free the
        staging buffers and tear down the background gloo groups (collectively). Saves, resumes and
        exports through it are refused afterwards."""
        self._closed = True
        try:
            self.wait()
        finally:
            _release((self._save_lane, self._drain_lane), self._gate, join=True)
            self._stager.free()
        self._groups.destroy()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._closed = True
        if exc_type is None:
            self.close()
            return
        # the body's error is the one to raise: nothing collective, nothing raised from here
        wait_lanes(self._save_lane, self._drain_lane, raise_errors=False)
        _release((self._save_lane, self._drain_lane), self._gate, join=True)

    def drain_status(self) -> DrainStatus | None:
        """The state of the last drain to the durable tier (``None``: none started)."""
        return DrainStatus.of(self._drain_lane)

    def staging_bytes(self) -> int:
        """Bytes held in reused staging buffers (one copy of the state saved asynchronously)."""
        return self._stager.nbytes()

    def free_staging_buffers(self) -> None:
        """Release the reused staging buffers (after waiting for the save in flight)."""
        wait_lanes(self._save_lane, self._drain_lane, raise_errors=False)
        self._stager.free()

    # -- the steps -------------------------------------------------------------------------------
    def _agreed(
        self, ctx: DistContext, what: str, tag: Any, options: Any, cls: type[Any], model: Any, optimizer: Any
    ) -> tuple[CommonRequest, Any]:
        """(all ranks, one collective) This call's options (``options``, a ``cls``, or the defaults), model
        and optimizer checked, and its tag and options compared across ranks (with the Checkpointer's own:
        one digest)."""

        def check() -> tuple[tuple[CommonRequest, Any], dict[str, Any]]:
            if self._closed:
                raise RuntimeError(f"{self!r} is closed (close() or the end of its with block): build a new one")
            opts = _options(options, cls)
            if ctx.world_size != self._world:
                raise ValueError(
                    f"the process group has {ctx.world_size} ranks; this Checkpointer was built for {self._world}"
                )
            checked_model, optimizers = check_state(model, optimizer)
            if checked_model is not None:
                mapper = KeyMapper(self.layout, self.layout.coords(ctx.rank).pp, self.sharding.name_map)
                states = [n for n, _ in checked_model.named_parameters(remove_duplicate=False)]
                states += [n for n, _ in checked_model.named_buffers(remove_duplicate=False)]
                mapper.check_model_layers(
                    [n for n, _ in checked_model.named_modules(remove_duplicate=False)] + states, states
                )
            common = CommonRequest(
                root=self.location.path,
                model=checked_model,
                optimizers=optimizers,
                layout=self.layout,
                rules=self.sharding.rules,
                name_map=self.sharding.name_map,
                storage_options=self.location.storage_options,
                process_group=self.sharding.process_group,
            )
            return (common, opts), {"tag": tag, **self._compared, **opts.compared()}

        return ctx.agreed(check, what)

    def _save(
        self, tag: Any, model: Any, optimizer: Any, user_content: Any, options: Any, what: str
    ) -> concurrent.futures.Future[None] | None:
        ctx = DistContext(self.sharding.process_group)
        action = f"saving checkpoint {tag!r} under {self.location.path}"
        with peer_failures(ctx, action):
            common, opts = self._agreed(ctx, what, tag, options, SaveOptions, model, optimizer)
            validate_tag(tag)  # the same on every rank now: it fails all alike
            if self._tier is not None and opts.overwrite:
                raise ValueError(
                    "overwrite does not apply with local_path (a fast tier: a tiered save never replaces a tag)"
                )
        asynchronous = self.async_options.enabled if opts.async_save is None else opts.async_save
        if asynchronous or self._tier is not None:
            self._register_exit_wait()
        self._finish_others()
        if asynchronous or self._save_lane.used or self._drain_lane.used:  # one collective more, then only
            with peer_failures(ctx, action):
                ctx.all_ok(lambda: check_previous(self._save_lane, self._drain_lane, opts.wait_for_previous))
        with peer_failures(ctx, action), gc_frozen(opts.freeze_gc and not asynchronous):
            req = SaveRequest(
                **common.fields(),
                tag=tag,
                url=partial_url(common.root, tag),
                user_content=user_content,
                opts=opts,
                retention=self.retention,
                planners=self._planners,
            )
            tier = self._tier.plan(req, ctx) if self._tier is not None else None
            started = time.monotonic()
            state, extra = ctx.all_ok(lambda: build_save_state(req, ctx, self._counter))
            if tier is not None and self._tier is not None:
                tier = self._tier.drew(tier, extra)
            if asynchronous:
                return self._submit(req, ctx, state, extra, tier)
            self._write(req, state, extra, tier, f"in {time.monotonic() - started:.2f}s")
        return None

    def _write(self, req: SaveRequest, state: dict[str, Any], extra: dict[str, Any], tier: Any, how: str) -> None:
        """(all ranks, on ``req.process_group``) Write, commit, point ``newest``, retain (or the tiered save)."""
        if self._tier is not None:
            self._tier.save(req, state, extra, tier)
            return
        sctx = DistContext(req.process_group)
        write_checkpoint(req, state, extra)
        publish_newest(req, sctx, extra)
        log.info("saved checkpoint %s (%s) %s", req.url, req.layout, how)
        retain(req, sctx)

    def _submit(
        self, req: SaveRequest, ctx: DistContext, state: dict[str, Any], extra: dict[str, Any], tier: Any
    ) -> concurrent.futures.Future[None]:
        """(caller) Stage ``state`` (the optimizers' part on the lane: ``_staging``), then write it on the save
        lane over the Checkpointer's own gloo group."""
        group = self._groups.get(ctx)
        started = time.monotonic()
        deferred = owned_storages(req.optimizers) if self.async_options.overlap_staging else set()
        staged, pending = self._stager.stage(req.tag, state, deferred)
        if pending is not None:
            self._gate.guard(req.optimizers)
            self._gate.pending = pending
        log.info("staged checkpoint %r in %.3fs; writing in the background", req.tag, time.monotonic() - started)
        breq = dataclasses.replace(req, process_group=group)

        def work() -> None:
            if pending is not None:
                try:
                    pending.run()
                finally:
                    if self._gate.pending is pending:
                        self._gate.pending = None
            with peer_failures(DistContext(group), f"saving checkpoint {req.tag!r} under {req.root} in the background"):
                self._write(breq, staged, extra, tier, "in the background")

        try:
            fut = self._save_lane.submit(req.tag, work)
        except BaseException:
            if pending is not None:  # never queued (no thread could start): no step may wait for it
                if self._gate.pending is pending:
                    self._gate.pending = None
                pending.issued.set()
            raise
        if pending is not None:  # a future cancelled before it ran never stages: no step may wait for it
            fut.add_done_callback(lambda f: pending.issued.set() if f.cancelled() else None)
        return fut

    def _finish_others(self) -> None:
        """Other Checkpointers of this root in this process finish their background work first (a save in
        flight, a drain): each numbers its saves and holds its drains as its own, like two jobs would."""
        for lane in sorted(live_lanes(), key=lambda lane: lane.kind != "save"):
            owner = lane.owner()
            if owner is not None and owner is not self and owner._root_key == self._root_key:
                lane.wait()

    def _register_exit_wait(self) -> None:
        if not self._exit_wait:
            register_exit_wait((self._save_lane, self._drain_lane), self.async_options.exit_status)
            self._exit_wait = True

    def _resume(self, tag: Any, model: Any, optimizer: Any, options: Any, what: str) -> Any:
        # a background save (of this Checkpointer or another in the process) may be committing, updating
        # newest or removing what retention picks: resume from what it leaves (its failure stays for its
        # next save to raise)
        for lane in sorted(live_lanes(), key=lambda lane: lane.kind != "save"):
            lane.wait()
        ctx = DistContext(self.sharding.process_group)
        path = self.location.path
        with peer_failures(ctx, f"resuming from {path}"):
            common, opts = self._agreed(ctx, what, tag, options, ResumeOptions, model, optimizer)
            if tag is not None:
                validate_tag(tag)
        action = f"{'resuming' if opts.partial else 'loading full checkpoint'} from {path}"
        with peer_failures(ctx, action), gc_frozen(opts.freeze_gc):
            if not opts.partial:
                return resume_full(ctx, common, tag, opts)
            req = ResumeRequest(**common.fields(), tag=tag, opts=opts)
            with InventedState(req.model, req.optimizers) as guard:
                loaded = None
                if self._tier is not None:
                    loaded = self._tier.resume(req, ctx)
                    target = loaded.target if loaded is not None else None
                else:
                    target = choose_target(req, ctx, self._counter)
                if target is None:
                    if tag is None:
                        _refuse_damaged_newest(ctx, path, req.storage_options)
                    if opts.missing_ok:
                        log.info("no committed checkpoint under %s: starting fresh (missing_ok=True)", path)
                        return None
                    what_ = f"checkpoint {tag!r}" if tag is not None else "committed checkpoint"
                    hint = ctx.on_coordinator(lambda: not_found_hint(path, req.storage_options)) if tag is None else ""
                    raise CheckpointNotFound(f"no {what_} under {path}{hint}")
                if loaded is not None:
                    rng, state, planner, reader = loaded.rng, loaded.state, loaded.planner, loaded.reader
                else:
                    (rng, state), reader = resume_state(req, target, ctx), None
                    planner = load_checkpoint(req, req.opts, target.url, state)
                chosen = target
                ctx.all_ok(lambda: check_groups(req, state))  # every rank refuses alike, before set_state_dict
                guard.applied = True
                user_content, restored, untranslated = ctx.all_ok(
                    lambda: apply_state(
                        req,
                        chosen,
                        ctx,
                        state,
                        planner.report,
                        rng,
                        stateless_at_save(req.model, req.optimizers, state, guard.stateless, planner),
                    )
                )
                self._counter.resumed(target.order[0], target.abandoned)  # applied: a roll-back (catalog.root)
                info = summarize(req, target, ctx, planner, restored, untranslated)
                if reader is not None:
                    peers = tuple((t.name, t.src, t.dst) for t in reader.fetched)
                    info = dataclasses.replace(info, tier="fast", from_peers=peers)
                self.last_resume_info = info
                _last_resume.set(info)
                return user_content

    def _export(
        self, tag: Any, out: Any, model: Any, optimizer: Any, user_content: Any, options: Any, what: str
    ) -> str:
        ctx = DistContext(self.sharding.process_group)
        path = self.location.path
        action = f"saving full checkpoint {tag!r} under {path}"
        with peer_failures(ctx, action):
            common, opts = self._agreed(ctx, what, tag, options, ExportOptions, model, optimizer)
            validate_tag(tag)
            if out is not None and not isinstance(out, str):
                raise TypeError(f"out must be a str (a folder or URL) or None, got {type(out).__name__}")
            if common.model is None and out is None:
                raise ValueError(
                    "export of the committed checkpoint (no model=) needs out=: the folder of the artifact"
                )
        self._finish_others()
        if self._save_lane.used or self._drain_lane.used:
            with peer_failures(ctx, action):
                ctx.all_ok(lambda: check_previous(self._save_lane, self._drain_lane, True))
        with peer_failures(ctx, action), gc_frozen(opts.freeze_gc):
            if common.model is None and out is not None:  # no model and no out was refused above
                dest = out
                return ctx.on_coordinator(lambda: self._consolidate(tag, dest, opts))
            url = out if out is not None else full_url(path, tag)
            return save_full(ctx, common, tag, url, opts, user_content, self._counter, self._planners)

    def _consolidate(self, tag: str, out: str, opts: ExportOptions) -> str:
        """(rank 0) The committed partial checkpoint ``tag`` as a full artifact in ``out``."""
        from smpckpt.tools.consolidate import consolidate_checkpoint  # the offline export (rooms: BACK_EDGES)

        loc = self.location
        consolidate_checkpoint(
            partial_url(loc.path, tag),
            out,
            include_optimizer=opts.include_optimizer,
            dtype=opts.dtype,
            max_shard_size=opts.max_shard_size,
            translation=opts.translate_function,
            hf_config=opts.hf_config,
            storage_options=loc.storage_options,
            progress=False,
            format=opts.format,
            out_storage_options=opts.out_storage_options,
            sync_files=opts.sync_files,
        )
        return out


def _refuse_damaged_newest(ctx: DistContext, root: str, storage_options: Any) -> None:
    """(all ranks; a tag-less resume that found nothing committed) Refuse when ``newest`` names a folder that
    is there but damaged, unreadable or without its manifest: ``newest`` moves only after a commit, so that
    is the job's progress, broken -- no fresh start (``missing_ok``) and no "nothing committed"."""
    rec = ctx.on_coordinator(lambda: newest_record(root, storage_options))
    if rec is None or rec.state in ("committed", "missing", "removing", "legacy"):
        return
    errors = {"unreadable": CheckpointError, "unsafe": UnsafeCheckpoint}
    raise errors.get(rec.state, CheckpointCorrupt)(
        f"{root}/newest names {rec.tag!r}, which is {rec.state} ({rec.detail}) and no other checkpoint is "
        "committed: not starting fresh (missing_ok does not apply to a checkpoint that is there); "
        + (
            "retry the resume"
            if rec.state == "unreadable"
            else "restore it (a copy still syncing: wait), pass tag= to choose another, or remove it and newest"
        )
    )


def _options(options: Any, cls: type[Any]) -> Any:
    """A call's options: ``options``, or the defaults."""
    if options is not None and not isinstance(options, cls):
        raise TypeError(f"options must be a smpckpt.{cls.__name__}, got {type(options).__name__}")
    return cls() if options is None else options


def _release(lanes: tuple[Lane, Lane], gate: StagingGate, join: bool = False) -> None:
    """(close, or the Checkpointer dropped) The lanes' threads end once their work is done (``join``: wait
    for that); the optimizer step hooks go."""
    for lane in lanes:
        lane.stop(join)
    gate.close()

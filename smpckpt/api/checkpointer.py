"""The :class:`Checkpointer`: one per job, owning what lives between its calls (async lanes and their gloo
groups, staging buffers, kept save planners, its root's sequence counter, its fast tier, the last resume's
report). Folders as smp lays them out (README, "Folders"): ``{path}/newest``, ``{path}/{tag}_partial/`` (one
committed smpckpt/DCP folder: ``model.*``, ``optim.*``, ``rng.rank<r>.*``, ``user_content``, the manifest
whose "extra" holds the layout and the API record) and ``{path}/{tag}/`` (a full artifact).

Every call first compares its tag and options (one digest) across ranks; the steps live in ``_save``,
``_resume``, ``_fast_save`` and ``_fast_resume`` (each says which rank does what).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import dataclasses
import logging
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from smpckpt._checks import refuse_unflattenable
from smpckpt._gc import gc_frozen
from smpckpt.api._async import DrainStatus, GlooGroups, Lane, check_previous, live_lanes, register_exit_wait, wait_lanes
from smpckpt.api._dist import CommonRequest, DistContext, check_state, peer_failures
from smpckpt.api._fast_save import FastTierPart
from smpckpt.api._resume import (
    InventedState,
    ResumeInfo,
    ResumeRequest,
    apply_state,
    in_place,
    load_checkpoint,
    resolve_target,
    resume_state,
    skipped_keys,
    stateless_at_save,
    summarize,
)
from smpckpt.api._save import (
    PlannerCache,
    SaveRequest,
    build_save_state,
    full_url,
    not_found_hint,
    publish_newest,
    refuse_damaged_newest,
    resume_full,
    retain,
    save_full,
    write_checkpoint,
)
from smpckpt.api._staging import Pending, Stager, StagingGate, owned_storages
from smpckpt.api.options import (
    AsyncOptions,
    ExportOptions,
    FastTier,
    Location,
    ResumeOptions,
    Retention,
    SaveOptions,
    Sharding,
    check_groups,
)
from smpckpt.catalog import holds_last
from smpckpt.catalog.root import Mark, SequenceCounter, mark_of, partial_url, validate_tag
from smpckpt.errors import CheckpointError, CheckpointNotFound
from smpckpt.model.layout import KeyMapper, ParallelLayout
from smpckpt.storage.backends._fs import folder_key, options_now

__all__ = ["Checkpointer", "last_resume_info", "ResumeInfo"]

log = logging.getLogger("smpckpt.api")  # one logger for the API, whichever module logs

# Per thread (and per asyncio task): concurrent resumes in one process never see each other's report.
# With the checkpoint's identity (its save stamp: a link re-pointed at another run's folder moves no resume to it, rev72a
# M1; the same run moved under the link keeps it) and the time of the resume (a save of this job since ends it).
_last_resume: contextvars.ContextVar[tuple[ResumeInfo, Mark | None, int] | None] = contextvars.ContextVar(
    "smpckpt_last_resume"
)
# the resume this thread is inside: a save from a signal handler run meanwhile (SIGTERM, preemption) would
# commit half-loaded state as newest (hunt66d), so it is refused
_resuming: contextvars.ContextVar[str] = contextvars.ContextVar("smpckpt_resuming", default="")


@contextlib.contextmanager
def _marked_resuming(path: str) -> Iterator[None]:
    token = _resuming.set(path)
    try:
        yield
    finally:
        _resuming.reset(token)


def _refuse_while_resuming(action: str) -> None:
    """Before any collective (the other ranks are still in the resume): a save from a signal handler that
    interrupted this thread's resume would commit half-loaded state (hunt66d P1)."""
    if _resuming.get():
        raise CheckpointError(
            f"{action}: refused while resuming from {_resuming.get()} in this thread (a signal handler's "
            "save would commit half-loaded state); set a flag there and save after the resume returned"
        )


def last_resume_info() -> ResumeInfo | None:
    """The :class:`ResumeInfo` of the last successful partial resume in this thread (any Checkpointer's)."""
    last = _last_resume.get(None)
    return last[0] if last is not None else None


class Checkpointer:
    """Saves, resumes and exports the checkpoints of one job under one root (README, "Checkpointer").

    Every rank builds it alike, after the process group, and makes the same calls with the same arguments
    (compared: a mismatch is a :class:`ValueError` on every rank naming what differs, never a hang). Use it
    as a context manager, or :meth:`close` it at the end of the job.
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
        #: the root as one string whatever its spelling ('/x', '/x/', 'file:///x', a link to it, resolved again at
        #: each call: rev72a M2): other Checkpointers of the same root finish their background work before it saves
        self._root_key = self._folder()
        self._planners = PlannerCache()
        self._stager, self._gate = Stager(), StagingGate()
        self._save_lane = Lane("save", "the background save", self)
        self._drain_lane = Lane("drain", "the drain to the durable tier", self)
        self._groups = GlooGroups(self.sharding.process_group)
        self._tier = FastTierPart(fast_tier, self._groups, self._counter, self._drain_lane) if fast_tier else None
        self._exit_wait = False
        self._closed = False  # close() ended its threads and groups: a later call would quietly rebuild them
        self.last_resume_info: ResumeInfo | None = None  #: this Checkpointer's last partial resume
        # dropped without close(): its lanes end once their work is done, its staging gate leaves the step hook
        weakref.finalize(self, _release, (self._save_lane, self._drain_lane), self._gate)

    def _folder(self) -> str:
        """The root's key now (storage.backends._fs.folder_key): a link made or re-pointed since names its folder."""
        try:
            return folder_key(self.location.path, self.location.storage_options)
        except (OSError, ValueError):  # refused by name where the location is first used
            return str(self.location.path).rstrip("/")

    def _moved(self, root: str, decides: bool) -> None:
        """The root's folder changed (a link re-pointed): its work in flight ends; another run's folder is numbered
        afresh. ``decides`` (rank 0, which numbers): one read tells the same run moved under the link (or copied,
        or mounted twice: it holds this job's last checkpoint, by its save stamp), whose history goes on (rev72o M1:
        afresh, a roll-back was lost: retention removed its parent and kept the saves it abandoned)."""
        wait_lanes(self._save_lane, self._drain_lane, raise_errors=False)  # the save first: it submits its drain
        if decides and holds_last(self._counter):
            log.info(
                "%s now names folder %s (was %s), holding this run: numbered on",
                self.location.path,
                root,
                self._root_key,
            )
            return
        log.warning("%s now names folder %s (was %s): numbered afresh there", self.location.path, root, self._root_key)
        self._counter = SequenceCounter(self.location.path, self._counter.storage_options)
        if (old := self._tier) is not None:
            self._tier = FastTierPart(old.options, self._groups, self._counter, self._drain_lane)
            # what it drained went to the old folder: not due in the new one, nor "never reached" (rev72o L3)
            self._tier.state.durable = old.state.durable
            old.state.close()  # its threads (its work is done)

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
        """Save ``{path}/{tag}_partial`` (model, optimizers, every rank's RNG states, rank 0's
        ``user_content``), point ``{path}/newest`` at it and apply :class:`Retention`; with a
        :class:`FastTier`, into the fast tiers first. Returns ``None``, or, saving asynchronously, a
        ``Future`` that completes when the save is durable (with a fast tier: when the fast tier commits).

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
        """Load ``{path}/{tag}_partial`` (``tag=None``: the one ``newest`` names, falling back to the newest
        committed one; :attr:`ResumeInfo.fell_back`) into ``model`` and ``optimizer`` in place, resharding
        to this Checkpointer's layout, and return its ``user_content``. Nothing committed:
        :class:`~smpckpt.errors.CheckpointNotFound`, or ``None`` with ``missing_ok``. What it did:
        :attr:`last_resume_info`.
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
        """Write a full artifact and return its folder: with ``model``, of the live state (every rank its
        own shards; ``out`` defaults to ``{path}/{tag}``); without, of the committed partial checkpoint
        ``tag``, into ``out`` (required), on rank 0 (:func:`smpckpt.consolidate_checkpoint`)."""
        return self._export(tag, out, model, optimizer, user_content, options, "Checkpointer.export's arguments")

    def wait(self) -> None:
        """Block until the background save in flight and then the drain have finished; a failure of either
        is raised here (not again by the next save)."""
        wait_lanes(self._save_lane, self._drain_lane, raise_errors=True)

    def close(self) -> None:
        """(every rank) :meth:`wait`, then end the lanes' threads, the step hooks, the staging buffers and
        the background gloo groups (collectively). Later calls are refused."""
        self._closed = True
        try:
            self.wait()
        finally:
            _release((self._save_lane, self._drain_lane), self._gate, join=True, tier=self._tier)
            self._planners.workers.close()
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
        _release((self._save_lane, self._drain_lane), self._gate, join=True, tier=self._tier)
        self._planners.workers.close()

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
        self,
        action: str,
        what: str,
        tag: Any,
        options: Any,
        cls: type[Any],
        model: Any,
        optimizer: Any,
        also: Callable[[CommonRequest], dict[str, Any]] | None = None,
    ) -> tuple[DistContext, CommonRequest, Any]:
        """(all ranks, one collective) This call's options, model and optimizer checked, and its tag and
        options compared across ranks (with the Checkpointer's own: one digest); then its tag validated (the
        same on every rank now: it fails all alike; a resume's may be ``None``). ``also``: the call's own
        arguments checked, returning more values to compare."""
        ctx = DistContext(self.sharding.process_group)

        def check() -> tuple[tuple[CommonRequest, Any], dict[str, Any]]:
            if self._closed:
                raise RuntimeError(f"{self!r} is closed (close() or the end of its with block): build a new one")
            if options is not None and not isinstance(options, cls):
                raise TypeError(f"options must be a smpckpt.{cls.__name__}, got {type(options).__name__}")
            opts = cls() if options is None else options
            if ctx.world_size != self._world:
                raise ValueError(
                    f"the process group has {ctx.world_size} ranks; this Checkpointer was built for {self._world}"
                )
            checked_model, optimizers = check_state(model, optimizer)
            if getattr(opts, "include_optimizer", True):  # all but an export without it flatten optimizer state
                refuse_unflattenable(checked_model, optimizers)
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
                storage_options=options_now(self.location.storage_options),  # this call's, in the background too
                process_group=self.sharding.process_group,
                held_by_some=self.sharding.held_by_some,
            )
            more = also(common) if also is not None else {}
            return (common, opts), {"tag": tag, **self._compared, **opts.compared(), **more}

        with peer_failures(ctx, action):
            if cls is SaveOptions and not self._closed:  # every rank is in this save, or it fails in a bound
                self._groups.join(ctx, self.sharding.join_timeout, action)
            common, opts = ctx.agreed(check, what)
            self._counter.storage_options = common.storage_options  # a save's number read with its options
            if (root := self._folder()) != self._root_key:  # a link re-pointed: not that folder's history (rev72j M1)
                self._moved(root, ctx.is_coordinator)
            self._root_key = root
            last = _last_resume.get(None)  # this thread's: a per-save Checkpointer (export too) goes on from it
            self._counter.hinted = last[1:] if last is not None else (None, 0)  # (rev69i 4; catalog.root)
            if self.sharding.join_timeout is not None:  # every rank is here: the group later saves meet on
                self._groups.get(ctx, "join", self.sharding.join_timeout)
            if tag is not None or cls is not ResumeOptions:
                validate_tag(tag)
        return ctx, common, opts

    def _save(
        self, tag: Any, model: Any, optimizer: Any, user_content: Any, options: Any, what: str
    ) -> concurrent.futures.Future[None] | None:
        action = f"saving checkpoint {tag!r} under {self.location.path}"
        _refuse_while_resuming(action)
        ctx, common, opts = self._agreed(action, what, tag, options, SaveOptions, model, optimizer)
        if self._tier is not None and opts.overwrite:
            raise ValueError(
                "overwrite does not apply with local_path (a fast tier: a tiered save never replaces a tag)"
            )
        asynchronous = self.async_options.enabled if opts.async_save is None else opts.async_save
        if (asynchronous or self._tier is not None) and not self._exit_wait:
            register_exit_wait((self._save_lane, self._drain_lane), self.async_options.exit_status, ctx.rank == 0)
            self._exit_wait = True
        self._settle(ctx, action, opts.wait_for_previous, asynchronous)
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
        self._counter.landed(req.tag, extra)  # (rank 0's extra) the run this root's folder holds
        publish_newest(req, sctx, extra)
        log.info("saved checkpoint %s (%s) %s", req.url, req.layout, how)
        retain(req, sctx, self._counter.manifests)

    def _submit(
        self, req: SaveRequest, ctx: DistContext, state: dict[str, Any], extra: dict[str, Any], tier: Any
    ) -> concurrent.futures.Future[None]:
        """(caller) Stage ``state``, then write it on the save lane over the Checkpointer's own gloo group."""
        group = self._groups.get(ctx)
        started = time.monotonic()
        deferred = owned_storages(req.optimizers) if self.async_options.overlap_staging else set()

        # agreed: a rank that could not stage (its buffers not allocated) or start its lane's thread would
        # leave the others' writes waiting for it
        def stage() -> tuple[Any, Pending | None]:
            self._save_lane.start()
            return self._stager.stage(req.tag, state, deferred)

        staged, pending = ctx.all_ok(stage)
        if pending is not None:
            self._gate.guard()
            self._gate.pending = pending
        log.info("staged checkpoint %r in %.3fs; writing in the background", req.tag, time.monotonic() - started)
        breq = dataclasses.replace(req, process_group=group)
        overlap = self.async_options.overlap_staging  # every rank's alike (the options are agreed)

        def work() -> None:
            action = f"saving checkpoint {req.tag!r} under {req.root} in the background"
            with self._groups.kept(group, action), peer_failures(bctx := DistContext(group), action):
                try:
                    # the ranks agree on their staging first: one that refused it (a tensor changed in
                    # place) would otherwise leave the others waiting for it in the write's collectives
                    if overlap:
                        bctx.all_ok(pending.run if pending is not None else lambda: None)
                finally:
                    if pending is not None and self._gate.pending is pending:
                        self._gate.pending = None
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

    def _settle(self, ctx: DistContext, action: str, wait: bool, asynchronous: bool = False) -> None:
        """Other Checkpointers of this root in this process finish their background work first, as jobs
        would; then (one collective more, only once this one's lanes were used) its own save in flight is
        waited for (``wait``; else refused) and a failure it kept raised."""
        for lane in sorted(live_lanes(), key=lambda lane: lane.kind != "save"):
            owner = lane.owner()
            if owner is not None and owner is not self and owner._root_key == self._root_key:
                lane.wait()
        if asynchronous or self._save_lane.used or self._drain_lane.used:
            with peer_failures(ctx, action):
                ctx.all_ok(lambda: check_previous(self._save_lane, self._drain_lane, wait))

    def _resume(self, tag: Any, model: Any, optimizer: Any, options: Any, what: str) -> Any:
        # a background save may be committing, updating newest or applying retention: resume from what it
        # leaves (its failure stays for its next save to raise)
        for lane in sorted(live_lanes(), key=lambda lane: lane.kind != "save"):
            lane.wait()
        path = self.location.path
        ctx, common, opts = self._agreed(f"resuming from {path}", what, tag, options, ResumeOptions, model, optimizer)
        action = f"{'resuming' if opts.partial else 'loading full checkpoint'} from {path}"
        with peer_failures(ctx, action), gc_frozen(opts.freeze_gc), _marked_resuming(path):
            req = ResumeRequest(**common.fields(), tag=tag, opts=opts)
            if not opts.partial:
                return resume_full(ctx, req)
            with InventedState(req.model, req.optimizers) as guard:
                loaded = None
                if self._tier is not None:
                    loaded = self._tier.resume(req, ctx)
                    target = loaded.target if loaded is not None else None
                else:  # rank 0 resolves the tag and reads its manifest once; every rank gets the answer
                    target = ctx.on_coordinator(  # (called from the lambda: its warnings' stacklevel counts on it)
                        lambda: self._counter.resuming(resolve_target(path, tag, req.storage_options), tag)
                    )  # refused when tag-less into another job's (catalog.root)
                    if target is not None:  # this job's next saves are numbered after it (catalog.root)
                        target.seen_by(self._counter)
                if target is None:
                    if tag is None:
                        refuse_damaged_newest(ctx, path, req.storage_options)
                    hint = ctx.on_coordinator(lambda: not_found_hint(path, req.storage_options)) if tag is None else ""
                    if opts.missing_ok and not hint:  # a checkpoint given as the root is no fresh start (hunt73c F6)
                        log.info("no committed checkpoint under %s: starting fresh (missing_ok=True)", path)
                        return None
                    what_ = f"checkpoint {tag!r}" if tag is not None else "committed checkpoint"
                    # a tiered resume searched the fast tier too (hunt67 note: the error named path alone)
                    fast = f" nor in the fast tier {self._tier.options.local_path}" if self._tier is not None else ""
                    raise CheckpointNotFound(f"no {what_} under {path}{fast}{hint}")
                if loaded is not None:
                    rng, state, planner, reader = loaded.rng, loaded.state, loaded.planner, loaded.reader
                else:
                    (rng, state), reader = resume_state(req, target, ctx), None
                    planner = load_checkpoint(req, req.opts, target.url, state, known=target.manifest)
                # (a translate_function's model keys land aside: without an optimizer nothing is loaded in place)
                chosen, guard.loaded = target, in_place(req, req.opts)
                # every rank refuses alike (or its translate_function fails alike) before set_state_dict
                untranslated = ctx.all_ok(lambda: check_groups(req, state))
                counts = skipped_keys(target.url, ctx, planner, untranslated)  # warned before anything is applied
                guard.applied = True
                user_content, restored = ctx.all_ok(
                    lambda: apply_state(
                        req,
                        chosen,
                        ctx,
                        state,
                        planner.report,
                        bool(rng),
                        stateless_at_save(req.model, req.optimizers, state, guard.stateless, planner),
                    )
                )
                extra = target.manifest.extra if target.manifest is not None else None  # (rank 0's: it draws)
                self._counter.resumed(target.order[0], target.abandoned, extra, target.tag)  # applied: catalog.root
                self._counter.mark = mark_of(target.tag, extra, target.order[1])  # (rank 0's: it draws)
                info = summarize(req, target, counts, restored, rng)
                if reader is not None:
                    peers = tuple((t.name, t.src, t.dst) for t in reader.fetched)
                    info = dataclasses.replace(info, tier="fast", from_peers=peers)
                self.last_resume_info = info
                _last_resume.set((info, self._counter.mark, time.time_ns()))  # (rank 0's mark: it draws)
                return user_content

    def _export(
        self, tag: Any, out: Any, model: Any, optimizer: Any, user_content: Any, options: Any, what: str
    ) -> str:
        path = self.location.path
        action = f"saving full checkpoint {tag!r} under {path}"
        if model is not None:  # an export of the live model (rev66f F1); of the committed checkpoint, it reads files
            _refuse_while_resuming(action)

        def out_checked(common: CommonRequest) -> dict[str, Any]:  # in the agreement: every rank fails alike
            if out is not None and not isinstance(out, str):
                raise TypeError(f"out must be a str (a folder or URL) or None, got {type(out).__name__}")
            if common.model is None and out is None:
                raise ValueError(
                    "export of the committed checkpoint (no model=) needs out=: the folder of the artifact"
                )
            return {"out": out}  # one artifact: ranks given different folders would each return theirs

        ctx, common, opts = self._agreed(action, what, tag, options, ExportOptions, model, optimizer, out_checked)
        self._settle(ctx, action, True)
        with peer_failures(ctx, action), gc_frozen(opts.freeze_gc):
            if common.model is None and out is not None:  # no model and no out was refused above
                dest = out
                return ctx.on_coordinator(lambda: self._consolidate(tag, dest, opts, common.storage_options))
            url = out if out is not None else full_url(path, tag)
            return save_full(ctx, common, tag, url, opts, user_content, self._counter, self._planners)

    def _consolidate(self, tag: str, out: str, opts: ExportOptions, storage_options: Any) -> str:
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
            storage_options=storage_options,
            progress=False,
            format=opts.format,
            out_storage_options=opts.out_storage_options,
            sync_files=opts.sync_files,
        )
        return out


def _release(lanes: tuple[Lane, Lane], gate: StagingGate, join: bool = False, tier: FastTierPart | None = None) -> None:
    """(close, or the Checkpointer dropped) End the lanes' threads once their work is done (``join``: wait),
    then ``tier``'s saves' and drains' threads; the staging gate leaves the step hook."""
    for lane in lanes:
        lane.stop(join)
    if tier is not None:
        tier.state.close()
    gate.close()

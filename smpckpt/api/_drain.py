"""A Checkpointer's fast tier (:class:`~smpckpt.FastTier`; README, "Tiered checkpoints"),
:class:`FastTierPart`: each save into the nodes' fast tiers (``_fast_save``), every ``durable_every``-th
one drained to ``path`` on the Checkpointer's drain lane (below), and resumes from either tier
(``_fast_resume``). It owns what the tier remembers between saves (:class:`~smpckpt.api._tiers.TierState`).

The drain: a tiered save copied from the fast tier's files to the durable root ``path``, on the
Checkpointer's drain lane, committed there as any partial checkpoint (same files, same manifest bytes).

Which rank does what ("all" = every rank, on the drain thread with a gloo group of its own)::

    copy            (all)     the files assigned to this rank (its own, or -- a drain retried after a lost
                              node -- those its node holds for a lost one), from its node's fast-tier
                              folder to ``{path}/{tag}_partial`` (never staged from the model again);
                              agreed across ranks
    commit          (rank 0)  nothing committed there yet; every file at its size; the metadata, the
                              manifest (create-if-absent: the commit), the stock ``.metadata``
    publish_newest  (rank 0)  ``{path}/newest`` := tag
    retain          (rank 0)  ``num_kept_partial_checkpoints`` over ``path``

A kill during the drain leaves ``path`` as it was (uncommitted files at most: never taken as a
checkpoint, removed by ``remove_uncommitted_older_than`` or ``smpckpt prune``); the fast tier still
holds the checkpoint, and keeps it (fast-tier retention never removes a save due for the durable tier
before a drain as new committed); the restarted job's next save drains it again
(:class:`~smpckpt.api._fast_save.PendingDrain`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from smpckpt.api._async import GlooGroups, Lane
from smpckpt.api._dist import DistContext, peer_failures
from smpckpt.api._fast_resume import Loaded, choose_tier, load_tiered
from smpckpt.api._fast_save import TierPlan, plan_tier_save, retain_fast, save_fast
from smpckpt.api._resume import ResumeRequest
from smpckpt.api._save import SaveRequest, publish_newest, retain
from smpckpt.api._tiers import TierState
from smpckpt.api.options import FastTier
from smpckpt.catalog.retention import SequenceCounter, partial_url
from smpckpt.errors import CheckpointError, CheckpointExists
from smpckpt.storage.backends._folder import Folder
from smpckpt.storage.backends._fs import is_local, join, open_fs, read_bytes_or_none
from smpckpt.storage.backends._sinks import DEFAULT_PART_SIZE, open_sink
from smpckpt.storage.format.commit import commit as commit_in
from smpckpt.storage.format.commit import settle_uncommitted_folder
from smpckpt.storage.format.manifest import MANIFEST_NAME, Manifest, probe
from smpckpt.storage.tier import PreparedCommit

__all__ = ["FastTierPart", "drain", "copiers"]

log = logging.getLogger("smpckpt.api")

_PART = DEFAULT_PART_SIZE  # bytes per read from the fast tier and per S3 part (the writers' default part size)
# files copied at once: local and shared filesystems gain little beyond a few streams; object stores
# want many requests in flight (the fast tier sized these files to about one request each)
_FILES_AT_ONCE = MappingProxyType({True: 4, False: 16})


class FastTierPart:
    """The fast tier of one Checkpointer: its options, its memory between saves, and the Checkpointer's
    gloo groups, save numbers and drain lane it works with."""

    def __init__(self, options: FastTier, groups: GlooGroups, counter: SequenceCounter, drain_lane: Lane) -> None:
        self.options, self.groups, self.counter, self.drain_lane = options, groups, counter, drain_lane
        self.state = TierState()

    def plan(self, req: SaveRequest, ctx: DistContext) -> TierPlan:
        """(all ranks, the caller's thread) What this save is in the fast tier (``_fast_save``)."""
        return plan_tier_save(req, ctx, self)

    def save(self, req: SaveRequest, state: dict[str, Any], extra: dict[str, Any], tier: TierPlan) -> None:
        """(all ranks) The fast tiers, then (every ``durable_every``-th save, or a save whose drain never
        committed) the drain, on the drain lane."""
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
            self._drain(req, tier, lambda: drain(req, tier, prepared))
        elif tier.retry is not None:
            retry = tier.retry
            rreq = dataclasses.replace(req, tag=retry.tag, url=partial_url(req.root, retry.tag))
            if DistContext(req.process_group).is_coordinator:
                message = (
                    f"checkpoint {retry.tag!r} (save {retry.seq}) was due for the durable tier and its drain never "
                    f"committed (a job stopped while draining?): draining it to {rreq.url} again, in the background"
                )
                log.warning(message)
                warnings.warn(message, stacklevel=5)
            self._drain(rreq, tier, lambda: drain(rreq, tier, retry.prepared, seq=retry.seq, held_by=retry.held_by))

    def _drain(self, req: SaveRequest, tier: TierPlan, copy: Any) -> None:
        """Hold ``req``'s tag in the fast tier while the drain lane runs ``copy()``."""
        self.state.hold(req.tag)

        def work() -> None:
            try:
                with peer_failures(DistContext(tier.drain_group), f"draining checkpoint {req.tag!r} to {req.url}"):
                    copy()
            finally:
                self.state.release(req.tag)

        self.drain_lane.submit(req.tag, work)

    def resume(self, req: ResumeRequest, ctx: DistContext) -> Loaded | None:
        """(all ranks) The newest checkpoint complete across the fast tiers or committed in ``path``,
        loaded (``_fast_resume``); ``None`` when neither tier holds one."""
        return load_tiered(req, ctx, choose_tier(req, ctx, self), self)


def copiers(manifest: Manifest, held_by: Mapping[str, Sequence[int]] | None) -> dict[str, int]:
    """Which rank copies each data file: the rank that wrote it when its node holds it (always, right
    after the save), else the least loaded rank whose node holds it (``held_by``: a retried drain)."""
    load: dict[int, int] = {}
    out = {}
    for f in manifest.files:
        holders = list(held_by.get(f.name, ())) if held_by is not None else [f.rank]
        if not holders:
            raise CheckpointError(f"no node's fast tier holds {f.name}: the drain cannot copy it")
        rank = f.rank if f.rank in holders else min(holders, key=lambda r: (load.get(r, 0), r))
        load[rank] = load.get(rank, 0) + f.size
        out[f.name] = rank
    return out


def drain(
    req: SaveRequest,
    tier: TierPlan,
    prepared: PreparedCommit,
    *,
    seq: int | None = None,
    held_by: Mapping[str, Sequence[int]] | None = None,
) -> None:
    """(all ranks, the drain thread, on ``tier.drain_group``) Copy, commit, point ``newest``, apply
    retention (module docstring). ``req``'s tag is the one drained, from this node's folder of it in
    ``tier.job``; ``seq``: its save number (default: ``tier``'s); ``held_by``: who holds each file
    (default: every rank its own)."""
    started, group = time.monotonic(), tier.drain_group
    dctx = DistContext(group)
    manifest = prepared.parsed()
    fs, path = open_fs(req.url, req.storage_options)
    assigned = copiers(manifest, held_by)
    mine = [rec for rec in manifest.files if assigned[rec.name] == tier.nodes.rank]
    source = tier.folder_of(req.tag)  # this node's fast-tier copy of the tag
    sync = req.opts.sync_files

    def copy_one(name: str, folder: Folder) -> None:
        # create-only, in the folder opened without following links (storage/backends/_folder.py)
        sink = open_sink(fs, join(path, name), sync=sync, part_size=_PART, max_parts_in_flight=2, folder=folder)
        try:
            with open(os.path.join(source, name), "rb") as f:
                while chunk := f.read(_PART):
                    sink.write(memoryview(chunk))
            sink.commit()
        except BaseException:
            sink.abort()
            raise

    def copy_mine() -> None:
        with (
            Folder(fs, path, create=True) as folder,
            concurrent.futures.ThreadPoolExecutor(
                _FILES_AT_ONCE[is_local(fs)], thread_name_prefix="smpckpt-drain-copy"
            ) as pool,
        ):
            for done in [pool.submit(copy_one, rec.name, folder) for rec in mine]:
                done.result()
            if sync:
                folder.fsync_dirs()

    def commit() -> None:
        found = probe(fs, path, list_when_empty=False)
        if found.state in ("committed", "legacy"):
            raise CheckpointExists(f"{req.url} already holds a committed checkpoint; the drain of {req.tag!r} stops")
        with Folder(fs, path) as folder:  # the one commit protocol (storage/format/commit.py)
            commit_in(
                folder,
                req.url,
                manifest,
                prepared.manifest,
                sync=sync,
                metadata=prepared.metadata,
                stock_metadata=prepared.metadata,
            )

    try:
        if held_by is not None:
            dctx.on_coordinator(lambda: _clear_leftovers(fs, path, req.url, req.tag, prepared))
        dctx.all_ok(copy_mine)
        dctx.on_coordinator(commit)
    except BaseException:
        if _committed(fs, path, prepared) is False:  # unknown (None): nothing is removed blind
            with Folder(fs, path) as folder:
                failed = folder.remove([rec.name for rec in mine])
            if failed:
                log.warning("the failed drain of %s left %d file(s): %s", req.url, len(failed), failed[:5])
        raise
    tier.memory.note_durable(tier.seq if seq is None else seq)
    breq = dataclasses.replace(req, process_group=group)
    publish_newest(breq, dctx)
    log.info("drained checkpoint %r to %s in %.2fs", req.tag, req.url, time.monotonic() - started)
    retain(breq, dctx)
    if tier.nodes.is_leader:  # the fast tier kept this tag while it drained
        retain_fast(tier, None, release=req.tag)


def _clear_leftovers(fs: Any, path: str, url: str, tag: str, prepared: PreparedCommit) -> None:
    """(rank 0, a retried drain) The files of this very save a killed drain left in the uncommitted
    folder: they would refuse the copies (files are created exclusively). Only those names, nothing else."""
    found = probe(fs, path, list_when_empty=False)
    if found.state in ("committed", "legacy"):
        raise CheckpointExists(f"{url} already holds a committed checkpoint; the drain of {tag!r} stops")
    settle_uncommitted_folder(fs, path, url)
    names = [rec.name for rec in prepared.parsed().files] + [prepared.metadata_name]
    try:
        folder = Folder(fs, path)  # removes by exact name, never following a link
    except FileNotFoundError:
        return  # the killed drain never created the folder: nothing to clear
    with folder:
        failed = folder.remove(names)
    if failed:
        raise CheckpointError(f"{url}: could not remove what an earlier drain of {tag!r} left: {failed[:5]}")


def _committed(fs: Any, path: str, prepared: PreparedCommit) -> bool | None:
    """Whether this drain's manifest is in place; ``None`` when that cannot be read."""
    try:
        return read_bytes_or_none(fs, join(path, MANIFEST_NAME)) == prepared.manifest
    except Exception:  # noqa: BLE001 - unknown
        return None

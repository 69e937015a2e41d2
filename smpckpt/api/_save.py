"""The steps of :meth:`smpckpt.Checkpointer.save`, each over a :class:`SaveRequest` (validated and
compared across ranks by the Checkpointer): :func:`build_save_state` (all; rank 0 adds user_content and the
API record) -> :func:`write_checkpoint` (all; rank 0 commits) -> :func:`publish_newest` (rank 0, after the
commit) -> :func:`retain` (rank 0; failures only logged).

:class:`PlannerCache` keeps one save planner per kind ("partial", "full") across saves, memoising each
rank's local plan (``cache_scope="local"``: checked against the state's structure at every save, nothing
cached crosses ranks, so a rank planning afresh mixes safely with ranks that reuse theirs;
``benchmarks/RESULTS.md``). Between saves it holds no tensors, name map or process group
(:meth:`~smpckpt.planners.ParallelSavePlanner.release_state`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from smpckpt._version import VERSION
from smpckpt.api._dist import (
    CommonRequest,
    DistContext,
    describe_user_content,
    encode_user_content,
    get_rng_state,
    quiet_no_dist,
    train_state,
    translate_dcp,
)
from smpckpt.api.options import Retention, SaveOptions
from smpckpt.catalog.root import (
    SEQUENCE_KEY,
    ManifestCache,
    SequenceCounter,
    apply_retention,
    open_root,
    write_abandoned,
    write_newest,
)
from smpckpt.errors import CheckpointError
from smpckpt.model.layout import API_RECORD, RESERVED
from smpckpt.planners import ObjectBytes, ParallelSavePlanner
from smpckpt.storage import FsspecStorageWriter
from smpckpt.storage.write._base import FsspecWriterBase
from smpckpt.storage.write.writer import Workers

__all__ = [
    "SaveRequest",
    "manifest_extra",
    "build_save_state",
    "write_checkpoint",
    "run_save",
    "publish_newest",
    "retain",
    "PlannerCache",
]


log = logging.getLogger("smpckpt.api")


@dataclasses.dataclass(frozen=True)
class SaveRequest(CommonRequest):
    """Everything one partial save needs, validated and identical on every rank."""

    tag: str
    url: str
    user_content: Any
    opts: SaveOptions
    retention: Retention
    planners: PlannerCache = dataclasses.field(compare=False)  #: the Checkpointer's kept planners


def manifest_extra(api: str, tag: str, seq: int, user_content: Any, pickled: bool, **fields: Any) -> dict[str, Any]:
    """(rank 0) The manifest's ``extra`` of a save: the API record, the tag, its sequence number (``seq``,
    drawn by the job's :class:`~smpckpt.catalog.root.SequenceCounter`: what orders checkpoints), the save
    time, ``fields``, what user_content holds (``pickled``: needs ``allow_pickle``) and the versions."""
    now = time.time_ns()
    return {
        "api": api,
        "tag": tag,
        SEQUENCE_KEY: seq,
        "saved_at_ns": now,
        "saved_at": datetime.datetime.fromtimestamp(now / 1e9, datetime.timezone.utc).isoformat(),
        **fields,
        **describe_user_content(user_content, pickled),
        "smpckpt_version": VERSION,
        "torch_version": torch.__version__,
    }


def build_save_state(
    req: SaveRequest, ctx: DistContext, counter: SequenceCounter
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(all ranks, through ``ctx.all_ok``) This rank's state dict and, on rank 0, the manifest's ``extra``."""
    state = train_state(req.model, req.optimizers)
    if req.opts.save_rng:
        state[RESERVED.rng] = {RESERVED.rng_of(ctx.rank): get_rng_state()}
    if not ctx.is_coordinator:
        return state, {}
    payload, safe = encode_user_content(req.user_content, stacklevel=5)  # warns when it needs allow_pickle
    state[RESERVED.user_content] = ObjectBytes(payload)
    parts = sorted(k for k in (RESERVED.model, RESERVED.optim, RESERVED.rng) if k in state)
    seq = counter.next()
    extra = manifest_extra(
        API_RECORD,
        req.tag,
        seq,
        req.user_content,
        not safe,
        name_map=req.name_map is not None,
        parts=parts,
        rng=req.opts.save_rng,
        **counter.record(),  # what a roll-back abandoned (catalog.root)
    )
    return state, extra


def write_checkpoint(req: SaveRequest, state: dict[str, Any], extra: Mapping[str, Any]) -> None:
    """(all ranks) ``dcp.save``; returns only after rank 0 committed the manifest."""
    writer = FsspecStorageWriter(
        req.url,
        storage_options=req.storage_options,
        overwrite=req.opts.overwrite,
        manifest_extra=extra,
        format="torch_save" if req.opts.format == "torch_save" else "raw",  # SaveOptions allows no other
        sync_files=req.opts.sync_files,
    )
    run_save("partial", req, writer, state, f"saving checkpoint {req.url}", req.planners, req.opts.verify_replicas)


def run_save(
    kind: Literal["partial", "full"],
    common: CommonRequest,
    writer: FsspecWriterBase,
    state: dict[str, Any],
    action: str,
    planners: PlannerCache,
    verify_replicas: bool,
    dedup_tied: bool | None = None,
) -> None:
    """(all ranks) ``dcp.save`` with the kept planner of ``kind``; on failure the save's files are removed
    (a retry must not find them), then our error is raised. ``dedup_tied``: leave out a head tied to its
    embedding (full artifacts, as ``save_pretrained``)."""
    if isinstance(writer, FsspecStorageWriter):  # a full artifact's writer keeps its own threads
        writer.pool_of = planners.workers.pool
    try:
        with planners.kept(kind, common) as planner, quiet_no_dist():
            planner.verify_replicas = verify_replicas
            if dedup_tied is not None:
                planner.dedup_tied = dedup_tied
            dcp.save(state, storage_writer=writer, planner=planner, process_group=common.process_group)
    except CheckpointException as exc:
        try:
            writer.discard_failed_save(exc)
        except Exception:  # noqa: BLE001 - the save's own error is the one to raise
            log.warning("%s: removing the failed save's files failed", action, exc_info=True)
        raise translate_dcp(exc, action) from exc


def publish_newest(req: SaveRequest, ctx: DistContext, extra: Mapping[str, Any] | None = None) -> None:
    """(all ranks) Rank 0 points ``newest`` at the committed tag; its success or failure reaches all. A save
    that rolled back (``extra``, rank 0's) first leaves the root's copy of what it abandoned (catalog.root)."""

    def point() -> None:
        if extra:
            try:
                write_abandoned(req.root, req.storage_options, req.tag, extra)
            except (OSError, CheckpointError) as exc:  # the manifest holds the record too
                log.warning("%s: could not record the roll-back beside 'newest': %s", req.root, exc)
        fs, root_path = open_root(req.root, req.storage_options)
        write_newest(fs, root_path, req.tag, sync=req.opts.sync_files)

    try:
        ctx.on_coordinator(point)
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {req.url} is committed but {req.root}/newest could not be updated: {exc}"
        ) from exc


def retain(req: SaveRequest, ctx: DistContext, manifests: ManifestCache | None = None) -> None:
    """(rank 0) Retention and stale-debris removal (``manifests``: the Checkpointer's records of the root,
    catalog.root); never fails the committed save."""
    keep, stale_after = req.retention.num_kept_partial_checkpoints, req.retention.remove_uncommitted_older_than
    if not ctx.is_coordinator or (keep is None and stale_after is None):
        return
    try:
        result = apply_retention(
            req.root,
            keep,
            storage_options=req.storage_options,
            protected={req.tag},
            just_saved=req.tag,
            uncommitted_older_than=stale_after,
            cache=manifests,
        )
    except Exception as exc:  # noqa: BLE001 - retention never fails a committed save
        log.warning("retention after saving %s failed (nothing else affected): %s", req.url, exc)
        return
    if result.removed:
        log.info("retention kept %s checkpoint(s); removed %s", keep, list(result.removed))
    if result.removed_uncommitted or result.aborted_uploads:
        log.info(
            "removed stale uncommitted folders %s and aborted %d multipart upload(s)",
            list(result.removed_uncommitted),
            len(result.aborted_uploads),
        )


class PlannerCache:
    """The save planners one Checkpointer keeps, one per kind (a planner in use is taken out), and the
    threads writing every save's files (``workers``, ended by its close: threads new at each save left
    glibc's per-thread arenas holding their freed buffers, README "Tiered checkpoints", Memory)."""

    def __init__(self, workers: Workers | None = None) -> None:
        self._lock = threading.Lock()  # the caller's saves and the background save's
        self._kept: dict[str, ParallelSavePlanner] = {}
        self.workers = workers or Workers("smpckpt-write")

    @contextlib.contextmanager
    def kept(self, kind: str, req: CommonRequest) -> Iterator[ParallelSavePlanner]:
        """(all ranks) The kept planner for ``kind`` scoped to ``req`` (a new one when none is free), kept
        again without this save's tensors or scope once the save ends."""
        with self._lock:
            planner = self._kept.pop(kind, None)
        if planner is None:
            planner = ParallelSavePlanner(**req.planner_args(), cache_scope="local")
        else:
            planner.rescope(**req.planner_args())
        try:
            yield planner
        finally:
            planner.release_state(scope=True)
            with self._lock:
                self._kept[kind] = planner

"""``FsspecStorageWriter``: DCP StorageWriter for local disk, shared filesystems, S3 and memory://.

Call order inside ``dcp.save`` (as in DCP's ``StorageWriter`` docstring; "all" = every rank)::

    0) (all)         reset(checkpoint_id)            only when dcp.save gets checkpoint_id=
    1) (all)         storage_meta()
    2) (all)         set_up_storage_writer(is_coordinator, rank=, use_collectives=)
    3) (all)         prepare_local_plan(plan)         nothing to do: no I/O on every rank
    4) (coordinator) prepare_global_plan(plans)       overwrite check (one GET), new save id -> every plan
    5) (all)         write_data(plan, planner)        this rank's data files, durable before returning
    6) (coordinator) finish(metadata, results)        .metadata.<id>, then the manifest (the commit:
                                                      exclusive unless overwrite=True), then the stock
                                                      .metadata copy, then removal of the previous
                                                      generation's files

DCP runs 6) only when every rank succeeded in 5), so a failed rank leaves no manifest and the folder
keeps its previous committed generation (or stays uncommitted); every rank gets the error, and then
``discard_failed_save()`` (the API calls it) removes what the rank wrote for the failed save.

Two saves racing on one folder without ``overwrite``: both pass the check in 4), but the commit is
create-if-absent (a hard link on POSIX, ``If-None-Match: *`` on S3), so exactly one commits; the
other removes its own files and fails with :class:`~smpckpt.errors.CheckpointExists`.

Data files are named per save id, so an overwrite writes a new generation beside the old one. The
manifest swap is the commit; our reader follows the manifest to its own generation's metadata copy,
so a crash between writing ``.metadata`` and the manifest still loads the old generation.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import pickle
from collections.abc import Mapping
from typing import Any, Literal

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from smpckpt._checks import check_flag, check_int
from smpckpt._gc import gc_paused
from smpckpt.errors import CheckpointError, CheckpointExists
from smpckpt.storage.backends._fs import (
    create_bytes_exclusive,
    is_local,
    join,
    write_bytes_atomic,
)
from smpckpt.storage.backends._location import FsspecLocation
from smpckpt.storage.backends._prefixes import PrefixOption, resolve
from smpckpt.storage.backends._sinks import Sink, open_sink
from smpckpt.storage.backends._threads import default_write_threads
from smpckpt.storage.format import _names, _wire
from smpckpt.storage.format._checksum import DEFAULT_BLOCK_SIZE, hash_bytes
from smpckpt.storage.format._safe_pickle import load_metadata
from smpckpt.storage.format._state import probe
from smpckpt.storage.format.manifest import Manifest, MetadataRecord, extra_with_layout_record
from smpckpt.storage.full._commit import (
    artifact_records,
    begin_full_save,
    clear_for_full_save,
    commit_full,
    results_of,
    settle_uncommitted_folder,
    whole_tensor_metadata,
)
from smpckpt.storage.full._gather import gather_rank
from smpckpt.storage.full._marker import MarkerRefresher
from smpckpt.storage.full._plan import ArtifactLayout, RankFullData
from smpckpt.storage.full._write import write_rank
from smpckpt.storage.full.options import FullOptions
from smpckpt.storage.write._commit import after_commit, check_data_files
from smpckpt.storage.write._failed_save import (
    FailedSaveFiles,
    commit_uncertain,
    committed_by,
    discard_generation,
    folder_is_new,
    raise_commit_failure,
)
from smpckpt.storage.write._rank_files import RankPlanData, write_partial_rank
from smpckpt.storage.write._write_file import PART_FILL, write_file

__all__ = ["FsspecStorageWriter"]

log = logging.getLogger(__name__)


class FsspecStorageWriter(FsspecLocation, StorageWriter):
    """Write a DCP checkpoint to ``path`` (any fsspec URL) with checksums and a commit manifest.

    Args:
        path: folder or URL (``/data/ckpt``, ``file://...``, ``s3://bucket/ckpt``, ``memory://ckpt``).
        storage_options: fsspec filesystem options (S3: ``key``, ``secret``, ``client_kwargs``...);
            kept across :meth:`reset`.
        overwrite: replace a committed checkpoint at ``path`` (the previous generation's files are
            removed once the new one has committed); otherwise the save fails with
            :class:`~smpckpt.errors.CheckpointExists` (checked once, by the coordinator).
        format: ``"raw"`` (tensor bytes at recorded offsets: fast, range-readable; needs our reader)
            or ``"torch_save"`` (DCP's own per-item records; stock ``dcp.load`` reads it).
        sync_files: fsync each local data file, the metadata, the manifest and their directory before
            reporting success. ``False`` is faster but a power loss can lose a "committed" save.
            Object stores ignore it (an object is durable once its upload completes).
        thread_count: data files written concurrently per rank. On local/POSIX paths each rank's
            items are split into at most this many files; on object stores into at least this many
            (see ``object_file_size``). Default: 4, locally fewer when this node's ranks
            (``LOCAL_WORLD_SIZE``) times 4 exceed its CPUs (``smpckpt.storage.backends._threads``).
        block_size: checksum block size in bytes.
        part_size: S3 multipart part size (at least 16 MiB).
        max_parts_in_flight: S3 parts uploading concurrently per file (bounds memory per file to
            ``max_parts_in_flight * part_size``); see ``thread_count``.
        object_file_size: object stores, partial mode: each rank's data goes into files of about this
            many bytes. Default (``None``): 85 % of ``part_size``, so nearly every file is one
            ``PutObject`` -- no multipart create/complete requests, no server-side concatenation --
            with ``thread_count * max_parts_in_flight`` files uploading at once. At most 256 files
            per rank: a larger rank gets larger (multipart) files, ``thread_count`` at a time. ``0``:
            ``thread_count`` files per rank (fewer, larger objects; multipart beyond one part). A
            larger ``part_size`` gives fewer, larger one-request files (S3 takes up to 5 GiB each).
        manifest_extra: JSON-serialisable mapping recorded under ``"extra"`` in the manifest (the API
            layer records layout and user info here); also settable with :meth:`set_manifest_extra`.
        mode: ``"partial"`` (every rank writes its own shards into its own files) or ``"full"`` (one
            consolidated safetensors artifact: every tensor full-size under its global name; see
            :class:`FullOptions`). On POSIX paths every rank writes its shards at their offsets; on
            object stores each file is streamed by one owner rank that receives the other ranks'
            shard bytes tensor by tensor. Its file names are fixed, so it never overwrites a committed
            checkpoint, even with ``overwrite=True``.
        full: layout options of full mode (shard size, dtype cast, translation, ``config.json``).
        process_group: the group ``dcp.save`` runs on (default: the default group); full mode on object
            stores sends shard bytes to each file's owner rank over it.
        prefix_strategy: where data files go inside the folder (partial mode). ``"auto"`` (default):
            directly in the folder on local/POSIX paths, one hex prefix folder per file on object
            stores (``<folder>/<p>/<name>``, neighbouring files differing in the first character, so a
            large save spreads over many S3 prefixes); ``"flat"``, ``"hex"``, ``"binary"`` or a
            :class:`~smpckpt.storage.PrefixStrategy`. The prefix is part of each file's recorded name:
            readers and tools need no setting.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        overwrite: bool = False,
        format: Literal["raw", "torch_save"] = "raw",
        sync_files: bool = True,
        thread_count: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        part_size: int = 32 << 20,
        max_parts_in_flight: int = 4,
        object_file_size: int | None = None,
        manifest_extra: Mapping[str, Any] | None = None,
        mode: Literal["partial", "full"] = "partial",
        full: FullOptions | None = None,
        process_group: Any = None,
        prefix_strategy: PrefixOption = "auto",
    ) -> None:
        super().__init__()
        if mode not in ("partial", "full"):
            raise ValueError(f"mode must be 'partial' or 'full', got {mode!r}")
        if full is not None and not isinstance(full, FullOptions):
            raise TypeError(f"full must be a FullOptions, got {type(full).__name__}")
        if full is not None and mode != "full":
            raise ValueError("full= options apply to mode='full' only")
        self.mode = mode
        self.process_group = process_group
        self.full = full if full is not None else FullOptions()
        if format not in ("raw", "torch_save"):
            raise ValueError(f"format must be 'raw' or 'torch_save', got {format!r}")
        check_flag("overwrite", overwrite)
        check_flag("sync_files", sync_files)
        check_int("thread_count", thread_count, minimum=1, optional=True)
        check_int("block_size", block_size, minimum=4096)
        check_int("part_size", part_size, minimum=5 << 20)  # S3's smallest part but the last
        check_int("max_parts_in_flight", max_parts_in_flight, minimum=1)
        self.storage_options = dict(storage_options or {})
        self.overwrite = overwrite
        self.format = format
        self.sync_files = sync_files
        self.block_size = block_size
        self.part_size = part_size
        self.max_parts_in_flight = max_parts_in_flight
        if object_file_size is None:
            object_file_size = int(part_size * PART_FILL)
        if not isinstance(object_file_size, int) or not (object_file_size == 0 or object_file_size >= 1 << 20):
            raise ValueError(f"object_file_size must be None, 0 or at least 1 MiB, got {object_file_size!r}")
        self.object_file_size = object_file_size
        self.prefix_strategy = prefix_strategy
        resolve(prefix_strategy, local=True)  # fail on a bad option now, not inside dcp.save
        self._extra: dict[str, Any] = {}
        if manifest_extra is not None:
            self.set_manifest_extra(manifest_extra)
        self._used_save_ids: set[str] = set()
        self._open(path)
        self.thread_count = thread_count or default_write_threads(is_local(self.fs))

    # -- configuration ----------------------------------------------------------------------------
    def _open(self, path: str | os.PathLike[str]) -> None:
        if getattr(self, "_marker", None) is not None:  # reset() without the last save's discard
            self._stop_marker()
        super()._open(path)
        self._marker: MarkerRefresher | None = None  # full mode, coordinator: refreshes the in-progress marker
        self.is_coordinator = False
        self.rank = 0
        self._save_id: str | None = None
        self._old_files: list[str] = []
        self._layout: ArtifactLayout | None = None  # full mode: what prepare_global_plan laid out
        self._attempt = FailedSaveFiles()  # this rank's files of the save under way

    def set_manifest_extra(self, extra: Mapping[str, Any]) -> None:
        """Replace the JSON recorded under ``"extra"`` in the next manifest (must be JSON-serialisable)."""
        try:
            self._extra = json.loads(json.dumps(dict(extra)))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"manifest_extra must be JSON-serialisable: {exc}") from exc

    # -- StorageWriter protocol (reset, checkpoint_id, validate_checkpoint_id: FsspecLocation) -----------
    def storage_meta(self) -> StorageMeta | None:
        self._attempt = FailedSaveFiles()  # DCP's first call of every save: nothing of it written yet
        return StorageMeta(checkpoint_id=self.url)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """(all ranks) Refuses modes where more than one rank would act as coordinator."""
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)
        multi_rank = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if multi_rank and kwargs.get("use_collectives", True) is False:
            raise CheckpointError(
                "FsspecStorageWriter does not support use_collectives=False in a multi-rank job: every rank "
                "would act as coordinator and commit its own manifest"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # Deliberately no I/O here: at scale, N ranks probing the folder (HEAD/LIST) is what throttles S3.
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """(coordinator) Overwrite check and a fresh save id for this generation, sent to every rank.
        Full mode also lays out the artifact, creates its files and tells each rank where its boxes go."""
        if self.mode == "full":
            return self._prepare_full(plans)
        found = probe(self.fs, self.path, list_when_empty=False)
        if found.state in ("committed", "legacy") and not self.overwrite:
            raise CheckpointExists(
                f"{self.url} already holds a {found.state} checkpoint; pass overwrite=True to replace it"
            )
        self._old_files = found.generation_files() if found.state in ("committed", "legacy") else []
        if found.state not in ("committed", "legacy"):
            settle_uncommitted_folder(self.fs, self.path, self.url)
        self._save_id = _names.new_save_id()
        prefixes = resolve(self.prefix_strategy, local=is_local(self.fs))
        new_folder = folder_is_new(self.fs, self.path)
        return [
            dataclasses.replace(p, storage_data=RankPlanData(self._save_id, i, len(plans), prefixes, new_folder))
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """(all ranks) Write this rank's items; every file is complete and durable when this returns."""
        fut: Future[list[WriteResult]] = Future()
        try:
            results = self._write_rank(plan, planner)
            fut.set_result(_wire.pack_results(results) if _wire.crosses_ranks(self.process_group) else results)
        except BaseException as exc:  # noqa: BLE001 - handed to DCP through the future
            fut.set_exception(exc)  # type: ignore[arg-type]  # torch types it as the result type
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """(coordinator) Write metadata, then the manifest (the commit), then drop the old generation."""
        save_id = self._save_id
        if save_id is None:
            raise CheckpointError("finish() called without prepare_global_plan() on this writer")
        if self.mode == "full":
            self._finish_full(save_id, metadata, results)
            return
        # An object per item of every rank, each dropped before the collector resumes: none lives on
        # into an old generation, where it would bring the next full collection nearer.
        with gc_paused():
            files, metadata.storage_data = _wire.committed_index(_wire.open_results(results))
            _wire.list_tied(metadata)
            md_bytes, extra = self._metadata_bytes(save_id, metadata)
        check_data_files(self.fs, self.path, self.url, files)
        md_record = self._write_generation_metadata(save_id, md_bytes)
        manifest = Manifest(
            save_id=save_id,
            kind="partial",  # each rank writes its own items
            data_format=self.format,
            metadata=md_record,
            files=tuple(sorted(files, key=lambda f: (f.rank, f.name))),
            world_size=len(results),
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            extra=extra,
        )
        try:
            self._write_manifest(manifest.to_bytes())
        except FileExistsError as exc:
            if not committed_by(self.fs, self.path, save_id):
                discard_generation(self.fs, self.path, manifest)
                raise CheckpointExists(
                    f"{self.url}: another save committed a checkpoint here while this one was writing; this "
                    "save's files were removed and the other checkpoint is untouched (pass overwrite=True to "
                    "replace it)"
                ) from exc
        except Exception as exc:
            raise_commit_failure(self.fs, self.path, self.url, save_id, exc)
        self._used_save_ids.add(save_id)
        after_commit(self.fs, self.path, self.url, manifest, md_bytes, self._old_files, sync=self.sync_files)

    def discard_failed_save(self, error: BaseException | None = None) -> list[str]:
        """(all ranks, after ``dcp.save`` raised ``error``; the API calls it) Remove what this rank wrote
        for the failed save (``_failed_save``: full mode, the coordinator); the paths not removed."""
        self._stop_marker()
        if commit_uncertain(error):
            log.warning("%s: the commit's outcome is unknown; the failed save's files are left", self.url)
            return []
        return self._attempt.discard(self.fs, self.path, self.url, full=self.mode == "full")

    def _stop_marker(self) -> None:
        """(full mode, coordinator) Stop refreshing the in-progress marker (``_full_marker``)."""
        marker, self._marker = self._marker, None
        if marker is not None:
            marker.stop()

    def _metadata_bytes(self, save_id: str, metadata: Metadata) -> tuple[bytes, dict[str, Any]]:
        """(coordinator, both modes) The metadata pickled, checked with our allow-list, and the manifest's
        ``extra``; then what ``dcp.save`` returns (and broadcasts) becomes views of those bytes."""
        meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta = dataclasses.replace(meta, checkpoint_id=self.url, save_id=save_id)
        with gc_paused():  # pickling and the check below each make objects per item
            md_bytes = pickle.dumps(_wire.with_plain_mappings(metadata), protocol=pickle.HIGHEST_PROTOCOL)
            # Our reader (and any careful reader) loads .metadata with an allow-list; fail the save
            # now, before the commit, rather than produce a checkpoint nobody can load safely.
            load_metadata(md_bytes, where="metadata being written")
            extra = extra_with_layout_record(self._extra, metadata)
            _wire.lean_returned_metadata(metadata, md_bytes, where=f"{self.url} (metadata of save {save_id})")
        return md_bytes, extra

    def _write_generation_metadata(self, save_id: str, md_bytes: bytes) -> MetadataRecord:
        """(coordinator, both modes) The metadata under this generation's name; its record goes into the manifest."""
        gen_name = _names.generation_metadata_name(save_id)
        self._attempt.add(gen_name)
        self._write_metadata(gen_name, md_bytes)
        return MetadataRecord(gen_name, len(md_bytes), hash_bytes(md_bytes))

    # -- seams (overridden by fault-injection tests) ---------------------------------------------------
    def _write_metadata(self, gen_name: str, md_bytes: bytes) -> None:
        # the directory fsync comes with the manifest's, in the same folder
        write_bytes_atomic(self.fs, join(self.path, gen_name), md_bytes, sync=self.sync_files, sync_dir=False)

    def _write_manifest(self, data: bytes) -> None:
        """The commit. Without ``overwrite`` it is exclusive: ``FileExistsError`` when another save
        committed first. With ``overwrite`` it atomically replaces the previous manifest."""
        path = join(self.path, _names.MANIFEST_NAME)
        if self.overwrite:
            write_bytes_atomic(self.fs, path, data, sync=self.sync_files)
        else:
            create_bytes_exclusive(self.fs, path, data, sync=self.sync_files)

    def _open_sink(self, name: str) -> Sink:
        """A data file's sink (partial mode; full mode on object stores). It may borrow: write_file and
        gather_rank pass views of the resolved tensors (or of buffers made for that write) and never
        change them before the sink's commit, so S3 parts go out without a copy."""
        self._attempt.add(name)
        return self._sink(name, borrow=True)

    def _sink(self, name: str, *, borrow: bool = False) -> Sink:
        return open_sink(
            self.fs,
            join(self.path, name),
            sync=self.sync_files,
            part_size=self.part_size,
            max_parts_in_flight=self.max_parts_in_flight,
            borrow=borrow,
        )

    # -- data path --------------------------------------------------------------------------------------
    def _write_rank(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        data = plan.storage_data
        if isinstance(data, RankFullData) and data.files:
            written = gather_rank(
                self.path,
                data,
                plan.items,
                planner,
                fs=self.fs,
                open_sink=self._open_sink,  # borrows: see _open_sink and _full_gather
                process_group=self.process_group,
                sync=self.sync_files,
            )
            self._used_save_ids.add(data.save_id)
            return written
        if isinstance(data, RankFullData):
            written = write_rank(
                self.path,
                data,
                plan.items,
                planner,
                sync=self.sync_files,
                thread_count=self.thread_count,
                fs=self.fs,
                process_group=self.process_group,
            )
            self._used_save_ids.add(data.save_id)
            return written
        if not isinstance(data, RankPlanData):
            raise CheckpointError(
                "this plan was not prepared by FsspecStorageWriter.prepare_global_plan (got storage_data="
                f"{type(data).__name__}); was the plan cached or replaced by the planner?"
            )
        if data.save_id in self._used_save_ids:
            raise CheckpointError(
                f"save id {data.save_id} was already committed by this writer: the planner returned a cached "
                "plan; disable plan caching (enable_plan_caching=False) with FsspecStorageWriter"
            )
        self._attempt.begin(data.save_id, new_folder=data.new_folder)
        written = write_partial_rank(
            self.path,
            self.fs,
            data,
            list(plan.items),
            planner,
            write_file=self._write_file,
            thread_count=self.thread_count,
            object_file_size=self.object_file_size,
            max_parts_in_flight=self.max_parts_in_flight,
            sync=self.sync_files,
        )
        self._used_save_ids.add(data.save_id)
        return written

    def _write_file(self, name: str, items: list[WriteItem], planner: SavePlanner, rank: int) -> list[WriteResult]:
        return write_file(
            self._open_sink(name),
            name,
            items,
            planner,
            rank,
            raw=self.format == "raw",
            block_size=self.block_size,
        )

    # -- full mode (coordinator) ------------------------------------------------------------------------
    def _prepare_full(self, plans: list[SavePlan]) -> list[SavePlan]:
        if any(not p.usable for p in plans):
            raise CheckpointError(
                f"{self.url}: full mode needs every rank's full plan, not cached (empty) ones: use "
                "ParallelSavePlanner(..., cache_scope='local') (the next save with this planner plans afresh)"
            )
        new_folder = folder_is_new(self.fs, self.path)
        clear_for_full_save(self.fs, self.path, self.url)
        self._save_id = save_id = _names.new_save_id()
        out, layout = begin_full_save(
            self.fs, self.path, self.url, plans, self.full, save_id, self.process_group, sync=self.sync_files
        )
        self._marker = MarkerRefresher(self.fs, self.path, save_id, self)  # stopped at the commit or discard
        self._layout = layout
        self._attempt.begin(save_id, new_folder=new_folder, names=layout.names(self.full))
        return out

    def written_files(self) -> list[str]:
        """Full mode: the safetensors files of the artifact being written (after prepare_global_plan)."""
        return sorted(f.name for f in self._layout.files) if self._layout is not None else []

    def _finish_full(self, save_id: str, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        layout = self._layout
        if layout is None:
            raise CheckpointError("finish() called without prepare_global_plan() in full mode")
        records = artifact_records(self.fs, self.path, layout, self.full, sync=self.sync_files)
        with gc_paused():  # the check units of every rank, as objects: dropped before the collector resumes
            objects, checks = results_of(layout, _wire.open_results(results))
            whole_tensor_metadata(metadata, layout, checks)
            del checks
            md_bytes, extra = self._metadata_bytes(save_id, metadata)
        md_record = self._write_generation_metadata(save_id, md_bytes)
        records += objects
        manifest = Manifest(
            save_id=save_id,
            kind="full",
            data_format="raw",
            metadata=md_record,
            files=tuple(sorted(records, key=lambda f: f.name)),
            world_size=len(results),
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            extra=extra,
        )
        self._stop_marker()  # before the commit removes the marker: a late rewrite would bring it back
        commit_full(self.fs, self.path, self.url, manifest, sync=self.sync_files)
        self._used_save_ids.add(save_id)

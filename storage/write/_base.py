"""What both writers share (``FsspecStorageWriter``: partial checkpoints; ``FullArtifactWriter``: the full
artifact), as DCP's ``HuggingFaceStorageWriter`` builds on ``FsspecWriter``."""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import pickle
from collections.abc import Mapping
from typing import Any, Literal, Protocol, TypedDict, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from smpckpt._checks import check_flag, check_int
from smpckpt._gc import gc_paused
from smpckpt.errors import CheckpointError
from smpckpt.storage.backends._folder import Folder
from smpckpt.storage.backends._fs import FsspecLocation, default_write_threads, is_local
from smpckpt.storage.backends._sinks import DEFAULT_PART_SIZE, MIN_PART_SIZE, Sink
from smpckpt.storage.backends._staging import MIN_STAGING_BYTES, STAGING_BYTES, Stages
from smpckpt.storage.format import _names, _wire
from smpckpt.storage.format._checksum import hash_bytes
from smpckpt.storage.format._safe_pickle import load_metadata
from smpckpt.storage.format.commit import commit_uncertain
from smpckpt.storage.format.manifest import FileRecord, Manifest, MetadataRecord, extra_with_layout_record
from smpckpt.storage.write._failed_save import FailedSaveFiles

# MIN_PART_SIZE: S3's smallest multipart part, owned by storage/backends/_sinks.py (named here for callers)
__all__ = ["FsspecWriterBase", "MIN_PART_SIZE", "WriterOptions"]

log = logging.getLogger(__name__)


class _PlanData(Protocol):
    @property
    def save_id(self) -> str: ...


_Data = TypeVar("_Data", bound=_PlanData)


class WriterOptions(TypedDict, total=False):
    """The options both writers take (as ``**options``), handed on to :class:`FsspecWriterBase`."""

    storage_options: Mapping[str, Any] | None
    sync_files: bool
    thread_count: int | None
    part_size: int
    max_parts_in_flight: int
    manifest_extra: Mapping[str, Any] | None
    process_group: Any
    staging_bytes: int


class FsspecWriterBase(FsspecLocation, StorageWriter):
    """The shared half of both writers: the location, the options both take, the steps of ``dcp.save``
    that do not depend on the product, the metadata and manifest, data file sinks and the removal of a
    failed save's files. A subclass supplies ``prepare_global_plan``, ``finish`` and ``_write_rank``.

    Steps of ``dcp.save`` handled here ("all" = every rank): ``reset`` (all, ``FsspecLocation``),
    ``storage_meta`` (all: starts the record of this rank's files), ``set_up_storage_writer`` (all),
    ``prepare_local_plan`` (all: no I/O), ``write_data`` (all: the subclass's ``_write_rank``), and
    ``discard_failed_save`` (all, after ``dcp.save`` raised; the API calls it). The coordinator's
    ``finish`` builds its manifest with :meth:`_manifest` (the metadata from :meth:`_metadata_bytes`).

    Args:
        path: folder or URL (``/data/ckpt``, ``file://...``, ``s3://bucket/ckpt``, ``memory://ckpt``).
        storage_options: fsspec filesystem options (S3: ``key``, ``secret``, ``client_kwargs``...);
            kept across :meth:`reset`.
        sync_files: fsync each local data file, the metadata, the manifest and their directory before
            reporting success. ``False`` is faster but a power loss can lose a "committed" save.
            Object stores ignore it (an object is durable once its upload completes).
        thread_count: data files written concurrently per rank. Default: 4, locally fewer when this
            node's ranks (``LOCAL_WORLD_SIZE``) times 4 exceed its CPUs (``storage/backends/_fs.py``).
        part_size: S3 multipart part size (at least 5 MiB, S3's minimum; honoured as given).
        max_parts_in_flight: S3 parts uploading concurrently per file (bounds memory per file to
            ``max_parts_in_flight * part_size``).
        manifest_extra: JSON-serialisable mapping recorded under ``"extra"`` in the manifest (the API
            layer records layout and user info here); also settable with :meth:`set_manifest_extra`.
        process_group: the group ``dcp.save`` runs on (default: the default group).
        staging_bytes: the cap on host memory a rank's save uses above its state (default 128 MiB):
            tensors that cannot be written from their own memory -- CUDA tensors, strided views, and
            (full artifacts) dtype casts and transposed boxes -- are copied through a pool of buffers of
            this many bytes in all (pinned for CUDA), chunk by chunk, each buffer reused once its bytes
            are written and hashed (``storage/backends/_staging.py``). Contiguous CPU tensors are
            written in place and use none of it.
    """

    _KIND: Literal["partial", "full"]  # the manifest's "kind"; discard_failed_save follows it

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        sync_files: bool = True,
        thread_count: int | None = None,
        part_size: int = DEFAULT_PART_SIZE,
        max_parts_in_flight: int = 4,
        manifest_extra: Mapping[str, Any] | None = None,
        process_group: Any = None,
        staging_bytes: int = STAGING_BYTES,
    ) -> None:
        super().__init__()
        check_flag("sync_files", sync_files)
        check_int("thread_count", thread_count, minimum=1, optional=True)
        check_int("part_size", part_size, minimum=MIN_PART_SIZE)
        check_int("max_parts_in_flight", max_parts_in_flight, minimum=1)
        check_int("staging_bytes", staging_bytes, minimum=MIN_STAGING_BYTES)
        self.staging_bytes = staging_bytes
        #: (tests) hooks handed to the staging pool and the file streams of each save
        self._staging_hooks: Any = None
        self.storage_options = dict(storage_options or {})
        self.sync_files = sync_files
        self.part_size = part_size
        self.max_parts_in_flight = max_parts_in_flight
        self.process_group = process_group
        self._extra: dict[str, Any] = {}
        if manifest_extra is not None:
            self.set_manifest_extra(manifest_extra)
        self._used_save_ids: set[str] = set()
        self._open(path)
        self.thread_count = thread_count or default_write_threads(is_local(self.fs))

    def _open(self, path: str | os.PathLike[str]) -> None:
        super()._open(path)
        self.is_coordinator = False
        self.rank = 0
        self._save_id: str | None = None
        self._attempt = FailedSaveFiles()  # this rank's files of the save under way
        self._folder: Folder | None = None  # open while this rank writes its files, or commits

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
                f"{type(self).__name__} does not support use_collectives=False in a multi-rank job: every rank "
                "would act as coordinator and commit its own manifest"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # Deliberately no I/O here: at scale, N ranks probing the folder (HEAD/LIST) is what throttles S3.
        return plan

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """(all ranks) Write this rank's items; every file is complete and durable when this returns."""
        fut: Future[list[WriteResult]] = Future()
        try:
            results = self._write_rank(plan, planner)
            fut.set_result(_wire.pack_results(results) if _wire.crosses_ranks(self.process_group) else results)
        except BaseException as exc:  # noqa: BLE001 - handed to DCP through the future
            fut.set_exception(exc)  # type: ignore[arg-type]  # torch types it as the result type
        return fut

    def discard_failed_save(self, error: BaseException | None = None) -> list[str]:
        """(all ranks, after ``dcp.save`` raised ``error``; the API calls it) Remove what this rank wrote
        for the failed save (``_failed_save``); the paths not removed."""
        if commit_uncertain(error):
            log.warning("%s: the commit's outcome is unknown; the failed save's files are left", self.url)
            return []
        return self._attempt.discard(self.fs, self.path, self.url, full=self._KIND == "full")

    # -- for the subclasses --------------------------------------------------------------------------
    def _write_rank(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        raise NotImplementedError

    def _plan_data(self, plan: SavePlan, kind: type[_Data]) -> _Data:
        """(all ranks, in ``write_data``) The coordinator's ``storage_data`` for this rank, of ``kind``."""
        data = plan.storage_data
        name = type(self).__name__
        if not isinstance(data, kind):
            raise CheckpointError(
                f"this plan was not prepared by {name}.prepare_global_plan (got storage_data="
                f"{type(data).__name__}); was the plan cached or replaced by the planner?"
            )
        if data.save_id in self._used_save_ids:
            raise CheckpointError(
                f"save id {data.save_id} was already committed by this writer: the planner returned a "
                f"cached plan; disable plan caching (enable_plan_caching=False) with {name}"
            )
        return data

    def _metadata_bytes(self, save_id: str, metadata: Metadata) -> tuple[bytes, dict[str, Any]]:
        """(coordinator) The metadata pickled, checked with our allow-list, and the manifest's ``extra``;
        then what ``dcp.save`` returns (and broadcasts) becomes views of those bytes."""
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

    def _manifest(
        self,
        save_id: str,
        metadata: Metadata,
        files: list[FileRecord],
        world_size: int,
        data_format: Literal["raw", "torch_save"],
    ) -> tuple[Manifest, bytes]:
        """(coordinator, in ``finish``) The metadata written under this generation's name, and the
        manifest naming it and ``files``; the metadata's bytes (for the stock ``.metadata`` copy)."""
        md_bytes, extra = self._metadata_bytes(save_id, metadata)
        gen_name = _names.generation_metadata_name(save_id)
        self._attempt.add(gen_name)
        self._write_metadata(gen_name, md_bytes)
        manifest = Manifest(
            save_id=save_id,
            kind=self._KIND,
            data_format=data_format,
            metadata=MetadataRecord(gen_name, len(md_bytes), hash_bytes(md_bytes)),
            files=tuple(files),
            world_size=world_size,
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            extra=extra,
        )
        return manifest, md_bytes

    def _stages(self) -> Stages:
        """The staging pool of one rank's write step (``close()`` it when the step ends)."""
        hooks = self._staging_hooks
        return Stages(self.staging_bytes, on_wait=getattr(hooks, "on_wait", None))

    def _open_folder(self, *, create: bool = False) -> Folder:
        """This save's folder for one step (``with`` it; ``self._folder`` meanwhile, for the seams)."""
        return Folder(self.fs, self.path, create=create)

    # -- seams (overridden by fault-injection tests) ---------------------------------------------------
    def _write_metadata(self, gen_name: str, md_bytes: bytes) -> None:
        """The generation's metadata, created (never over another file); its folder's fsync comes with
        the manifest's."""
        folder = self._folder or self._open_folder()
        try:
            folder.create(gen_name, md_bytes, sync=self.sync_files)
        finally:
            if folder is not self._folder:
                folder.close()

    def _open_sink(self, name: str) -> Sink:
        """A data file's create-only sink in this save's folder, recorded as this save's. It may borrow:
        ``write_file`` and ``gather_rank`` pass views of the resolved tensors (or of buffers made for that
        write) and never change them before the sink's commit, so S3 parts go out without a copy."""
        if self._folder is None:
            raise CheckpointError(f"{self.url}: a data file opened outside this rank's write step")
        self._attempt.add(name)
        return self._folder.sink(
            name,
            sync=self.sync_files,
            part_size=self.part_size,
            max_parts_in_flight=self.max_parts_in_flight,
            borrow=True,
        )

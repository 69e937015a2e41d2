"""What both writers share (``FsspecStorageWriter``, ``FullArtifactWriter``): the steps of ``dcp.save``
that do not depend on the product (:class:`FsspecWriterBase`); the removal of what a failed save wrote
(:class:`FailedSaveFiles`; what goes and when nothing does: README, "A failed save cleans up after
itself"; ``dcp.save`` reports a failure only once every rank's ``write_data`` and the coordinator's
``finish`` returned, so nothing is still being written); and the compact forms of what ``dcp.save``
sends between ranks once the data is written, unpickled with the cyclic collector running (README, "What
crosses ranks is kept lean"): each rank's results as one pickle (:func:`pack_results`, opened with the
collector paused: :func:`open_results`), the returned Metadata's mappings as read-only views of the
committed file's bytes, decoded on first use (:func:`lean_returned_metadata`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import pickle
from collections.abc import Iterator, Mapping
from typing import Any, Literal, Protocol, TypedDict, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from smpckpt._checks import check_flag, check_int
from smpckpt._gc import gc_paused
from smpckpt.errors import CheckpointError
from smpckpt.model.layout import MANIFEST_KEY, LayoutRecord
from smpckpt.storage.backends._folder import Folder, remove_files
from smpckpt.storage.backends._fs import FsspecLocation, default_write_threads, is_local, join, read_bytes_or_none
from smpckpt.storage.backends._sinks import DEFAULT_PART_SIZE, MIN_PART_SIZE, Sink
from smpckpt.storage.format._checksum import hash_bytes
from smpckpt.storage.format._safe_pickle import load_metadata
from smpckpt.storage.format._staging import MIN_STAGING_BYTES, STAGING_BYTES, Stages
from smpckpt.storage.format.commit import CommitUncertain, commit_uncertain
from smpckpt.storage.format.manifest import (
    WRITING_MARKER,
    FileRecord,
    Manifest,
    MetadataRecord,
    generation_metadata_name,
    marker_owner,
    probe,
)

# re-exported for callers: MIN_PART_SIZE (storage/backends/_sinks.py), CommitUncertain (storage/format/commit.py)
__all__ = ["FsspecWriterBase", "MIN_PART_SIZE", "WriterOptions", "CommitUncertain", "FailedSaveFiles"]
__all__ += ["commit_uncertain", "folder_is_new", "PackedResults", "crosses_ranks", "pack_results", "open_results"]
__all__ += ["committed_index", "list_tied", "CommittedMetadata", "CommittedView", "lean_returned_metadata"]

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
    """The shared half of both writers: the location, the options both take, the steps of ``dcp.save`` that
    do not depend on the product, the metadata and manifest, data file sinks and the removal of a failed
    save's files. A subclass supplies ``prepare_global_plan``, ``finish`` and ``_write_rank``.

    Steps handled here ("all" = every rank): ``reset``, ``storage_meta`` (starts the record of this
    rank's files), ``set_up_storage_writer``, ``prepare_local_plan`` (no I/O), ``write_data`` (the
    subclass's ``_write_rank``) and ``discard_failed_save`` (after ``dcp.save`` raised; the API calls it).
    The coordinator's ``finish`` builds its manifest with :meth:`_manifest`.

    Args:
        path: folder or URL (``/data/ckpt``, ``file://...``, ``s3://bucket/ckpt``, ``memory://ckpt``).
        storage_options: fsspec filesystem options (S3: ``key``, ``secret``, ``client_kwargs``...).
        sync_files: fsync each local file and their directory before reporting success (``False``: faster,
            but a power loss can lose a "committed" save). Object stores ignore it.
        thread_count: data files written concurrently per rank. Default: 4, locally fewer when this
            node's ranks (``LOCAL_WORLD_SIZE``) times 4 exceed its CPUs.
        part_size: S3 multipart part size (at least 5 MiB, S3's minimum).
        max_parts_in_flight: S3 parts uploading concurrently per file.
        manifest_extra: JSON-serialisable mapping recorded under ``"extra"`` in the manifest (also
            :meth:`set_manifest_extra`).
        process_group: the group ``dcp.save`` runs on (default: the default group).
        staging_bytes: the cap on host memory a rank's save uses above its state (default 128 MiB): what
            cannot be written from its own memory (CUDA tensors, strided views, casts) is copied through a
            pool of buffers of this many bytes in all (``storage/format/_staging.py``)."""

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
        self._keep(storage_options)
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
            fut.set_result(pack_results(results) if crosses_ranks(self.process_group) else results)
        except Exception as exc:  # noqa: BLE001 - handed to DCP through the future (a Ctrl-C, no Exception,
            # is raised for DCP to wrap: torch's Future refuses it, an AssertionError hid it)
            fut.set_exception(exc)  # type: ignore[arg-type]  # torch types it as the result type
        return fut

    def discard_failed_save(self, error: BaseException | None = None) -> list[str]:
        """(all ranks, after ``dcp.save`` raised ``error``) Remove this rank's files; those left."""
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
        """(coordinator) The metadata pickled and checked, and the manifest's ``extra``; ``metadata`` made lean."""
        meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta = dataclasses.replace(meta, checkpoint_id=self.url, save_id=save_id)
        with gc_paused():  # pickling and the check below each make objects per item
            for (
                field
            ) in _VIEW_FIELDS:  # a planner caching its plan may hand finish a Metadata a previous save left lean
                if isinstance(view := getattr(metadata, field), CommittedView):
                    setattr(metadata, field, dict(view))
            md_bytes = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
            # fail the save now rather than commit a checkpoint our allow-listed load would refuse
            load_metadata(md_bytes, where="metadata being written")
            record = LayoutRecord.json_in_metadata(metadata)  # the planner's, for listing tools
            extra = {**self._extra, MANIFEST_KEY: dict(record)} if record is not None else dict(self._extra)
            lean_returned_metadata(metadata, md_bytes, where=f"{self.url} (metadata of save {save_id})")
        return md_bytes, extra

    def _manifest(
        self,
        save_id: str,
        metadata: Metadata,
        files: list[FileRecord],
        world_size: int,
        data_format: Literal["raw", "torch_save"],
    ) -> tuple[Manifest, bytes]:
        """(coordinator, in ``finish``) The generation's metadata written and its manifest; its bytes."""
        md_bytes, extra = self._metadata_bytes(save_id, metadata)
        gen_name = generation_metadata_name(save_id)
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
        """(in ``finish``, the folder open) The generation's metadata, created (its folder's fsync comes with
        the manifest's)."""
        if self._folder is None:
            raise CheckpointError(f"{self.url}: the metadata written outside the commit")
        self._folder.create(gen_name, md_bytes, sync=self.sync_files)

    def _open_sink(self, name: str) -> Sink:
        """A data file's create-only sink in this save's folder, recorded as this save's. It may borrow: its
        callers never change what they pass before the sink's commit, so S3 parts go out without a copy."""
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


# -- a failed save's files --------------------------------------------------------------------------------
class FailedSaveFiles:
    """The files one rank wrote for one save, to remove if that save fails. Call order: a new instance per
    save (``storage_meta``) -> :meth:`begin` (partial: ``write_data``; full: the coordinator's
    ``prepare_global_plan``) -> :meth:`add` per file (writer threads too) -> :meth:`discard`."""

    def __init__(self) -> None:
        self.save_id: str | None = None
        self.names: list[str] = []
        self.new_folder = False  # the folder did not exist when the save began (local paths)

    def begin(self, save_id: str, *, new_folder: bool, names: tuple[str, ...] = ()) -> None:
        self.save_id, self.names, self.new_folder = save_id, list(names), new_folder

    def add(self, name: str) -> None:
        if self.save_id is not None:
            self.names.append(name)  # list.append is atomic: writer threads call this concurrently

    def discard(self, fs: Any, path: str, url: str, *, full: bool) -> list[str]:
        """Remove the recorded files (README, "A failed save cleans up after itself": when not); the paths that
        could not be removed (all of them when the folder's state cannot be read: nothing is removed blind)."""
        save_id, names = self.save_id, list(dict.fromkeys(self.names))
        self.save_id, self.names = None, []
        if save_id is None or not names:
            return []
        paths = [join(path, n) for n in names]
        try:
            found = probe(fs, path, list_when_empty=False)
            committed = found.manifest.save_id if found.manifest is not None else None
            marker = read_bytes_or_none(fs, join(path, WRITING_MARKER)) if full else None
        except (CheckpointError, OSError) as exc:
            log.warning(
                "%s: the failed save's %d file(s) were left: the folder could not be read (%s)", url, len(paths), exc
            )
            return paths
        if committed == save_id or (full and (committed is not None or marker_owner(marker) != save_id)):
            return []  # the commit landed (these files are the checkpoint), or another save took the folder
        failed = remove_files(fs, paths, within=path)
        if full and not failed:  # the marker keeps the folder recognisable as debris until the rest is gone
            failed = remove_files(fs, [join(path, WRITING_MARKER)])
        if failed:
            log.warning("%s: could not remove %d file(s) of the failed save: %s", url, len(failed), failed[:5])
        elif is_local(fs):
            if self.new_folder:
                # the rank that removes the last file succeeds; the others find it not empty yet
                with contextlib.suppress(OSError):
                    os.rmdir(path)
        return failed


def folder_is_new(fs: Any, path: str) -> bool:
    """(coordinator, before a save writes anything) Whether the save will make its folder (local paths)."""
    return is_local(fs) and not os.path.isdir(path)


# -- what crosses ranks once the data is written (the module docstring) ---------------------------------
#: Index of the one WriteResult that carries a rank's packed results (never stored).
PACKED_RESULTS_FQN = "\x00smpckpt.packed_results"


@dataclasses.dataclass(frozen=True)
class PackedResults:
    """One rank's write results as one pickle: ``storage_data`` of the single result it sends."""

    payload: bytes
    count: int


def crosses_ranks(process_group: dist.ProcessGroup | None) -> bool:
    """Whether DCP pickles results and Metadata between ranks (not in a one-process save)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1


def pack_results(results: list[WriteResult]) -> list[WriteResult]:
    """(every rank, end of ``write_data``) This rank's results as one result holding their pickle."""
    with gc_paused():
        payload = pickle.dumps(results, protocol=pickle.HIGHEST_PROTOCOL)
    total = sum(r.size_in_bytes for r in results)
    return [WriteResult(MetadataIndex(PACKED_RESULTS_FQN), total, PackedResults(payload, len(results)))]


def open_results(results: list[list[WriteResult]]) -> list[list[WriteResult]]:
    """(coordinator, ``finish``) Every rank's results, packed or not, as DCP would have delivered them (the
    payloads come through DCP's gather, which unpickles them anyway: no more trust than before)."""
    out: list[list[WriteResult]] = []
    with gc_paused():  # an object per item of every rank
        for rank, rank_results in enumerate(results):
            if len(rank_results) == 1 and isinstance(rank_results[0].storage_data, PackedResults):
                packed = rank_results[0].storage_data
                opened = pickle.loads(packed.payload)
                if not isinstance(opened, list) or len(opened) != packed.count:
                    raise CheckpointError(
                        f"rank {rank}'s packed write results hold {type(opened).__name__} "
                        f"(expected a list of {packed.count} WriteResult)"
                    )
                out.append(opened)
            else:
                out.append(rank_results)
    return out


def committed_index(results: list[list[WriteResult]]) -> tuple[list[FileRecord], dict[MetadataIndex, Any]]:
    """(coordinator, partial) The data files' records and the storage index, from every rank's results."""
    files: list[FileRecord] = []
    index: dict[MetadataIndex, Any] = {}
    for rank_results in results:
        for wr in rank_results:
            if isinstance(wr.storage_data, FileRecord):
                files.append(wr.storage_data)
            else:
                index[wr.index] = wr.storage_data
    return files, index


def list_tied(metadata: Metadata) -> None:
    """(coordinator, partial mode) Each tied key (``LayoutRecord.tied``, written once under its first key)
    gets that key's entries in ``state_dict_metadata`` and ``storage_data``, so stock readers load both."""
    record = LayoutRecord.from_metadata(metadata)
    tied = record.tied if record is not None else {}
    sdm, index = metadata.state_dict_metadata, metadata.storage_data
    for alias, first in tied.items():
        md = sdm.get(first)
        if md is None or alias in sdm or not hasattr(md, "chunks"):
            continue
        sdm[alias] = md
        for chunk in md.chunks:
            stored = index.get(MetadataIndex(first, chunk.offsets))
            if stored is not None:
                index[MetadataIndex(alias, chunk.offsets)] = stored


class CommittedMetadata:
    """The committed metadata file's bytes, decoded with the allow-list once, on first use. Pickles as those
    bytes, which the views share: a pickle of the Metadata carries them once."""

    def __init__(self, metadata_bytes: bytes, where: str) -> None:
        self._bytes = metadata_bytes
        self.where = where
        self._decoded: Metadata | None = None

    def __reduce__(self) -> tuple[Any, tuple[bytes, str]]:
        return (CommittedMetadata, (self._bytes, self.where))

    @property
    def decoded(self) -> bool:
        return self._decoded is not None

    def metadata(self) -> Metadata:
        if self._decoded is None:
            self._decoded = load_metadata(self._bytes, where=self.where)
        return self._decoded


class CommittedView(Mapping[Any, Any]):
    """One mapping field of the committed Metadata, read-only, decoded on first use."""

    def __init__(self, source: CommittedMetadata, field: str) -> None:
        if field not in _VIEW_FIELDS:
            raise ValueError(f"no committed view of Metadata.{field} (one of {_VIEW_FIELDS})")
        self._source = source
        self._field = field

    def __reduce__(self) -> tuple[Any, tuple[CommittedMetadata, str]]:
        return (CommittedView, (self._source, self._field))

    def _mapping(self) -> Mapping[Any, Any]:
        value = getattr(self._source.metadata(), self._field)
        return value if value is not None else {}

    def __getitem__(self, key: Any) -> Any:
        return self._mapping()[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._mapping())

    def __len__(self) -> int:
        return len(self._mapping())

    def __repr__(self) -> str:
        state = f"{len(self._mapping())} entries" if self._source.decoded else "not decoded yet"
        return f"CommittedView({self._field} of {self._source.where}, {state})"


_VIEW_FIELDS = ("state_dict_metadata", "storage_data", "planner_data")


def lean_returned_metadata(metadata: Metadata, metadata_bytes: bytes, where: str) -> None:
    """(coordinator, end of ``finish``) Turn the mappings of the Metadata ``dcp.save`` returns (and
    broadcasts) into views of the committed bytes; a field that is not a mapping is left as it is."""
    source = CommittedMetadata(metadata_bytes, where)
    for field in _VIEW_FIELDS:
        if isinstance(getattr(metadata, field), Mapping):
            setattr(metadata, field, CommittedView(source, field))

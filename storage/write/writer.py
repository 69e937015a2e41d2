"""``FsspecStorageWriter``: DCP StorageWriter of partial checkpoints (every rank its own shards) for local
disk, shared filesystems, S3 and memory://; it shares ``_base.FsspecWriterBase`` with the full artifact's
writer.

A failed save leaves no manifest (``_base.py``: its files go); the commit is ``storage/format/commit.py``'s
(of two saves racing on one folder exactly one commits; the other fails with
:class:`~smpckpt.errors.CheckpointExists`), and an overwrite writes a new generation beside the old one.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import math
import os
import threading
import warnings
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from smpckpt._checks import check_flag, check_int
from smpckpt._gc import forget_at_fork, gc_paused
from smpckpt.errors import CheckpointError, CheckpointExists, no_data, not_plain
from smpckpt.storage.backends._fs import FlatLayout, PrefixOption, PrefixStrategy, is_local, rank_cpus, resolve
from smpckpt.storage.backends._sinks import Sink
from smpckpt.storage.format._check_units import item_checks
from smpckpt.storage.format._checksum import DEFAULT_BLOCK_SIZE, BlockHasher
from smpckpt.storage.format._reading import cpu_bytes
from smpckpt.storage.format._staging import Stages, stage_kind
from smpckpt.storage.format.commit import commit, refuse_marked_overwrite, settle_uncommitted_folder
from smpckpt.storage.format.manifest import (
    MANIFEST_NAME,
    RAW_DESCRIPTOR,
    FileRecord,
    data_file_name,
    new_save_id,
    probe,
)
from smpckpt.storage.write._base import (
    FsspecWriterBase,
    WriterOptions,
    committed_index,
    folder_is_new,
    list_tied,
    open_results,
)
from smpckpt.storage.write._pipeline import FileStream

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["FsspecStorageWriter", "RankPlanData", "write_file", "split_items", "object_store_bins"]
__all__ += ["PART_FILL", "MAX_OBJECT_FILES", "FILE_RESULT_FQN", "Workers"]

#: options only this writer takes, with their defaults (the deprecated ``mode="full"`` refuses others)
_PARTIAL_ONLY: Mapping[str, Any] = MappingProxyType(
    {
        "overwrite": False,
        "format": "raw",
        "block_size": DEFAULT_BLOCK_SIZE,
        "object_file_size": None,
        "prefix_strategy": "auto",
        "hash_beside": None,
    }
)


@dataclasses.dataclass(frozen=True)
class RankPlanData:
    """What ``prepare_global_plan`` puts on each rank's plan (``SavePlan.storage_data``); never stored."""

    save_id: str
    rank: int
    world_size: int = 1
    #: the coordinator's strategy, so every rank lays out its files alike
    prefixes: PrefixStrategy = dataclasses.field(default_factory=FlatLayout)
    #: the folder did not exist when the save began (local paths): a failed save removes it once empty
    new_folder: bool = False


class FsspecStorageWriter(FsspecWriterBase):
    """Write a partial DCP checkpoint to ``path`` (any fsspec URL) with checksums and a commit manifest.

    Call order inside ``dcp.save``: :class:`~smpckpt.storage.write._base.FsspecWriterBase`'s, plus
    (coordinator) ``prepare_global_plan`` (overwrite check, one GET; a new save id to every plan) and
    ``finish`` (``.metadata.<id>``, the manifest: exclusive unless ``overwrite``; the stock ``.metadata``
    copy; the previous generation's files removed).

    Args (besides :class:`~smpckpt.storage.write._base.FsspecWriterBase`'s):
        overwrite: replace a committed checkpoint at ``path`` (its files go once the new one committed);
            otherwise :class:`~smpckpt.errors.CheckpointExists` (checked once, by the coordinator).
        format: ``"raw"`` (tensor bytes at recorded offsets: range-readable; needs our reader) or
            ``"torch_save"`` (DCP's own records; stock ``dcp.load`` reads it).
        block_size: checksum block size in bytes.
        object_file_size: object stores: each rank's files hold about this many bytes. ``None``: 85 % of
            ``part_size``, so nearly every file is one ``PutObject``, at most 256 files per rank (a larger
            rank gets multipart files); ``0``: ``thread_count`` files per rank. Local paths: at most
            ``thread_count`` files per rank.
        prefix_strategy: where data files go in the folder: ``"auto"`` (flat locally, a hex prefix folder
            per file on object stores), ``"flat"``, ``"hex"``, ``"binary"`` or a
            :class:`~smpckpt.storage.PrefixStrategy`; recorded in each file's name.
        hash_beside: records written in place are hashed beside their writes on a hash thread (``True``)
            or inline just before each write (``False``); ``None``: inline when the files written at once
            keep ``rank_cpus()`` busy. The digests are the same either way.
        mode, full: deprecated. ``mode="full", full=FullOptions(...)`` returns a
            :class:`~smpckpt.storage.FullArtifactWriter` (``DeprecationWarning``; a partial-only option
            set is refused; subclasses must derive from ``FullArtifactWriter``)."""

    _KIND = "partial"
    #: size data files as for a local folder / an object store regardless of ``path`` (None: as ``path``)
    _split_as_local: bool | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("mode", "partial") != "full":
            return super().__new__(cls)
        if cls is not FsspecStorageWriter:
            raise TypeError(f"{cls.__name__}: for a full artifact, subclass smpckpt.storage.FullArtifactWriter")
        from smpckpt.storage.full.writer import FullArtifactWriter  # the full room builds on this one

        warnings.warn(
            "FsspecStorageWriter(mode='full', full=...) is deprecated: use "
            "smpckpt.storage.FullArtifactWriter(path, full=FullOptions(...))",
            DeprecationWarning,
            stacklevel=2,
        )
        del kwargs["mode"]
        for name, default in _PARTIAL_ONLY.items():
            if name in kwargs and kwargs.pop(name) != default:
                raise ValueError(f"{name}= applies to partial checkpoints only; FullArtifactWriter takes none")
        return FullArtifactWriter(*args, **kwargs)

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        overwrite: bool = False,
        format: Literal["raw", "torch_save"] = "raw",
        block_size: int = DEFAULT_BLOCK_SIZE,
        object_file_size: int | None = None,
        mode: Literal["partial", "full"] = "partial",
        full: Any = None,
        prefix_strategy: PrefixOption = "auto",
        hash_beside: bool | None = None,
        **options: Unpack[WriterOptions],
    ) -> None:
        if mode not in ("partial", "full"):
            raise ValueError(f"mode must be 'partial' or 'full', got {mode!r}")
        if full is not None:
            raise ValueError(
                "full= is an option of the full artifact's writer: use smpckpt.storage.FullArtifactWriter(path, "
                "full=FullOptions(...)); FsspecStorageWriter writes partial checkpoints"
            )
        if format not in ("raw", "torch_save"):
            raise ValueError(f"format must be 'raw' or 'torch_save', got {format!r}")
        check_flag("overwrite", overwrite)
        if hash_beside is not None:
            check_flag("hash_beside", hash_beside)
        check_int("block_size", block_size, minimum=4096)
        if object_file_size is not None and (
            not isinstance(object_file_size, int) or not (object_file_size == 0 or object_file_size >= 1 << 20)
        ):
            raise ValueError(f"object_file_size must be None, 0 or at least 1 MiB, got {object_file_size!r}")
        resolve(prefix_strategy, local=True)  # fail on a bad option now, not inside dcp.save
        self.overwrite = overwrite
        self.format = format
        self.block_size = block_size
        self.prefix_strategy = prefix_strategy
        self.hash_beside = hash_beside
        super().__init__(path, **options)
        # derived from part_size once the base has checked it
        self.object_file_size = int(self.part_size * PART_FILL) if object_file_size is None else object_file_size
        #: a pool of at least n threads its owner keeps for every save (a Checkpointer's ``Workers.pool``:
        #: threads new at each save left glibc's arenas holding their freed buffers); ``None``: this write's own
        self.pool_of: Callable[[int], concurrent.futures.ThreadPoolExecutor] | None = None
        #: (coordinator) called before the commit; raising refuses it (the API's background saves given up on)
        self.before_commit: Callable[[], None] | None = None

    def _open(self, path: str | os.PathLike[str]) -> None:
        super()._open(path)
        self._old_files: list[str] = []
        self._replacing: bytes | None = None  # the manifest an overwrite replaces, as read
        self._hash_beside = False  # set per write step by _write_rank

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """(coordinator) Overwrite check and a fresh save id for this generation, sent to every rank."""
        found = probe(self.fs, self.path, list_when_empty=False)
        if found.state in ("committed", "legacy") and not self.overwrite:
            raise CheckpointExists(
                f"{self.url} already holds a {found.state} checkpoint; pass overwrite=True to replace it"
            )
        if found.state == "committed":
            refuse_marked_overwrite(self.fs, self.path, self.url)
        self._old_files = found.generation_files() if found.state in ("committed", "legacy") else []
        self._replacing = found.raw if self.overwrite else None
        if found.state not in ("committed", "legacy"):
            settle_uncommitted_folder(self.fs, self.path, self.url)
        self._save_id = new_save_id()
        prefixes = resolve(self.prefix_strategy, local=is_local(self.fs))
        new_folder = folder_is_new(self.fs, self.path)
        return [
            dataclasses.replace(p, storage_data=RankPlanData(self._save_id, i, len(plans), prefixes, new_folder))
            for i, p in enumerate(plans)
        ]

    def _committed_files(self, metadata: Metadata, results: list[list[WriteResult]]) -> tuple[str, list[FileRecord]]:
        """(coordinator, in ``finish``) This save's id and every rank's files; ``metadata`` gets its index."""
        save_id = self._save_id
        if save_id is None:
            raise CheckpointError("finish() called without prepare_global_plan() on this writer")
        # an object per item of every rank, each dropped before the collector resumes (none grows old)
        with gc_paused():
            files, metadata.storage_data = committed_index(open_results(results))
            list_tied(metadata)
        return save_id, files

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """(coordinator) The metadata, the commit, the stock copy and the old generation's removal."""
        if self.before_commit is not None:
            self.before_commit()
        save_id, files = self._committed_files(metadata, results)
        files = sorted(files, key=lambda f: (f.rank, f.name))
        try:
            folder = self._open_folder()
        except FileNotFoundError as exc:  # not "no checkpoint": the ranks made it, something removed it since
            raise CheckpointError(
                f"{self.url}: this save's folder is gone at the commit: removed during the save (a prune of "
                "uncommitted folders with too short an age?), or not on storage every rank shares; nothing was committed"
            ) from exc
        with folder as self._folder:
            try:
                manifest, md_bytes = self._manifest(save_id, metadata, files, len(results), self.format)
                commit(
                    self._folder,
                    self.url,
                    manifest,
                    manifest.to_bytes(),
                    sync=self.sync_files,
                    write_manifest=self._write_manifest,
                    stock_metadata=md_bytes,
                    old_files=self._old_files,
                    refused="another save committed a checkpoint here while this one was writing; this save's "
                    "files were removed and the other checkpoint is untouched"
                    + ("" if self._replacing is not None else " (pass overwrite=True to replace it)"),
                    discard=[f.name for f in files] + [manifest.metadata.name],
                    # an overwrite of a committed checkpoint of ours (a legacy folder's .metadata is its
                    # only metadata: never dropped before the swap)
                    replaces_committed=self._replacing is not None,
                )
            finally:
                self._folder = None
        self._used_save_ids.add(save_id)

    def _write_manifest(self, data: bytes) -> None:
        """The commit (a seam for fault-injection tests): exclusive, or with ``overwrite`` replacing only the
        manifest this save saw; ``FileExistsError`` when another save committed or replaced it first."""
        if self._folder is None:
            raise CheckpointError(f"{self.url}: the manifest written outside the commit")
        if self._replacing is not None:
            self._folder.replace_if(MANIFEST_NAME, data, self._replacing, sync=self.sync_files)
        else:
            self._folder.publish(MANIFEST_NAME, data, sync=self.sync_files)

    def _write_rank(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        """(every rank, in ``write_data``) This rank's items split into data files, written concurrently (each by
        :meth:`_write_file`, the fault tests' seam) and made durable; each file's last result carries its
        manifest record. ``_split_as_local`` sizes files as locally or for an object store whatever ``path`` is
        (the fast tier writes what a drain uploads). A failed file: the rank's files go, the first error is raised."""
        data = self._plan_data(plan, RankPlanData)
        self._attempt.begin(data.save_id, new_folder=data.new_folder)
        items, threads = list(plan.items), self.thread_count
        local = is_local(self.fs)
        if local if self._split_as_local is None else self._split_as_local:
            buckets, workers = split_items(items, threads), threads
        else:
            # object stores: one-part files (a PutObject each), as many in flight as thread_count files' parts
            bins, one_part = object_store_bins(items, threads, self.object_file_size)
            buckets, workers = split_items(items, bins), threads * (self.max_parts_in_flight if one_part else 1)
        # file n takes the prefix of writer slot n % thread_count (slot r * thread_count + k of the save)
        count = data.world_size * threads
        names = [
            data_file_name(data.save_id, data.rank, n, data.prefixes(data.rank * threads + n % threads, count))
            for n in range(len(buckets))
        ]
        results: list[WriteResult] = []
        errors: list[BaseException] = []
        # enough files at once to keep the CPUs busy hash inline (the bytes come from memory once); fewer hash beside
        beside = self.hash_beside
        self._hash_beside = min(len(buckets), workers) < rank_cpus() if beside is None else beside
        # made even on a rank with nothing to write (the coordinator's metadata goes there); never through a link
        with self._open_folder(create=True) as self._folder:
            self._staging = self._stages()  # one pool for every file of this rank: the cap holds per rank
            try:
                if buckets:
                    own = self.pool_of is None
                    pool = (
                        concurrent.futures.ThreadPoolExecutor(
                            min(len(buckets), workers), thread_name_prefix="smpckpt-write"
                        )
                        if self.pool_of is None  # (mypy narrows the attribute, not ``own``)
                        else self.pool_of(workers)
                    )
                    futs: list[concurrent.futures.Future[list[WriteResult]]] = []
                    try:
                        for n, part in zip(names, buckets):
                            futs.append(pool.submit(self._write_file, n, part, planner, data.rank))
                        for f in futs:  # each waited for: none still writes once this returns
                            try:
                                results.extend(f.result())
                            except BaseException as exc:  # noqa: BLE001 - first error re-raised below
                                errors.append(exc)
                    finally:
                        if own:
                            pool.shutdown()
                        else:  # a kept pool: an interrupted wait (Ctrl-C) must not leave a task writing into
                            for f in futs:  # the folder removed below, or a retry's (rev61i F1)
                                f.cancel()
                            concurrent.futures.wait(futs)
                if errors:
                    # this rank's finished files are orphans now; remove them (best effort) and report
                    self._folder.remove(names)
                    raise errors[0]
                if buckets and local and self.sync_files:
                    self._folder.fsync_dirs()  # the files' own folders, then the checkpoint folder holding them
            finally:
                self._folder = None
                self._staging.close()
        self._used_save_ids.add(data.save_id)
        return results

    def _write_file(self, name: str, items: list[WriteItem], planner: SavePlanner, rank: int) -> list[WriteResult]:
        return write_file(
            self._open_sink(name),
            name,
            items,
            planner,
            rank,
            raw=self.format == "raw",
            block_size=self.block_size,
            stages=self._staging,
            hooks=self._staging_hooks,
            hash_beside=self._hash_beside,
        )


# -- one data file of one rank: items written in order through a sink, hashed on a second thread ----------
# (``_write_rank`` runs one per file on its thread pool; ``split_items`` decides which items go to which file)


class Workers:
    """Threads one owner (a Checkpointer) keeps for all its saves (threads new at each save left glibc's
    per-thread arenas holding their freed buffers: README, "Tiered checkpoints"): a task runs on an idle
    one, a thread starts only when none is idle, up to the pool's ``limit`` (asked at its first use). A
    forked child (a DataLoader worker) gets a fresh lock and pool: the parent's threads are not in it, and
    one of them may have held the lock at the fork. Each thread's :meth:`buffer` is kept until
    :meth:`close`, which waits for the tasks and ends the threads."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._forget()
        forget_at_fork(self)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._limit, self._local = 0, threading.local()

    def pool(self, limit: int) -> concurrent.futures.ThreadPoolExecutor:
        """The pool, running at least ``limit`` tasks at once (a replica channel's tasks all block)."""
        with self._lock:
            if self._pool is None or self._limit < limit:
                if self._pool is not None:
                    self._pool.shutdown(wait=False)  # its idle threads end; its running tasks finish
                self._pool = concurrent.futures.ThreadPoolExecutor(limit, thread_name_prefix=self.name)
                self._limit, self._local = limit, threading.local()
            return self._pool

    def buffer(self, nbytes: int) -> torch.Tensor:
        """(a task) This thread's buffer of at least ``nbytes`` bytes, the same for every save."""
        buf: torch.Tensor | None = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < nbytes:  # a larger ask must not get a smaller buffer
            buf = self._local.buf = torch.empty(nbytes, dtype=torch.uint8)
        return buf

    def close(self) -> None:
        with self._lock:
            pool, self._pool, self._local = self._pool, None, threading.local()
        if pool is not None:
            pool.shutdown(wait=True)


#: WriteResults under this fqn prefix carry a data file's FileRecord (sent to the coordinator), not an item.
FILE_RESULT_FQN = "\x00smpckpt.file"


def _torch_save_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().cpu()
    # torch.save writes the whole storage: compact views so the record holds only this tensor
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone(memory_format=torch.contiguous_format)
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getbuffer()


def _item_size(item: WriteItem) -> int:
    """Bytes of the tensor piece ``item`` writes (its chunk's, not the global tensor's), 0 for objects."""
    if item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


#: object stores: a data file aims at this fraction of a part, so that it still fits one (one PutObject)
PART_FILL = 0.85


#: object stores: at most this many data files per rank by default (a larger rank writes multipart files)
MAX_OBJECT_FILES = 256


def object_store_bins(items: list[WriteItem], thread_count: int, file_size: int) -> tuple[int, bool]:
    """How many data files a rank's ``items`` go into on an object store, and whether they are about
    ``file_size`` each: at least ``thread_count``, enough for about ``file_size`` bytes each (``0``: just
    ``thread_count``), at most ``MAX_OBJECT_FILES`` (one-part files: one ``PutObject`` each, no multipart)."""
    if file_size <= 0:
        return thread_count, False
    want = -(-sum(_item_size(it) for it in items) // file_size)  # an integer ceiling (byte counts pass 2**53)
    return max(thread_count, min(MAX_OBJECT_FILES, want)), want <= MAX_OBJECT_FILES


def split_items(items: list[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Objects round-robin, tensors largest-first to the least-loaded bin; empty bins dropped."""
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    objects = [it for it in items if it.type == WriteItemType.BYTE_IO]
    tensors = sorted((it for it in items if it.type != WriteItemType.BYTE_IO), key=_item_size, reverse=True)
    for i, it in enumerate(objects):
        buckets[i % bins].append(it)
    for it in tensors:
        j = min(range(bins), key=sizes.__getitem__)
        buckets[j].append(it)
        sizes[j] += _item_size(it)
    return [b for b in buckets if b]


def write_file(
    sink: Sink,
    name: str,
    items: list[WriteItem],
    planner: SavePlanner,
    rank: int,
    *,
    raw: bool,
    block_size: int,
    stages: Stages,
    hooks: Any = None,
    hash_beside: bool = False,
) -> list[WriteResult]:
    """Write ``items`` (in :func:`split_items`'s order) into ``sink`` and commit it; the last result carries
    the file's :class:`FileRecord` for the manifest. Tensors that cannot be written in place are staged
    through ``stages`` (:mod:`._pipeline`); ``hash_beside``: see :class:`FsspecStorageWriter`."""
    hasher = BlockHasher(block_size)
    results: list[WriteResult] = []
    offset = 0
    stream = FileStream(sink, hasher, stages, hooks, hash_beside=hash_beside)
    try:
        for item in items:
            value = planner.resolve_data(item)
            descriptors: list[str] | None = None
            if item.type == WriteItemType.BYTE_IO:
                if not isinstance(value, io.BytesIO):
                    raise TypeError(f"{item.index.fqn}: BYTE_IO item resolved to {type(value).__name__}")
                mv = value.getbuffer()
                nbytes = mv.nbytes
                stream.put(mv, None)
            elif not isinstance(value, torch.Tensor):
                raise TypeError(f"{item.index.fqn}: tensor item resolved to {type(value).__name__}")
            elif value.layout is not torch.strided or value.is_quantized or value.is_nested:  # DCP's own planner
                raise not_plain(item.index.fqn, value)
            elif value.is_meta:
                raise no_data(item.index.fqn, value)
            elif raw:
                descriptors = [RAW_DESCRIPTOR]
                # units of its own, so a reshard reads (and verifies) only the slices it needs
                checks = item_checks(tuple(value.shape), value.element_size(), block_size)
                t = value.detach()
                own = cpu_bytes(t) if t.device.type == "cpu" else None
                kind = stage_kind(t, in_place=own is not None)
                if kind is None and own is not None:
                    nbytes = own.nbytes
                    stream.put(own, checks)
                else:
                    nbytes = stream.stage(t, stages.get(t, kind or "host"), checks)
            else:
                mv = _torch_save_bytes(value)
                nbytes = mv.nbytes
                stream.put(mv, None)
            results.append(
                WriteResult(
                    index=item.index,
                    size_in_bytes=nbytes,
                    storage_data=_StorageInfo(name, offset, nbytes, transform_descriptors=descriptors),
                )
            )
            offset += nbytes
        stream.finish()
        ends, digests = hasher.finish()
        sink.commit()
    except BaseException:
        sink.abort()
        raise
    finally:
        stream.close()
    results.append(
        WriteResult(
            index=MetadataIndex(f"{FILE_RESULT_FQN}/{name}"),
            size_in_bytes=offset,
            storage_data=FileRecord(name, offset, rank, tuple(ends), tuple(digests), tilings=tuple(hasher.tilings)),
        )
    )
    return results

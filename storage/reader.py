"""``FsspecStorageReader``: DCP StorageReader for smpckpt checkpoints and stock DCP checkpoints.

Call order inside ``dcp.load`` ("all" = every rank)::

    0) (all)         reset(checkpoint_id)            only when dcp.load gets checkpoint_id=
    1) (all)         read_metadata()                 manifest (the commit marker), then the metadata it names
    2) (all)         set_up_storage_reader(metadata, is_coordinator, rank=, use_collectives=)
    3) (all)         prepare_local_plan(plan)         items sorted by file and offset
    4) (coordinator) prepare_global_plan(plans)       unchanged
    5) (all)         read_data(plan, planner)         ranged, coalesced, verified reads

What ``read_metadata`` accepts: a committed smpckpt checkpoint (manifest present); a stock DCP
checkpoint (``.metadata`` from ``FileSystemWriter``/``FsspecWriter``, read as *legacy*: no checksums).
It refuses an uncommitted save (our files, no manifest) with :class:`~smpckpt.errors.CheckpointNotFound`.

Reads: every item's byte range is computed from the metadata (for raw tensors only the bytes of the
requested slice), widened to whole checksum blocks when verifying, sorted by offset and coalesced;
``thread_count`` requests run at once and the planner is called from the calling thread only.

Direct reads (local files): a raw tensor item of at least 1 MiB whose requested slice is contiguous in
the file, and whose destination (``planner.resolve_tensor``) is a contiguous CPU tensor of the saved
dtype and shape, is read with ``os.preadv`` straight into the destination's memory (the block-widening
head/tail bytes go to small scratch buffers), in pieces of about 16 MiB cut at checksum block
boundaries, each piece verified by the worker thread that read it (xxh3 releases the GIL, so hashing
one piece overlaps reading others); ``commit_tensor`` follows on the calling thread once every piece of
the item is verified. Everything else (small, strided, cast, object and remote items) goes through the
coalesced, pooled buffers and a copy into the destination.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import logging
import os
import threading
import traceback
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from smpckpt.errors import CheckpointCorrupt, CheckpointError, CheckpointNotFound, LayoutMismatch
from smpckpt.storage import _names
from smpckpt.storage._checksum import hash_bytes
from smpckpt.storage._errors import translate_errors
from smpckpt.storage._fs import is_local, join, open_fs, read_bytes_or_none, supports_url
from smpckpt.storage._ranges import Fetch, Need, coalesce, slice_byte_range
from smpckpt.storage._safe_pickle import check_weights_only, load_metadata
from smpckpt.storage._state import probe
from smpckpt.storage.manifest import FileRecord, Manifest

__all__ = ["FsspecStorageReader", "ReadStats"]

log = logging.getLogger(__name__)

# raw tensor items at least this large skip the shared buffer (read into the destination tensor)
_DIRECT_MIN_BYTES = 1 << 20
# bytes of a direct item read (then verified) per task: pieces of one tensor run on several threads
_PIECE = 16 << 20


@dataclasses.dataclass(frozen=True)
class ReadStats:
    """Byte accounting of the last ``read_data`` on this rank (``reader.last_read_stats``)."""

    bytes_needed: int  # bytes of the requested slices / records
    bytes_read: int  # bytes fetched from storage (after block widening and coalescing)
    requests: int  # ranged reads issued
    items: int

    @property
    def amplification(self) -> float:
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 1.0


@dataclasses.dataclass(frozen=True)
class _Item:
    req: ReadItem
    file: str
    start: int  # exact bytes this item decodes from
    end: int
    raw: bool  # raw tensor bytes (decode with dtype/shape) vs a torch.save record / object bytes
    dtype: torch.dtype | None = None
    chunk_sizes: tuple[int, ...] = ()


class FsspecStorageReader(StorageReader):
    """Read a checkpoint at ``path`` (any fsspec URL).

    Args:
        path: folder or URL.
        storage_options: fsspec filesystem options; kept across :meth:`reset`.
        verify_checksums: verify the checksum of every block a read touches (default). ``False``
            skips it (and reads only the exact bytes).
        allow_pickle: hand object values that need arbitrary code to load to the planner. Only for
            checkpoints you trust; by default they raise :class:`~smpckpt.errors.UnsafeCheckpoint`.
        thread_count: ranged reads in flight.
        max_request_bytes: coalesced requests stop growing at this size.
        coalesce_gap: merge ranges separated by at most this many bytes (reading the gap).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        verify_checksums: bool = True,
        allow_pickle: bool = False,
        thread_count: int = 4,
        max_request_bytes: int = 64 << 20,
        coalesce_gap: int = 0,
    ) -> None:
        super().__init__()
        self.storage_options = dict(storage_options or {})
        self.verify_checksums = verify_checksums
        self.allow_pickle = allow_pickle
        self.thread_count = max(1, thread_count)
        self.max_request_bytes = max_request_bytes
        self.coalesce_gap = coalesce_gap
        # raw items at least this large are read straight into their destination when it allows
        self.direct_min_bytes = _DIRECT_MIN_BYTES
        self.last_read_stats: ReadStats | None = None
        self._pool: list[bytearray] = []
        self._pool_lock = threading.Lock()
        self._open(path)

    def _open(self, path: str | os.PathLike[str]) -> None:
        self.url = os.fspath(path)
        self.fs, self.path = open_fs(self.url, self.storage_options)
        self.manifest: Manifest | None = None
        self.state: str | None = None
        self.storage_data: dict[MetadataIndex, Any] = {}
        self._chunks: dict[MetadataIndex, tuple[torch.dtype, tuple[int, ...]]] = {}
        self._records: dict[str, FileRecord] = {}
        self._sizes: dict[str, int | None] = {}  # legacy checkpoints: data file sizes, one stat per file
        self._metadata_path = self.url  # where the metadata came from (named in errors about its records)
        self.load_id = uuid.uuid4().hex
        self.metadata_error: Exception | None = None

    @property
    def checkpoint_id(self) -> str:
        return self.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return supports_url(checkpoint_id)

    # -- StorageReader protocol -------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._open(checkpoint_id if checkpoint_id else self.url)

    def read_metadata(self, *args: Any, **_unused: Any) -> Metadata:
        """(all ranks) The manifest first: it is the commit marker; then the metadata it names.

        DCP replaces an exception raised here by an ``AssertionError`` carrying only its message;
        the original exception is kept in :attr:`metadata_error` so callers can re-raise it. (The
        keyword parameter is deliberately not named ``kwargs``: DCP retries a failed read with
        ``rank=`` -- "rank-local metadata" -- when it is, which would read and fail twice.)
        """
        try:
            return self._read_metadata()
        except Exception as exc:
            self.metadata_error = exc
            raise

    def _read_metadata(self) -> Metadata:
        found = probe(self.fs, self.path)
        self.state = found.state
        if found.state == "missing":
            raise CheckpointNotFound(f"no checkpoint at {self.url}")
        if found.state == "uncommitted":
            raise CheckpointNotFound(
                f"{self.url} holds an uncommitted (incomplete or failed) save: {found.detail}; refusing to load it"
            )
        if found.state == "legacy":
            log.info("%s: stock DCP checkpoint (no manifest): loading without integrity checks", self.url)
            metadata = found.legacy_metadata
            self._metadata_path = join(self.fs, self.path, _names.METADATA_NAME)
        else:
            manifest = found.manifest
            if manifest is None:  # pragma: no cover - probe guarantees it
                raise CheckpointError("internal: committed checkpoint without manifest")
            if manifest.kind != "partial":
                raise CheckpointError(f"{self.url}: checkpoint kind {manifest.kind!r} is not supported yet")
            md_path = join(self.fs, self.path, manifest.metadata.name)
            data = read_bytes_or_none(self.fs, md_path)
            if data is None:
                raise CheckpointCorrupt(f"{md_path}: metadata listed in the manifest is missing")
            if len(data) != manifest.metadata.size or hash_bytes(data) != manifest.metadata.digest:
                raise CheckpointCorrupt(
                    f"{md_path}: size/checksum differ from the manifest ({len(data)} bytes, "
                    f"manifest says {manifest.metadata.size})"
                )
            metadata = load_metadata(data, where=md_path)
            self._metadata_path = md_path
            self.manifest = manifest
            self._records = {f.name: f for f in manifest.files}
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise CheckpointCorrupt(f"{self.url}: metadata has no storage_data")
        self.storage_data = metadata.storage_data
        self._chunks = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                for chunk in md.chunks:
                    self._chunks[MetadataIndex(fqn, chunk.offsets)] = (md.properties.dtype, tuple(chunk.sizes))

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        def key(it: ReadItem) -> tuple[str, int]:
            info = self.storage_data.get(it.storage_index)
            # records are checked in _item (with a message naming the key); sorting must not fail first
            offset = getattr(info, "offset", 0)
            return (str(getattr(info, "relative_path", "")), offset if _is_int(offset) else -1)

        plan.items = sorted(plan.items, key=key)
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan`` into ``planner``; returns a completed future.

        A failure is raised from here (as DCP's own ``FileSystemReader`` does), not stored in the future:
        torch's ``Future`` holds its exception from C++, where the garbage collector cannot see the cycle
        exception -> traceback -> DCP's frame (which holds the future) -> exception, so every failed load
        would pin that exception, the frames of its caller and the state dict being loaded until the
        process ends. The frames the failure went through are cleared, so the exception, wherever it is
        kept (DCP's ``CheckpointException``), does not hold read buffers or destination views either.
        """
        try:
            self._read(plan, planner)
        except Exception as exc:
            _release_frames(exc)
            raise
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- planning ---------------------------------------------------------------------------------
    def _item(self, req: ReadItem) -> _Item:
        info = self.storage_data.get(req.storage_index)
        if not isinstance(info, _StorageInfo):
            raise CheckpointCorrupt(f"{self.url}: no storage record for {req.storage_index.fqn!r}")
        descriptors = tuple(info.transform_descriptors or ())
        raw = _names.RAW_DESCRIPTOR in descriptors
        unknown = [d for d in descriptors if d != _names.RAW_DESCRIPTOR]
        if unknown:
            raise CheckpointError(f"{req.storage_index.fqn!r}: unsupported stream transforms {unknown}")
        self._check_record(req.storage_index.fqn, info)
        start, end = info.offset, info.offset + info.length
        if req.type == LoadItemType.TENSOR and raw:
            chunk = self._chunks.get(req.storage_index)
            if chunk is None:
                raise CheckpointCorrupt(f"{self.url}: no chunk metadata for {req.storage_index.fqn!r}")
            dtype, sizes = chunk
            itemsize = torch.empty((), dtype=dtype).element_size()
            lo, hi = slice_byte_range(sizes, list(req.storage_offsets), list(req.lengths), itemsize)
            n = 1
            for s in sizes:
                n *= s
            if n * itemsize != info.length:
                raise CheckpointCorrupt(
                    f"{info.relative_path}: record of {req.storage_index.fqn!r} is {info.length} bytes, "
                    f"its shape {list(sizes)} x {dtype} needs {n * itemsize}"
                )
            if not 0 <= lo <= hi <= info.length:
                raise CheckpointCorrupt(
                    f"{info.relative_path}: requested slice of {req.storage_index.fqn!r} (offsets "
                    f"{list(req.storage_offsets)}, lengths {list(req.lengths)}) is outside its stored chunk {list(sizes)}"
                )
            return _Item(req, info.relative_path, start + lo, start + hi, True, dtype, sizes)
        return _Item(req, info.relative_path, start, end, False)

    def _check_record(self, fqn: str, info: _StorageInfo) -> None:
        """(calling thread, before any byte is read) The metadata names a plain file inside the folder
        (listed in the manifest when there is one) and a byte range inside that file.

        The metadata may be crafted: a ``../`` name must never reach the filesystem, and a negative offset
        or a huge length must fail here with a :class:`CheckpointCorrupt` naming the file and the key,
        not later as an ``OSError``, a ``MemoryError`` or a read of the wrong bytes. A committed
        checkpoint's file sizes come from the manifest; a stock (legacy) checkpoint's data files are
        stat'ed, once each.
        """
        name = _names.check_member_name(info.relative_path, where=f"{self._metadata_path} (key {fqn!r})")
        path = join(self.fs, self.path, name)
        offset, length = info.offset, info.length
        if not (_is_int(offset) and _is_int(length) and offset >= 0 and length >= 0):
            raise CheckpointCorrupt(
                f"{path}: key {fqn!r} is recorded at offset {offset!r} with length {length!r}; both must be "
                f"non-negative integers (the metadata {self._metadata_path} is corrupt or crafted)"
            )
        if self.manifest is not None:
            rec = self._records.get(name)
            if rec is None:
                raise CheckpointCorrupt(
                    f"{path}: data file of key {fqn!r} is not listed in the manifest (the metadata "
                    f"{self._metadata_path} is corrupt or crafted)"
                )
            size: int | None = rec.size
        else:
            size = self._legacy_size(name, fqn)
        if size is not None and offset + length > size:
            raise CheckpointCorrupt(
                f"{path}: key {fqn!r} is recorded at offset {offset} with length {length}, past the end of the "
                f"file ({size} bytes; the metadata is corrupt or crafted, or the file is truncated)"
            )

    def _legacy_size(self, name: str, fqn: str) -> int | None:
        """Size of a stock checkpoint's data file (``None`` where the backend cannot tell), stat'ed once."""
        if name not in self._sizes:
            path = join(self.fs, self.path, name)
            try:
                with translate_errors(path):
                    size = self.fs.size(path)
            except FileNotFoundError as exc:
                raise CheckpointCorrupt(f"{path}: data file is missing (needed for keys {[fqn]})") from exc
            self._sizes[name] = int(size) if size is not None else None
        return self._sizes[name]

    def _widen(self, it: _Item) -> tuple[int, int]:
        # _check_record has put [it.start, it.end) inside the file and the file in the manifest
        rec = self._records.get(it.file)
        if rec is None or not self.verify_checksums or it.end <= it.start:
            return it.start, it.end
        blocks = rec.blocks_covering(it.start, it.end)
        return rec.block_start(blocks[0]), rec.block_ends[blocks[-1]]

    def _plan(self, plan: LoadPlan) -> tuple[list[tuple[str, Fetch[_Item]]], list[_Item], int, list[tuple[str, Need[_Item]]]]:
        per_file: dict[str, list[Need[_Item]]] = {}
        empty: list[_Item] = []
        direct: list[tuple[str, Need[_Item]]] = []
        local = is_local(self.fs)
        needed = 0
        for req in plan.items:
            it = self._item(req)
            if it.end <= it.start:
                empty.append(it)
                continue
            needed += it.end - it.start
            lo, hi = self._widen(it)
            if local and it.raw and it.end - it.start >= self.direct_min_bytes and self._file_contiguous(it):
                # candidate for reading straight into the destination (decided when its target is resolved)
                direct.append((it.file, Need(lo, hi, it)))
                continue
            per_file.setdefault(it.file, []).append(Need(lo, hi, it))
        fetches = [
            (name, f)
            for name in sorted(per_file)
            for f in coalesce(per_file[name], gap=self.coalesce_gap, max_bytes=self.max_request_bytes)
        ]
        direct.sort(key=lambda d: (d[0], d[1].start))
        return fetches, empty, needed, direct

    @staticmethod
    def _file_contiguous(it: _Item) -> bool:
        """The requested slice is one contiguous run of the stored chunk's bytes."""
        n = 1
        for x in it.req.lengths:
            n *= int(x)
        itemsize = torch.empty((), dtype=it.dtype).element_size()
        return n * itemsize == it.end - it.start

    def _direct_target(self, it: _Item, planner: LoadPlanner) -> tuple[torch.Tensor, memoryview] | None:
        """(calling thread) The destination, when the item's bytes can be read into it as they are."""
        target = planner.resolve_tensor(it.req).detach()
        if (
            target.device.type != "cpu"
            or target.dtype != it.dtype
            or list(target.size()) != [int(n) for n in it.req.lengths]
            or not target.is_contiguous()
            or target.numel() * target.element_size() != it.end - it.start
        ):
            return None
        try:
            dst = memoryview(target.reshape(-1).view(torch.uint8).numpy())
        except (RuntimeError, TypeError, ValueError):
            return None
        if dst.readonly or dst.nbytes != it.end - it.start:
            return None
        return target, dst

    def _pieces(self, name: str, lo: int, hi: int) -> list[tuple[int, int]]:
        """Split ``[lo, hi)`` at checksum block boundaries into pieces of about ``_PIECE`` bytes."""
        rec = self._records.get(name)
        if hi - lo <= _PIECE:
            return [(lo, hi)]
        if rec is None or not self.verify_checksums:
            return [(a, min(a + _PIECE, hi)) for a in range(lo, hi, _PIECE)]
        out: list[tuple[int, int]] = []
        start = lo
        for i in rec.blocks_covering(lo, hi):
            be = rec.block_ends[i]
            if be - start >= _PIECE or be >= hi:
                out.append((start, be))
                start = be
        if start < hi:  # pragma: no cover - widened ranges end on a block end
            out.append((start, hi))
        return out

    # -- I/O --------------------------------------------------------------------------------------
    def _fetch(self, name: str, fetch: Fetch[_Item]) -> memoryview:
        path = join(self.fs, self.path, name)
        keys = sorted({n.item.req.storage_index.fqn for n in fetch.needs})
        want = fetch.end - fetch.start
        try:
            with translate_errors(path):
                if is_local(self.fs):
                    buf = self._take_buffer(want)
                    got = 0
                    with open(path, "rb", buffering=0) as f:
                        while got < want:
                            n = os.preadv(f.fileno(), [memoryview(buf)[got:want]], fetch.start + got)
                            if n == 0:
                                break
                            got += n
                    data = memoryview(buf)[:got]
                else:
                    data = memoryview(self.fs.cat_file(path, start=fetch.start, end=fetch.end))
        except FileNotFoundError as exc:
            raise CheckpointCorrupt(f"{path}: data file is missing (needed for keys {keys[:5]})") from exc
        if len(data) < want:
            raise CheckpointCorrupt(
                f"{path}: truncated: needed bytes {fetch.start}..{fetch.end} for keys {keys[:5]}, "
                f"file ends at {fetch.start + len(data)}"
            )
        rec = self._records.get(name)
        if rec is not None and self.verify_checksums:
            _verify_blocks(
                path, rec, fetch.start, fetch.end, [n.item for n in fetch.needs],
                lambda bs, be: hash_bytes(data[bs - fetch.start : be - fetch.start]),
            )
        return data

    def _take_buffer(self, n: int) -> bytearray:
        # Reused buffers: a fresh 64 MiB bytearray costs a memset and page faults on every request.
        with self._pool_lock:
            for i, b in enumerate(self._pool):
                if len(b) >= n:
                    del self._pool[i]
                    return b
        return bytearray(max(n, min(self.max_request_bytes, 1 << 26)))

    def _give_back(self, data: memoryview) -> None:
        base = data.obj
        if isinstance(base, bytearray):
            # every view of it (and tensors made from them) is gone once _deliver returned
            with self._pool_lock:
                if len(self._pool) < 2 * self.thread_count:
                    self._pool.append(base)

    def _direct_piece(self, name: str, need: Need[_Item], dst: memoryview, lo: int, hi: int) -> None:
        """(worker thread) Read file bytes ``[lo, hi)`` of a direct item: the item's own bytes straight into
        its destination, the block-widening head/tail into scratch; then verify every block of the piece."""
        it = need.item
        path = join(self.fs, self.path, name)
        a, b = max(lo, it.start), min(hi, it.end)
        head = bytearray(a - lo) if a > lo else None
        tail = bytearray(hi - b) if hi > b else None
        segs: list[tuple[int, memoryview]] = []
        if head is not None:
            segs.append((lo, memoryview(head)))
        segs.append((a, dst[a - it.start : b - it.start]))
        if tail is not None:
            segs.append((b, memoryview(tail)))
        try:
            with translate_errors(path):
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                try:
                    want, got = hi - lo, 0
                    while got < want:
                        bufs, skip = [], got
                        for _, mv in segs:
                            if skip >= len(mv):
                                skip -= len(mv)
                                continue
                            bufs.append(mv[skip:])
                            skip = 0
                        n = os.preadv(fd, bufs, lo + got)
                        if n == 0:
                            break
                        got += n
                finally:
                    os.close(fd)
        except FileNotFoundError as exc:
            raise CheckpointCorrupt(
                f"{path}: data file is missing (needed for keys {[it.req.storage_index.fqn]})"
            ) from exc
        if got < want:
            raise CheckpointCorrupt(
                f"{path}: truncated: needed bytes {lo}..{hi} for keys {[it.req.storage_index.fqn]}, "
                f"file ends at {lo + got}"
            )
        rec = self._records.get(name)
        if rec is None or not self.verify_checksums:
            return

        def digest(bs: int, be: int) -> int:
            if bs >= a and be <= b:
                return hash_bytes(dst[bs - it.start : be - it.start])
            h = xxhash.xxh3_64()
            for off, mv in segs:
                s0, s1 = max(bs, off), min(be, off + len(mv))
                if s0 < s1:
                    h.update(mv[s0 - off : s1 - off])
            return h.intdigest()

        _verify_blocks(path, rec, lo, hi, [it], digest)

    def _read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        try:
            self._read_all(plan, planner)
        finally:
            # buffers are reused within one read_data call only: a reader kept by the caller (or by a
            # failed load's traceback) must not keep up to 2 * thread_count 64 MiB buffers alive
            with self._pool_lock:
                self._pool.clear()

    def _read_all(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        fetches, empty, needed, direct = self._plan(plan)
        for it in empty:
            self._deliver(it, memoryview(b""), planner)
        # one ordered list of work: coalesced buffered fetches and direct candidates, by file and offset
        work: list[tuple[str, int, int, Any]] = [(n, f.start, 0, f) for n, f in fetches]
        work += [(n, need.start, 1, need) for n, need in direct]
        work.sort(key=lambda w: (w[0], w[1], w[2]))
        read = 0
        requests = 0
        # direct items in flight: id -> [target, pieces left]
        open_items: dict[int, list[Any]] = {}

        def units() -> Iterator[tuple[Any, ...]]:
            nonlocal read, requests
            for name, _, kind, obj in work:
                if kind == 0:
                    read += obj.end - obj.start
                    requests += 1
                    yield ("fetch", name, obj)
                    continue
                need: Need[_Item] = obj
                found = self._direct_target(need.item, planner)
                if found is None:
                    fetch = Fetch(need.start, need.end, (need,))
                    read += fetch.end - fetch.start
                    requests += 1
                    yield ("fetch", name, fetch)
                    continue
                target, dst = found
                pieces = self._pieces(name, need.start, need.end)
                key = id(need)
                open_items[key] = [target, len(pieces), need.item]
                read += need.end - need.start
                requests += len(pieces)
                for lo, hi in pieces:
                    yield ("direct", name, need, dst, lo, hi, key)

        with concurrent.futures.ThreadPoolExecutor(self.thread_count, thread_name_prefix="smpckpt-read") as pool:
            pending: dict[concurrent.futures.Future[Any], tuple[Any, ...]] = {}
            todo = units()
            try:
                while True:
                    while len(pending) < 2 * self.thread_count:
                        u = next(todo, None)
                        if u is None:
                            break
                        if u[0] == "fetch":
                            pending[pool.submit(self._fetch, u[1], u[2])] = u
                        else:
                            pending[pool.submit(self._direct_piece, *u[1:6])] = u
                    if not pending:
                        break
                    done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                    for f in done:
                        u = pending.pop(f)
                        result = f.result()
                        if u[0] == "fetch":
                            fetch = u[2]
                            for need in fetch.needs:
                                it = need.item
                                self._deliver(it, result[it.start - fetch.start : it.end - fetch.start], planner)
                            self._give_back(result)
                        else:
                            entry = open_items[u[6]]
                            entry[1] -= 1
                            if entry[1] == 0:
                                del open_items[u[6]]
                                planner.commit_tensor(entry[2].req, entry[0])
            finally:
                for f in pending:
                    f.cancel()
        self.last_read_stats = ReadStats(needed, read, requests, len(plan.items))

    def _deliver(self, it: _Item, data: memoryview, planner: LoadPlanner) -> None:
        req = it.req
        where = f"{join(self.fs, self.path, it.file)} key {req.storage_index.fqn!r} at offset {it.start}"
        if req.type == LoadItemType.BYTE_IO:
            if not self.allow_pickle:
                check_weights_only(data, where=where)
            planner.load_bytes(req, io.BytesIO(bytes(data)))
            return
        if it.raw:
            src = self._decode_raw(it, data)
        else:
            try:
                loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 - any decode failure means bad bytes
                raise CheckpointCorrupt(f"{where}: cannot decode tensor record: {exc}") from exc
            src = loaded
            for dim, (off, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                src = src.narrow(dim, off, n)
        target = planner.resolve_tensor(req).detach()
        if target.size() != src.size():
            raise LayoutMismatch(f"{req.storage_index.fqn!r}: destination {list(target.size())} vs stored slice {list(src.size())}")
        target.copy_(src)
        planner.commit_tensor(req, target)

    @staticmethod
    def _decode_raw(it: _Item, data: memoryview) -> torch.Tensor:
        req, dtype = it.req, it.dtype
        lengths = [int(n) for n in req.lengths]
        if any(n == 0 for n in lengths):
            return torch.empty(lengths, dtype=dtype)
        with warnings.catch_warnings():
            # read-only buffers (bytes from object stores) are only read from here, never written
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(data, dtype=torch.uint8).view(dtype)  # type: ignore[arg-type]
        strides = [1] * len(it.chunk_sizes)
        for d in range(len(strides) - 2, -1, -1):
            strides[d] = strides[d + 1] * it.chunk_sizes[d + 1]
        if not strides:
            return flat.reshape(())
        # data starts at the slice's first element: index the chunk's strides from there
        return flat.as_strided(lengths, strides)


def _verify_blocks(
    path: str, rec: FileRecord, lo: int, hi: int, items: list[_Item], digest: Callable[[int, int], int]
) -> None:
    """Check every block of ``rec`` that overlaps file bytes ``[lo, hi)`` (``digest(start, end)`` hashes
    a block's bytes as read); a mismatch names the block and the keys among ``items`` it holds."""
    for i in rec.blocks_covering(lo, hi):
        bs, be = rec.block_start(i), rec.block_ends[i]
        if digest(bs, be) != rec.block_digests[i]:
            bad = sorted({it.req.storage_index.fqn for it in items if it.start < be and it.end > bs})
            raise CheckpointCorrupt(
                f"{path}: checksum mismatch in bytes {bs}..{be} (block {i}) holding key(s) {bad}; the file is corrupt"
            )


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _release_frames(exc: BaseException) -> None:
    """Drop the locals of every finished frame ``exc`` (and the exceptions chained to it) went through:
    read buffers, destination views and plans would otherwise live as long as the exception."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)  # skips frames still running (the caller's)
        todo += [e.__cause__, e.__context__]

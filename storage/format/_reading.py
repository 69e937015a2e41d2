"""What both readers of this format share (``FsspecStorageReader``: partial and stock DCP checkpoints;
``FullArtifactReader``: full artifacts and Hugging Face folders): the readers' base, the byte
accounting they report, byte-range planning (pure: what each item needs, widened to checksum blocks,
coalesced; property-tested against a brute-force oracle) and a CPU tensor's bytes without a copy.

Each torch call drops and retakes the GIL, a queue per call with a thread per file, so
:func:`cpu_bytes` turns a tensor of a numpy dtype into bytes with one torch call (``numpy()``); other
dtypes (bfloat16, float8) take ``view(torch.uint8)``.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypedDict, TypeVar, cast

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from smpckpt._checks import check_flag, check_int
from smpckpt.errors import CheckpointCorrupt, CheckpointNotFound
from smpckpt.model.translation import Translation
from smpckpt.storage.backends._fs import FsspecLocation, default_read_threads, is_local, join, read_bytes_or_none
from smpckpt.storage.format._columns import REQUEST_COST_BYTES
from smpckpt.storage.format._safe_pickle import load_metadata
from smpckpt.storage.format.manifest import LOAD_ID_PREFIX, Manifest, Probe, probe

__all__ = [
    "ReaderBase",
    "ReaderOptions",
    "ReadStats",
    "Need",
    "Fetch",
    "c_strides",
    "slice_byte_range",
    "coalesce",
    "cpu_bytes",
]


def cpu_bytes(t: torch.Tensor) -> memoryview | None:
    """The bytes of ``t`` (row-major) as a flat ``"B"`` memoryview over its own memory, for a contiguous
    CPU tensor that needs no grad (not a conjugate or negative view); ``None`` otherwise."""
    try:
        arr = t.numpy()
    except (TypeError, RuntimeError):  # no numpy dtype, or a tensor numpy cannot share
        if t.device.type != "cpu" or t.requires_grad or not t.is_contiguous() or t.is_conj() or t.is_neg():
            return None
        try:
            return memoryview(cast(Any, t.reshape(-1).view(torch.uint8).numpy()))
        except (RuntimeError, TypeError, ValueError):
            return None
    if not arr.flags.c_contiguous:
        return None
    return memoryview(cast(Any, arr.reshape(-1).view(np.uint8)))


T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Need(Generic[T]):
    """Bytes ``[start, end)`` of one file that ``item`` needs."""

    start: int
    end: int
    item: T


@dataclasses.dataclass(frozen=True)
class Fetch(Generic[T]):
    """One read request ``[start, end)`` serving ``needs`` (all inside it)."""

    start: int
    end: int
    needs: tuple[Need[T], ...]


def c_strides(sizes: Sequence[int]) -> list[int]:
    """Element strides of a C-contiguous (row-major) array of shape ``sizes``."""
    strides = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * sizes[d + 1]
    return strides


def slice_byte_range(
    sizes: Sequence[int], offsets: Sequence[int], lengths: Sequence[int], itemsize: int
) -> tuple[int, int]:
    """Smallest contiguous byte range of a C-contiguous array of shape ``sizes`` holding the slice
    ``offsets : offsets + lengths``: exactly its bytes when contiguous, else the enclosing span."""
    if len(sizes) != len(offsets) or len(sizes) != len(lengths):
        raise ValueError("sizes, offsets and lengths differ in rank")
    if any(n == 0 for n in lengths):
        return (0, 0)
    strides = c_strides(sizes)
    first = sum(o * s for o, s in zip(offsets, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides))
    return (first * itemsize, (last + 1) * itemsize)


def coalesce(needs: Sequence[Need[T]], *, gap: int = 0, max_bytes: int = 64 << 20) -> list[Fetch[T]]:
    """Merge needs (sorted) that overlap or lie within ``gap`` bytes while within ``max_bytes`` (never split)."""
    out: list[Fetch[T]] = []
    cur: list[Need[T]] = []
    start = end = 0
    for need in sorted(needs, key=lambda n: (n.start, n.end)):
        if cur and need.start <= end + gap and (max(end, need.end) - start <= max_bytes or need.start < end):
            cur.append(need)
            end = max(end, need.end)
            continue
        if cur:
            out.append(Fetch(start, end, tuple(cur)))
        cur, start, end = [need], need.start, need.end
    if cur:
        out.append(Fetch(start, end, tuple(cur)))
    return out


@dataclasses.dataclass(frozen=True)
class ReadStats:
    """Byte accounting of the last ``read_data`` on this rank (``reader.last_read_stats``).

    * ``bytes_needed``: bytes the destinations receive (a column slice counts its elements, not its rows);
      an object its record.
    * ``bytes_requested``: the lengths of this reader's read requests (``preadv`` calls, ranged GETs):
      beyond ``bytes_needed``, bytes read only to verify a check unit and the gaps a merged request reads.
      A page-cache hit counts, read-ahead does not.
    * ``requests``: read requests as planned (a coalesced range, a batch of direct pieces, a row or merged
      run of rows of a column slice, an object GET); a streamed column slice counts each large request.
    * ``items``: the plan's read items.
    * ``per_file``: file name -> (bytes needed, bytes requested), for every file the load touched.
    * ``device_bytes``: bytes the kernel read from block devices during the call (``/proc/self/io``,
      the whole process; read-ahead in, page-cache hits out); ``None`` where not reported or not local."""

    bytes_needed: int
    bytes_requested: int
    requests: int
    items: int
    per_file: Mapping[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    device_bytes: int | None = None

    @property
    def bytes_read(self) -> int:
        """``bytes_requested`` (its earlier name)."""
        return self.bytes_requested

    @property
    def amplification(self) -> float:
        """``bytes_requested / bytes_needed`` (1.0 when nothing was needed)."""
        return self.bytes_requested / self.bytes_needed if self.bytes_needed else 1.0

    @property
    def device_amplification(self) -> float | None:
        """``device_bytes / bytes_needed``, where ``device_bytes`` is known."""
        if self.device_bytes is None:
            return None
        return self.device_bytes / self.bytes_needed if self.bytes_needed else 1.0


class ReaderOptions(TypedDict, total=False):
    """The options both readers take (``FullArtifactReader`` only these), handed on to :class:`ReaderBase`."""

    storage_options: Mapping[str, Any] | None
    verify_checksums: bool
    allow_pickle: bool
    translation: Translation | None
    hf_prefix: str
    request_cost_bytes: int
    thread_count: int | None


class ReaderBase(FsspecLocation, StorageReader):
    """The shared half of both readers: the location, the folder's state, the metadata a manifest names
    (checked against it), the load id our planner recognises, the original ``read_metadata`` error, and a
    failed read's frames released. A subclass supplies ``_read_metadata``, ``set_up_storage_reader``,
    ``prepare_local_plan`` and ``_read`` (sets ``last_read_stats``); ``reset``, ``read_metadata``,
    ``prepare_global_plan`` (unchanged) and ``read_data`` are handled here."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        verify_checksums: bool = True,
        allow_pickle: bool = False,
        translation: Translation | None = None,
        hf_prefix: str = "",
        request_cost_bytes: int = REQUEST_COST_BYTES,
        thread_count: int | None = None,
    ) -> None:
        super().__init__()
        self.request_cost_bytes = check_int("request_cost_bytes", request_cost_bytes, minimum=0)
        self._threads_asked = check_int("thread_count", thread_count, minimum=1, optional=True)
        check_flag("verify_checksums", verify_checksums)
        check_flag("allow_pickle", allow_pickle)
        self.storage_options = dict(storage_options or {})
        self.verify_checksums = verify_checksums
        self.allow_pickle = allow_pickle
        self.translation, self.hf_prefix = translation, hf_prefix  # for a plain Hugging Face folder
        self.last_read_stats: ReadStats | None = None
        self._open(path)

    @property
    def thread_count(self) -> int:
        """Worker threads of a read: the count given, else :func:`default_read_threads` for this URL."""
        return self._threads_asked or default_read_threads(is_local(self.fs))

    @thread_count.setter
    def thread_count(self, value: int) -> None:
        self._threads_asked = check_int("thread_count", value, minimum=1)

    def _open(self, path: str | os.PathLike[str]) -> None:
        super()._open(path)
        self.manifest: Manifest | None = None
        self.state: str | None = None
        self.load_id = f"{LOAD_ID_PREFIX}{uuid.uuid4().hex}"  # tells our planner which reader it has
        self.metadata_error: Exception | None = None

    def read_metadata(self, *args: Any, **_unused: Any) -> Metadata:
        """(all ranks) The manifest first: it is the commit marker; then the metadata it names.

        DCP replaces an exception raised here by an ``AssertionError`` carrying its message: the original is
        kept in :attr:`metadata_error`. (The keyword parameter is not named ``kwargs``: DCP would then retry a
        failed read with ``rank=``, reading and failing twice.)"""
        try:
            metadata = self._read_metadata()
        except Exception as exc:
            self.metadata_error = exc
            raise
        meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        meta.load_id = self.load_id
        metadata.storage_meta = meta
        return metadata

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan`` into ``planner``; returns a completed future.

        A failure is raised from here (as DCP's ``FileSystemReader`` does), not stored in the future: torch's
        ``Future`` holds it from C++, out of the collector's sight, which would pin the exception, its frames
        and the state dict until the process ends. The failure's frames are cleared, so the exception, wherever
        it is kept, holds no read buffers or destination views either."""
        try:
            self._read(plan, planner)
        except Exception as exc:
            _release_frames(exc)
            raise
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- for the subclasses --------------------------------------------------------------------------
    def _read_metadata(self) -> Metadata:
        raise NotImplementedError

    def _read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        raise NotImplementedError

    def _probe(self) -> Probe:
        """The folder's state (``self.state``); a missing checkpoint raises."""
        found = probe(self.fs, self.path)
        self.state = found.state
        if found.state == "missing":
            raise CheckpointNotFound(f"no checkpoint at {self.url}")
        return found

    def _committed_metadata(self, manifest: Manifest) -> tuple[Metadata, str]:
        """The metadata ``manifest`` names, checked against its size and checksum, and where it was."""
        md_path = join(self.path, manifest.metadata.name)
        data = read_bytes_or_none(self.fs, md_path)
        if data is None:
            raise CheckpointCorrupt(f"{md_path}: metadata listed in the manifest is missing")
        if not manifest.metadata.matches(data):
            raise CheckpointCorrupt(
                f"{md_path}: size/checksum differ from the manifest ({len(data)} bytes, "
                f"manifest says {manifest.metadata.size})"
            )
        metadata = load_metadata(data, where=md_path)
        self.manifest = manifest
        return metadata, md_path


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

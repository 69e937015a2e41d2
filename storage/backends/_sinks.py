"""Byte sinks: where one data file's bytes go, sequentially, straight from the caller's buffers.

Every sink has ``write(memoryview)``, ``commit()`` (make the file complete and durable) and
``abort()`` (best-effort removal of a partial file; idempotent). ``commit`` after ``abort`` is an error.
Sinks copy the caller's bytes only where the backend needs its own buffer (S3 parts, unless ``borrow``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable
from typing import Any, Protocol

from smpckpt.storage.backends._fs import translate_errors
from smpckpt.storage.backends._nofollow import libc_function

__all__ = ["Sink", "LocalSink", "FsspecSink", "open_sink", "byte_view"]
__all__ += ["MIN_PART_SIZE", "MAX_PART_SIZE", "DEFAULT_PART_SIZE", "MAX_PARTS", "PART_GROWTH_EVERY", "part_size_of"]

# The S3 multipart limits, owned here (the writers check their options against them; the S3 sink
# starts with the part size it is given, never a clamped one): every part but the last at least 5 MiB,
# at most 5 GiB, at most 10,000 parts per upload.
MIN_PART_SIZE = 5 << 20
MAX_PART_SIZE = 5 << 30
MAX_PARTS = 10_000
#: S3 multipart parts are numbered from 1; every this many parts the size doubles (up to MAX_PART_SIZE),
#: so a streamed upload (its size unknown when its first parts go out) has no ceiling short of S3's
#: 5 TiB object limit whatever part size it starts from.
PART_GROWTH_EVERY = 1_000


def part_size_of(number: int, first: int, every: int = PART_GROWTH_EVERY) -> int:
    """The size of multipart part ``number`` (from 1) of an upload whose first part is ``first`` bytes:
    ``first``, doubled every ``every`` parts, and once more for the last ``every`` parts before
    :data:`MAX_PARTS` (up to :data:`MAX_PART_SIZE`)."""
    doublings = (number - 1) // every
    if number > max(every, MAX_PARTS - every):  # (a growth step past half the parts: never the first ones)
        # doubling alone from S3's 5 MiB minimum holds 1,000 x 5 MiB x 1,023 = 4.88 TiB in 10,000 parts, short
        # of its 5 TiB object: the last thousand parts take the next size (5 GiB from any start below 10 MiB),
        # which only files past the first 9,000 parts (2.4 TiB from 5 MiB) ever reach
        doublings += 1
    return min(MAX_PART_SIZE, first << doublings)


#: the writers' default part size (and the drain's copy chunk)
DEFAULT_PART_SIZE = 32 << 20


def byte_view(data: memoryview) -> memoryview:
    """``data`` as flat bytes (a typed or shaped view of the caller's memory, recast; no copy)."""
    return data.cast("B") if data.format != "B" or data.ndim != 1 else data


class Sink(Protocol):
    path: str
    #: whether the sink may keep views of what ``write`` was given until ``commit`` (S3 parts sent from
    #: the caller's memory, replication): a caller reusing a buffer sooner hands such a sink a copy. A
    #: sink without the attribute is taken to borrow.
    borrows: bool

    def write(self, data: memoryview) -> None: ...

    def commit(self) -> None: ...

    def abort(self) -> None: ...


#: libc ``sync_file_range``: starts (or waits for) write-back of a range (:func:`write_back`)
_sync_file_range = libc_function("sync_file_range", ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint)
_SYNC_FILE_RANGE_WAIT_BEFORE = 1
_SYNC_FILE_RANGE_WRITE = 2
_SYNC_FILE_RANGE_WAIT_AFTER = 4


def write_back(fd: int, offset: int, nbytes: int, *, wait: bool) -> bool:
    """Start (``wait=False``) or complete (``wait=True``) writeback of a file range (Linux
    ``sync_file_range``). Not durable on its own (no metadata, no disk cache flush). False where the
    call is unavailable or fails, so the caller falls back to fsync."""
    if _sync_file_range is None:
        return False
    flags = _SYNC_FILE_RANGE_WRITE
    if wait:
        flags |= _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WAIT_AFTER
    return _sync_file_range(fd, offset, nbytes, flags) == 0


# start writeback of what was written once this many bytes are pending
_WRITEBACK_BYTES = 8 << 20


class LocalSink:
    """A local/POSIX file written with unbuffered ``os.write`` from the caller's memory, then fsync'd.

    Create-only: ``O_CREAT | O_EXCL | O_NOFOLLOW``, relative to ``dir_fd`` (the folder's descriptor,
    opened without following links) when given, so neither another save's file nor a link planted under
    the name is ever written through: both fail the open with ``FileExistsError``."""

    borrows = False  # os.write is done with the bytes when it returns

    def __init__(self, path: str, *, sync: bool, dir_fd: int | None = None, name: str | None = None) -> None:
        self.path = path
        self._sync = sync
        self._dir_fd = dir_fd
        self._name: str = name if dir_fd is not None and name is not None else path
        from smpckpt.storage.backends._nofollow import open_new_at

        with translate_errors(path):
            self._fd: int | None = open_new_at(dir_fd, self._name, where=path)
        self._pos = 0
        self._flushed = 0

    def write(self, data: memoryview) -> None:
        if self._fd is None:
            raise ValueError(f"{self.path}: write after commit/abort")
        mv = byte_view(data)
        with translate_errors(self.path):
            while mv:
                n = os.write(self._fd, mv)
                mv = mv[n:]
                self._pos += n
        if self._sync and _sync_file_range is not None and self._pos - self._flushed >= _WRITEBACK_BYTES:
            # Start (not wait for) writeback of the bytes written so far, so the disk works while we
            # keep writing and the fsync in commit() has little left to flush. A hint only: commit()
            # still fsyncs everything.
            write_back(self._fd, self._flushed, self._pos - self._flushed, wait=False)
            self._flushed = self._pos

    def commit(self) -> None:
        if self._fd is None:
            raise ValueError(f"{self.path}: commit after commit/abort")
        fd, self._fd = self._fd, None
        with translate_errors(self.path):
            try:
                if self._sync:
                    os.fsync(fd)
            finally:
                os.close(fd)

    def abort(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(self._name, dir_fd=self._dir_fd)  # never through a link: unlink removes a name


class FsspecSink:
    """Any fsspec backend through ``fs.open(path, "wb")`` (memory://, gcs, ...).

    ``commit`` closes the file, which is what makes it visible on object stores. No ``os.sync()``:
    fsspec file objects have no descriptor to fsync, and a host-wide sync is not ours to call.
    """

    borrows = False  # fsspec's buffered files copy what they are given

    def __init__(self, fs: Any, path: str) -> None:
        self.path = path
        self._fs = fs
        with translate_errors(path):
            self._f: Any = fs.open(path, "wb")

    def write(self, data: memoryview) -> None:
        if self._f is None:
            raise ValueError(f"{self.path}: write after commit/abort")
        with translate_errors(self.path):
            self._f.write(byte_view(data))

    def commit(self) -> None:
        if self._f is None:
            raise ValueError(f"{self.path}: commit after commit/abort")
        f, self._f = self._f, None
        with translate_errors(self.path):
            f.close()

    def abort(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            # fsspec's discard drops the buffer: close() would commit a partial object on S3-like stores
            with contextlib.suppress(Exception):  # best effort
                (getattr(f, "discard", None) or f.close)()
        with contextlib.suppress(Exception):  # best effort
            self._fs.rm_file(self.path)


def open_sink(
    fs: Any,
    path: str,
    *,
    sync: bool,
    part_size: int,
    max_parts_in_flight: int,
    folder: Any,
    borrow: bool = False,
    sent: Callable[[int], None] | None = None,
) -> Sink:
    """The create-only sink for ``path`` on ``fs``, opened relative to ``folder`` (a ``_folder.Folder``
    holding ``path``: :meth:`~._folder.Folder.sink`). ``borrow=True``: the caller does not change the
    memory it passes to ``write`` until ``commit``/``abort`` returns, so a sink may send it without
    copying (S3). ``sent(bytes)``: told as each S3 part's upload ends (its borrowed bytes let go: the
    drain's budget)."""
    name = path[len(folder.path.rstrip("/")) + 1 :]
    return folder.sink(
        name, sync=sync, part_size=part_size, max_parts_in_flight=max_parts_in_flight, borrow=borrow, sent=sent
    )

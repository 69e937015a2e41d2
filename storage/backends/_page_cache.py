"""Local reads that know the page cache: a read that takes only what is cached (``RWF_NOWAIT``), whether a
file lives in memory (tmpfs), and access-pattern advice to the kernel (``posix_fadvise``).

Why: a reader that verifies what it reads wants each check unit hashed right after it is copied, while
the unit is still in the CPU cache (one pass over memory instead of two), which means reading in
unit-sized requests -- right for bytes already in memory, wrong for a cold disk, which wants a few
large requests. ``RWF_NOWAIT`` tells them apart per request, for free. And a strided read (a column
shard: one run per row) must not let the kernel's read-ahead fetch the gaps between its runs.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

__all__ = ["pread_cached", "NOT_SUPPORTED", "in_memory", "advise_random", "device_read_bytes"]

#: :func:`pread_cached`'s answer where the filesystem cannot tell (tmpfs, NFS, FUSE, non-Linux)
NOT_SUPPORTED = -1

_RWF_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)
#: filesystems whose files are memory: reading them never waits for a device
_MEMORY_FS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})


def pread_cached(fd: int, views: Sequence[memoryview], offset: int, dev: int) -> int:
    """Read file bytes at ``offset`` into ``views`` (filled in order) as far as they are in the page
    cache, without waiting for the device: the bytes read (0 when the first page is not cached; fewer
    than asked when a later one is not, or the file ends), or :data:`NOT_SUPPORTED` where the
    filesystem (``dev``: the file's ``st_dev``) cannot read so. Nothing is remembered here (the package
    keeps no state between calls): a caller reading a file chunk by chunk asks once and keeps the answer."""
    if _RWF_NOWAIT is None:
        return NOT_SUPPORTED
    try:
        got = os.preadv(fd, views, offset, _RWF_NOWAIT)
    except BlockingIOError:
        got = 0  # EAGAIN: the first page is not in the page cache
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        return NOT_SUPPORTED
    return got


def in_memory(dev: int) -> bool:
    """Whether files on the filesystem of ``st_dev`` ``dev`` live in memory (tmpfs, ramfs), by
    ``/proc/self/mountinfo`` (about 45 us: ask once per request); ``False`` where that cannot be told."""
    return _fstype(dev) in _MEMORY_FS


def _fstype(dev: int) -> str:
    want = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                # "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw": field 3 is the device,
                # the first field after " - " the filesystem type
                fields = line.split()
                if len(fields) > 2 and fields[2] == want and " - " in line:
                    return line.split(" - ", 1)[1].split()[0]
    except OSError:
        pass
    return ""


def advise_random(fd: int, random: bool = True) -> None:
    """Read-ahead advice for this descriptor (it applies to this open file only). ``random``: none
    (``POSIX_FADV_RANDOM``), for strided and scattered reads, whose gaps read-ahead would fetch from the
    device for nothing (measured: a column shard's device bytes 1.49x the bytes it asked for, a row
    split's 1.13x); else a larger window (``POSIX_FADV_SEQUENTIAL``), for a run of requests that follow
    each other."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM if random else os.POSIX_FADV_SEQUENTIAL)
        except OSError:
            pass  # advice only: a filesystem that refuses it reads as before


def device_read_bytes() -> int | None:
    """Bytes this process has caused to be read from storage devices so far (``read_bytes`` of
    ``/proc/self/io``: every thread of the process; page-cache hits are not counted, read-ahead is), or
    ``None`` where the OS does not report it."""
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None

"""POSIX primitives of the commit protocol: names resolved against directory descriptors, never through a link.

Every helper here takes a directory descriptor and a *single* name (no ``/``): the kernel resolves that
name once, against that descriptor, so no component of a path can be swapped for a symbolic link
between a check and the operation. :mod:`._folder` builds the protocol's folder on these.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import stat
import sys
from collections.abc import Callable, Iterator
from typing import Any, cast

from smpckpt.errors import UnsafeCheckpoint

__all__ = ["DIR_FLAGS", "NEW_FLAGS", "open_dir_at", "open_parent_and_name", "create_at", "open_new_at"]
__all__ += ["remove_tree_at", "rename_noreplace", "walk_sizes", "libc_function", "MAX_DEPTH", "drop_temp"]
__all__ += ["link_noreplace"]

log = logging.getLogger(__name__)

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
#: a folder inside a checkpoint: never through a link
DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_NOFOLLOW | _CLOEXEC
#: a new file: created by this call or not at all (a file or link already under the name: EEXIST)
NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC
#: folders below a checkpoint folder a walk descends into (checkpoints use at most two prefix levels)
MAX_DEPTH = 8
_LINK_ERRNOS = (errno.ELOOP, errno.ENOTDIR, getattr(errno, "EMLINK", errno.ELOOP))


def _refuse_link(exc: OSError, where: str) -> None:
    if exc.errno in _LINK_ERRNOS:
        raise UnsafeCheckpoint(
            f"{where} is a symbolic link (or not a folder): smpckpt never writes, reads for a commit or "
            "deletes through a link inside a checkpoint root"
        ) from exc


def open_dir_at(dir_fd: int | None, name: str, *, create: bool = False, where: str = "") -> int:
    """A descriptor of folder ``name`` inside ``dir_fd`` (``None``: ``name`` is a path, opened the same
    way), made first when ``create``. A link under the name is :class:`UnsafeCheckpoint`."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o755, dir_fd=dir_fd)
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        _refuse_link(exc, where or name)
        raise


def open_parent_and_name(path: str, *, create_parent: bool = False) -> tuple[int, str]:
    """``(descriptor of path's parent, path's last component)``. The parent is opened by path, links
    followed: a checkpoint root may sit behind links (``/fsx`` -> ``/mnt/fsx``); what is below it is
    resolved from here without following any."""
    path = os.path.abspath(path)
    parent, name = os.path.split(path.rstrip("/") or "/")
    if not name:  # "/" itself
        return os.open("/", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC), "."
    if create_parent:
        os.makedirs(parent, exist_ok=True)
    return os.open(parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC), name


def create_at(dir_fd: int, name: str, data: bytes | memoryview, *, sync: bool, where: str) -> None:
    """Create file ``name`` in ``dir_fd`` holding ``data`` (create-only; fsynced when ``sync``).
    A failure after the create removes what was created (nothing torn stays under the name)."""
    fd = open_new_at(dir_fd, name, where=where)
    try:
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(fd, view) :]
        if sync:
            os.fsync(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)
        raise
    finally:
        os.close(fd)


#: what a create-only open that found something under its name says (the file is named with it)
EXISTS = "exists: another save's file, or a link planted under its name; a save creates its files, never writes into existing ones"


def open_new_at(dir_fd: int | None, name: str, *, where: str) -> int:
    """A write descriptor of file ``name`` created in ``dir_fd`` by this call (``O_CREAT | O_EXCL |
    O_NOFOLLOW``); ``FileExistsError`` naming ``where`` when anything is there."""
    try:
        return os.open(name, NEW_FLAGS, 0o644, dir_fd=dir_fd)
    except FileExistsError as exc:
        raise FileExistsError(errno.EEXIST, EXISTS, where) from exc


def walk_sizes(dir_fd: int, prefix: str = "", depth: int = 0) -> Iterator[tuple[str, int | None]]:
    """``(relative name, size)`` of every entry under ``dir_fd``; a link or anything that is not a plain
    file gives ``None`` (never a size read through a link), and folders are descended without following
    links. One listing (``getdents``) per folder."""
    with os.scandir(dir_fd) as it:
        entries = list(it)
    for e in entries:
        rel = f"{prefix}{e.name}"
        try:
            st = e.stat(follow_symlinks=False)
        except FileNotFoundError:
            # removed since the listing (another save's temp file, renamed or discarded): not there
            continue
        if stat.S_ISDIR(st.st_mode):
            if depth >= MAX_DEPTH:
                yield rel + "/", None
                continue
            try:
                sub = os.open(e.name, DIR_FLAGS, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, *_LINK_ERRNOS):
                    continue  # gone, or swapped for a link since the listing: not ours to read
                raise
            try:
                if not os.path.samestat(st, os.fstat(sub)):
                    continue  # swapped since the listing
                yield from walk_sizes(sub, rel + "/", depth + 1)
            finally:
                os.close(sub)
        else:
            yield rel, st.st_size if stat.S_ISREG(st.st_mode) else None


def remove_tree_at(
    dir_fd: int, name: str, *, where: str, device: int | None = None, depth: int = 0, last: str | None = None
) -> list[str]:
    """Remove ``name`` (file, link or folder) inside ``dir_fd``, never following a link: a link is
    removed itself; a folder is opened with ``O_NOFOLLOW``, checked to be the very folder listed (device
    and inode) and on ``device`` (a mount inside a checkpoint is not descended), emptied the same way and
    removed. Returns the paths (``where``-relative) that could not be removed; a missing name is removed.
    ``last``: a child of the folder removed after the rest, and only once the rest is gone."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return []
    except OSError:
        return [where]
    if not stat.S_ISDIR(st.st_mode):
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not remove %s: %s", where, exc)
            return [where]
        return []
    if (device is not None and st.st_dev != device) or depth > MAX_DEPTH:
        log.warning("%s is on another device (a mount) or too deep: not descended, not removed", where)
        return [where]
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return []
    except OSError as exc:
        if exc.errno in _LINK_ERRNOS:  # swapped for a link after the stat: the link goes, never its target
            return remove_tree_at(dir_fd, name, where=where, device=device, depth=depth + 1)
        return [where]
    failed: list[str] = []
    try:
        if not os.path.samestat(st, os.fstat(fd)):
            return [where]  # swapped for another folder after the stat: not the one listed
        with os.scandir(fd) as it:
            children = [e.name for e in it]
        failed = _remove_children(fd, children, where, st.st_dev, depth + 1, last)
    finally:
        os.close(fd)
    if not failed:
        try:
            os.rmdir(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not remove the folder %s: %s", where, exc)
            failed.append(where)
    return failed


#: rounds of removing what appeared in a folder during its removal, before its mark goes
LATE_ROUNDS = 3


class MarkGone(Exception):
    """(a removal) Its mark went meanwhile: another removal finished the job, or one that found a commit left;
    what is there now (a new save's files) is not this removal's to delete (rev65a F1, rev65c F3-F5)."""


def _remove_children(fd: int, children: list[str], where: str, device: int, depth: int, last: str | None) -> list[str]:
    """:func:`remove_tree_at` of each child of the folder ``fd``; ``last`` after the others, once the folder,
    listed again, holds nothing else. What appeared meanwhile (a racing commit's manifest, its data already
    gone) is removed too, for a few rounds: left beside the mark, a killed save's manifest read as committed
    (rev64e F1); a commit still running finds its files gone and fails. Kept if anything failed."""
    failed: list[str] = []
    if last is not None and last not in children:
        raise MarkGone(where)
    for child in children:
        if child != last:
            failed += remove_tree_at(fd, child, where=f"{where}/{child}", device=device, depth=depth)
    if last is None or failed:
        return failed
    for round_ in range(LATE_ROUNDS + 1):
        with os.scandir(fd) as it:
            names = [e.name for e in it]
        if last not in names:
            raise MarkGone(where)
        late = [n for n in names if n != last]
        if not late:
            return remove_tree_at(fd, last, where=f"{where}/{last}", device=device, depth=depth)
        if round_ == LATE_ROUNDS:
            break
        for child in late:
            failed += remove_tree_at(fd, child, where=f"{where}/{child}", device=device, depth=depth)
        if failed:
            return failed
    return [f"{where}/{n}" for n in late]  # files keep appearing: the mark stays, the next removal finishes


def libc_function(name: str, *argtypes: Any) -> Callable[..., int] | None:
    """libc's ``name`` taking ``argtypes`` and returning an ``int`` (Linux), or None: another OS, or a
    libc without it. For the calls Python's ``os`` has no binding for."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
    return cast(Callable[..., int], fn)


#: glibc >= 2.28
_renameat2 = libc_function("renameat2", ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
_RENAME_NOREPLACE = 1


def rename_noreplace(
    src_dir_fd: int, src: str, dst_dir_fd: int, dst: str, *, otherwise: Callable[[], None] | None = None
) -> None:
    """Rename ``src`` to ``dst`` only if nothing is at ``dst`` (``FileExistsError`` otherwise), atomically
    where the kernel offers ``renameat2(RENAME_NOREPLACE)`` (Linux: ext4, xfs, tmpfs, Lustre, ...).
    Elsewhere (or where the filesystem refuses the flag) ``otherwise()`` when given, else a check then
    ``rename``: a rename still never replaces a non-empty folder, and the window left is between the check
    and the rename."""
    if _renameat2 is not None:
        if _renameat2(src_dir_fd, os.fsencode(src), dst_dir_fd, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, getattr(errno, "EOPNOTSUPP", errno.ENOTSUP)):
            raise OSError(code, os.strerror(code), dst)
    if otherwise is not None:
        otherwise()
        return
    try:
        os.stat(dst, dir_fd=dst_dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        os.rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        return
    raise FileExistsError(errno.EEXIST, "exists", dst)


def drop_temp(dir_fd: int, tmp: str, where: str) -> None:
    """Remove a temporary name after its file was linked or renamed into place (or failed to be). A name
    that cannot be removed must not turn a landed write into a reported failure: it is debris (prune
    removes it), named in a warning."""
    try:
        os.unlink(tmp, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove the temporary file %s/%s: %s", where.rpartition("/")[0], tmp, exc)


def link_noreplace(dir_fd: int, tmp: str, base: str, in_place: Callable[[], None] | None = None) -> None:
    """Give the temporary ``tmp`` the name ``base`` only if nothing is there (``FileExistsError``): a hard link,
    or where the filesystem has none (some FUSE mounts) an atomic rename replacing nothing (created in place,
    a kill between the create and the write left an empty manifest that blocked its tag for good). Where
    that is refused too, ``in_place`` (a publication's exclusive create: a check then the rename let two
    racing commits of one tag both succeed, the later replacing the earlier, rev68d F1), else the check."""
    try:
        os.link(tmp, base, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        rename_noreplace(dir_fd, tmp, dir_fd, base, otherwise=in_place)

"""Path-level helpers of the commit protocol's folder (:mod:`._folder`): a small file written atomically,
one published exclusively, exact removals, a folder's removal -- each resolving what is inside the
folder it is given without following links (POSIX)."""

from __future__ import annotations

import errno
import logging
import os
import stat
from typing import Any

from smpckpt.storage.backends import _nofollow as nf
from smpckpt.storage.backends._folder import Folder, drop_temp, temp_name
from smpckpt.storage.backends._fs import _protocol, is_local, join, translate_errors

__all__ = ["write_bytes_atomic", "create_bytes_exclusive", "remove_files", "remove_tree"]

log = logging.getLogger(__name__)


def write_bytes_atomic(fs: Any, path: str, data: bytes, *, sync: bool = True, sync_dir: bool = True) -> None:
    """Write a small file so a reader sees the old content or all of the new, never a torn file (``newest``,
    markers, the stock ``.metadata``). POSIX: a create-only temporary renamed into place relative to the
    folder's descriptor (a link under the name is replaced, never followed); the folder's fsync unless
    ``sync_dir=False``. Object stores: one PUT."""
    folder, _, name = path.rstrip("/").rpartition("/")
    with Folder(fs, folder or "/", follow=True) as f:
        if not f.local:
            f.publish(name, data, sync=sync, replace=True)
            return
        if sync_dir:
            f.publish(name, data, sync=sync, replace=True)
        else:
            _replace_nosync_dir(f, name, data, sync)


def _replace_nosync_dir(f: Folder, name: str, data: bytes, sync: bool) -> None:
    tmp = temp_name(name)
    with translate_errors(f.where(name)):
        nf.create_at(f.fd, tmp, data, sync=sync, where=f.where(name))
        try:
            os.replace(tmp, name, src_dir_fd=f.fd, dst_dir_fd=f.fd)
        finally:
            drop_temp(f.fd, tmp, f.where(name))


def create_bytes_exclusive(fs: Any, path: str, data: bytes, *, sync: bool = True) -> None:
    """Publish ``path`` holding ``data`` only if nothing is there (``FileExistsError``): :meth:`Folder.publish`
    on its folder (the folder followed as named)."""
    folder, _, name = path.rstrip("/").rpartition("/")
    with Folder(fs, folder or "/", follow=True) as f:
        f.publish(name, data, sync=sync)


def remove_files(fs: Any, paths: list[str], *, within: str | None = None) -> list[str]:
    """Best-effort removal of exactly these files (never a glob); the paths not removed (missing ones count
    as removed). ``within``: the checkpoint folder they are named in; on POSIX every path is resolved from
    it without following links (a path outside it, or through a link, is not removed). Without
    ``within`` each path's own folder is opened as named."""
    if not paths:
        return []
    if not is_local(fs):
        return Folder(fs, "").remove(paths) if within is None else _remove_in(fs, within, paths)
    if within is not None:
        return _remove_in(fs, within, paths)
    failed: list[str] = []
    for p in paths:
        folder, _, name = p.rstrip("/").rpartition("/")
        try:
            with Folder(fs, folder or "/", follow=True) as f:
                failed += f.remove([name])
        except FileNotFoundError:
            pass
        except OSError:
            failed.append(p)
    return failed


def _remove_in(fs: Any, within: str, paths: list[str]) -> list[str]:
    base = within.rstrip("/") + "/"
    inside = [p[len(base) :] for p in paths if p.startswith(base) and ".." not in p[len(base) :].split("/")]
    outside = [p for p in paths if not (p.startswith(base) and ".." not in p[len(base) :].split("/"))]
    for p in outside:
        log.warning("%s is not inside %s: not removed", p, within)
    if not is_local(fs):
        return outside + Folder(fs, within).remove(inside)
    try:
        with Folder(fs, within) as f:
            return outside + f.remove(inside)
    except FileNotFoundError:
        return outside
    except OSError as exc:  # the folder itself is a link (UnsafeCheckpoint) or unreadable
        log.warning("%s: nothing removed in it: %s", within, exc)
        return outside + [join(within, n) for n in inside]


def remove_tree(fs: Any, folder: str) -> list[str]:
    """Delete ``folder`` and everything under it (no globbing anywhere); the paths not removed. POSIX: an
    fd-based walk that never follows a link (:func:`~._nofollow.remove_tree_at`): a folder that is itself a
    link loses the link only; a link inside it goes itself. A missing folder raises ``FileNotFoundError``."""
    if is_local(fs):
        parent, name = nf.open_parent_and_name(folder)
        try:
            try:
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                raise FileNotFoundError(errno.ENOENT, "no such folder", folder) from None
            if stat.S_ISLNK(st.st_mode):
                log.warning("%s is a link to %s: removed the link, left its target", folder, os.path.realpath(folder))
            elif not stat.S_ISDIR(st.st_mode):
                raise FileNotFoundError(errno.ENOENT, "not a folder", folder)
            return nf.remove_tree_at(parent, name, where=folder, device=st.st_dev)
        finally:
            os.close(parent)
    with translate_errors(folder):
        found = fs.find(folder, withdirs=True, detail=True)
    if not found and not fs.exists(folder):
        raise FileNotFoundError(folder)
    base = folder.rstrip("/") + "/"
    files = [str(p)[len(base) :] for p, info in found.items() if info.get("type") != "directory"]
    files = [f for f in files if f]
    failed = Folder(fs, folder).remove(files)
    if _protocol(fs) == "memory":
        dirs = [p for p, info in found.items() if info.get("type") == "directory"]
        for d in sorted(set(dirs) | {folder}, key=lambda p: p.count("/"), reverse=True):
            try:
                with translate_errors(d):
                    fs.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError:
                failed.append(d)
    return failed

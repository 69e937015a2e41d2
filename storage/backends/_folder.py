"""The storage half of the one commit protocol: a folder whose files are created, never overwritten, and
removed without following links (``storage/format/commit.py`` is the other half: what a commit checks,
in which order).

Every file a save writes is **created exclusively** and never opened for overwrite:

* POSIX: the folder is opened once (:class:`Folder`; its parent by path, the folder itself with
  ``O_NOFOLLOW``) and every name inside is resolved against that descriptor (:mod:`._nofollow`): files
  ``O_CREAT | O_EXCL | O_NOFOLLOW``, so another save's file or a planted link fails the create with
  ``FileExistsError`` naming it.
* S3: conditional requests (``If-None-Match: *`` on ``PutObject`` and ``CompleteMultipartUpload``; a
  replacement ``If-Match`` with the ETag just read).
* ``memory://`` and other fsspec backends: check, then write, under a process-wide lock (not exclusive
  against other processes).

Files that must appear whole (the manifest, ``newest``, the stock ``.metadata``) are *published*: a
create-only temporary linked (no replace) or renamed (replace) into place. Removals never follow links:
a link found anywhere is removed itself, its target never (README, "Deletes never follow links").
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fcntl
import functools
import logging
import os
import re
import stat
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from smpckpt.storage.backends import _nofollow as nf
from smpckpt.storage.backends._fs import _protocol, file_sizes, is_local, is_s3, join, translate_errors
from smpckpt.storage.backends._sinks import FsspecSink, LocalSink, Sink

__all__ = ["Folder", "precondition", "temp_name", "is_temp_name", "write_bytes_atomic"]
__all__ += ["create_bytes_exclusive", "remove_files", "remove_tree"]


log = logging.getLogger(__name__)

_MEMORY_LOCK = threading.Lock()


def precondition(exc: BaseException) -> bool:
    """Whether ``exc`` (translated by s3fs, then named by ours, or not) is S3's 412 Precondition Failed."""
    e: BaseException | None = exc
    for _ in range(4):  # ours <- s3fs's <- botocore's ClientError
        response = getattr(e, "response", None)
        if isinstance(response, dict) and response.get("Error", {}).get("Code") in ("PreconditionFailed", "412"):
            return True
        e = e.__cause__ if e is not None else None
    return False


def temp_name(base: str, tag: str = "tmp") -> str:
    """A temporary name beside ``base``: ``<base>.tmp.<pid>.<8 hex>`` (a publication or an atomic
    replacement) or, ``tag="recv"``, ``<base>.recv.<pid>.<8 hex>`` (a fast-tier transfer)."""
    return f"{base}.{tag}.{os.getpid()}.{os.urandom(4).hex()}"


_TEMP_RE = re.compile(r"\.(?:tmp|recv)\.\d+\.[0-9a-f]{8}$")


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is a :func:`temp_name` (an interrupted write's leftover, for prune)."""
    return bool(_TEMP_RE.search(name))


class Folder:
    """A checkpoint folder (or root, ``follow=True``) opened for one step of a save or a removal.

    POSIX: holds a descriptor of the folder and of each sub-folder it touched; close it (a ``with``
    block) when the step is done. Not picklable on purpose: writers open one per step, never keep one.
    ``create=True`` makes the folder (and its parents) when missing. A folder that is a link is
    :class:`~smpckpt.errors.UnsafeCheckpoint` unless ``follow`` (a root named by the caller)."""

    def __init__(self, fs: Any, path: str, *, create: bool = False, follow: bool = False) -> None:
        self.fs, self.path = fs, (path.rstrip("/") or path)
        self.local = is_local(fs)
        self.s3 = is_s3(fs)
        self._dirs: dict[str, int] = {}
        self._lock = threading.Lock()
        if self.local:
            with translate_errors(self.path):
                if follow:
                    if create:
                        os.makedirs(self.path, exist_ok=True)
                    fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
                else:
                    parent, name = nf.open_parent_and_name(self.path, create_parent=create)
                    try:
                        fd = nf.open_dir_at(parent, name, create=create, where=self.path)
                    finally:
                        os.close(parent)
            self._dirs[""] = fd

    def __enter__(self) -> Folder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            fds, self._dirs = list(self._dirs.values()), {}
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- names ---------------------------------------------------------------------------------------
    def where(self, name: str) -> str:
        return join(self.path, name)

    @property
    def fd(self) -> int:
        """(POSIX) The folder's own descriptor."""
        return self._dirs[""]

    def dir_fd(self, rel: str, *, create: bool = False) -> int:
        """(POSIX) Descriptor of the sub-folder ``rel`` (``a/b``), each level opened without following links."""
        with self._lock:
            fd = self._dirs.get(rel)
            if fd is not None:
                return fd
            parent_rel, _, name = rel.rpartition("/")
        parent = self.dir_fd(parent_rel, create=create) if parent_rel else self._dirs[""]
        fd = nf.open_dir_at(parent, name, create=create, where=self.where(rel))
        with self._lock:
            if rel in self._dirs:  # another thread opened it meanwhile
                os.close(fd)
                return self._dirs[rel]
            self._dirs[rel] = fd
            return fd

    def _at(self, name: str, *, create_dirs: bool = False) -> tuple[int, str]:
        rel, _, base = name.rpartition("/")
        return (self.dir_fd(rel, create=create_dirs) if rel else self._dirs[""]), base

    # -- create-only writes ------------------------------------------------------------------------------
    def create(self, name: str, data: bytes | memoryview, *, sync: bool) -> None:
        """Create file ``name`` holding ``data``, only if nothing is there (``FileExistsError``)."""
        where = self.where(name)
        with translate_errors(where):
            if self.local:
                dir_fd, base = self._at(name, create_dirs=True)
                nf.create_at(dir_fd, base, data, sync=sync, where=where)
            elif self.s3:
                from smpckpt.storage.backends._s3 import get_object

                bucket, key, _ = self.fs.split_path(where)
                try:
                    self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=bytes(data), IfNoneMatch="*")
                except OSError as exc:  # a 412 without <Condition> comes from s3fs as OSError(EINVAL)
                    if not (isinstance(exc, FileExistsError) or precondition(exc)):
                        raise
                    # a PUT that landed, its reply lost, is refused on its retry by itself: the same bytes are
                    # this call's (every create-only object's bytes name their save: its id, a removal's nonce;
                    # a full artifact's fixed-name files are written behind the save's own marker). Gone since
                    # the 412 (404): another's, removed meanwhile
                    try:
                        own = get_object(self.fs, where) == bytes(data)
                    except FileNotFoundError:
                        own = False
                    if not own and isinstance(exc, FileExistsError):
                        raise
                    if not own:
                        raise FileExistsError(errno.EEXIST, nf.EXISTS, where) from exc
                self.fs.invalidate_cache(where)
            else:
                with _MEMORY_LOCK if _protocol(self.fs) == "memory" else contextlib.nullcontext():
                    if self.fs.exists(where):
                        raise FileExistsError(errno.EEXIST, nf.EXISTS, where)
                    self.fs.pipe_file(where, bytes(data))

    def create_sized(self, name: str, size: int, pieces: Sequence[tuple[int, bytes]], *, sync: bool) -> None:
        """(POSIX) Create file ``name`` at ``size`` bytes with ``pieces`` (offset, bytes) in place, the rest a
        hole for the ranks to fill (a full artifact's file)."""
        dir_fd, base = self._at(name)
        with translate_errors(self.where(name)):
            fd = nf.open_new_at(dir_fd, base, where=self.where(name))
            try:
                os.ftruncate(fd, size)
                for offset, data in pieces:
                    os.pwrite(fd, data, offset)
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)

    def open_for_write(self, name: str) -> int:
        """(POSIX) A write descriptor of the existing file ``name`` this save created (never through a link)."""
        dir_fd, base = self._at(name)
        with translate_errors(self.where(name)):
            return os.open(base, os.O_WRONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)

    def sink(
        self,
        name: str,
        *,
        sync: bool,
        part_size: int,
        max_parts_in_flight: int,
        borrow: bool = False,
        sent: Callable[[int], None] | None = None,
    ) -> Sink:
        """A create-only sink for data file ``name`` (its prefix folder made when missing)."""
        where = self.where(name)
        if self.local:
            dir_fd, base = self._at(name, create_dirs=True)
            return LocalSink(where, sync=sync, dir_fd=dir_fd, name=base)
        if self.s3:
            from smpckpt.storage.backends._s3 import S3MultipartSink

            return S3MultipartSink(
                self.fs, where, part_size=part_size, max_in_flight=max_parts_in_flight, borrow=borrow, sent=sent
            )
        with _MEMORY_LOCK if _protocol(self.fs) == "memory" else contextlib.nullcontext():
            with translate_errors(where):
                if self.fs.exists(where):
                    raise FileExistsError(errno.EEXIST, nf.EXISTS, where)
            return FsspecSink(self.fs, where)

    def open_temp(self, name: str, *, tag: str = "tmp") -> tuple[int, str]:
        """(POSIX) A create-only temporary file beside ``name`` (its folder made when missing), to be filled
        and then :meth:`link_temp`-ed into place: ``(write descriptor, temporary name)``."""
        rel, _, base = name.rpartition("/")
        dir_fd = self.dir_fd(rel, create=True) if rel else self._dirs[""]
        tmp = temp_name(base, tag)
        with translate_errors(self.where(name)):
            fd = nf.open_new_at(dir_fd, tmp, where=self.where(name))
        return fd, f"{rel}/{tmp}" if rel else tmp

    def link_temp(self, tmp: str, name: str, *, sync: bool, replace: bool = False) -> None:
        """(POSIX) Give the temporary ``tmp`` (from :meth:`open_temp`, filled and closed) the name ``name``,
        only if nothing is there (``FileExistsError``; ``replace``: in place of what is there, a link
        replaced as a name), then drop the temporary name."""
        dir_fd, base = self._at(name)
        tmp_base = tmp.rpartition("/")[2]
        with translate_errors(self.where(name)):
            try:
                if replace:
                    os.replace(tmp_base, base, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                else:
                    nf.link_noreplace(dir_fd, tmp_base, base)
            finally:
                nf.drop_temp(dir_fd, tmp_base, self.where(name))
            if sync:
                os.fsync(dir_fd)

    def publish(self, name: str, data: bytes, *, sync: bool, replace: bool = False) -> None:
        """Make ``name`` appear holding ``data`` whole (readers see nothing, or all of it): created only if
        absent (``FileExistsError``), or with ``replace`` in place of what is there. POSIX: a create-only
        temporary, then ``linkat`` (no replace) or ``renameat`` (replace; a link under the name is replaced
        as a name, never followed), then the folder's fsync. S3: one conditional PUT."""
        where = self.where(name)
        if not self.local:
            if not replace:
                self.create(name, data, sync=sync)
                return
            with translate_errors(where):
                self.fs.pipe_file(where, data)
            return
        dir_fd, base = self._at(name)
        tmp = temp_name(base)
        with translate_errors(where):
            nf.create_at(dir_fd, tmp, data, sync=sync, where=where)
            try:
                if replace:
                    os.replace(tmp, base, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                else:
                    in_place = functools.partial(nf.create_at, dir_fd, base, data, sync=sync, where=where)
                    nf.link_noreplace(dir_fd, tmp, base, in_place)
            finally:
                nf.drop_temp(dir_fd, tmp, where)
            if sync:
                os.fsync(dir_fd)

    def replace_if(self, name: str, data: bytes, expect: bytes, *, sync: bool) -> None:
        """Replace ``name`` with ``data`` only while it still holds ``expect`` (what a save saw when it
        began), else ``FileExistsError``. S3: the object's ETag is read with it and the PUT names it
        (``If-Match``): exact. POSIX: compared and renamed under ``flock`` of the folder (two processes'
        overwrites both succeeded in the window between: rev68f F1), which excludes one node's processes;
        across nodes on NFS, or on Lustre without ``-o flock``, a narrow window remains."""
        where = self.where(name)
        if self.s3:
            from smpckpt.storage.backends._s3 import get_object, get_object_and_etag

            bucket, key, _ = self.fs.split_path(where)
            current, etag = get_object_and_etag(self.fs, where)
            if current != expect:
                raise FileExistsError(errno.EEXIST, "another save replaced it meanwhile", where)
            with translate_errors(where):
                try:
                    self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfMatch=etag)
                except OSError as exc:
                    # a 412 is another save's object, or this PUT's own: landed, its reply lost, the retry
                    # refused by it (rev68c F1). The bytes tell; a failed GET is raised (an uncertain commit)
                    if not precondition(exc):
                        raise
                    if get_object(self.fs, where) != data:
                        raise FileExistsError(errno.EEXIST, "another save replaced it meanwhile", where) from exc
            self.fs.invalidate_cache(where)
            return
        with self._locked(name):
            if self.read(name) != expect:
                raise FileExistsError(errno.EEXIST, "another save replaced it meanwhile", where)
            self.publish(name, data, sync=sync, replace=True)

    @contextlib.contextmanager
    def _locked(self, name: str) -> Iterator[None]:
        """(local disk) ``flock`` of ``name``'s folder, held by one open of it at a time (a process's, or
        another ``Folder``'s in this one); nothing where the filesystem refuses it."""
        if not self.local:
            yield
            return
        with flocked(self._at(name)[0]):
            yield

    # -- reading what the commit checks ------------------------------------------------------------------
    def read(self, name: str) -> bytes | None:
        """The whole (small) file ``name``, or ``None`` when absent; never through a link."""
        where = self.where(name)
        if not self.local:
            from smpckpt.storage.backends._fs import read_bytes_or_none

            return read_bytes_or_none(self.fs, where)
        dir_fd, base = self._at(name)
        with translate_errors(where):
            try:
                fd = os.open(base, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
            except FileNotFoundError:
                return None
            try:
                with os.fdopen(fd, "rb", closefd=False) as f:
                    return f.read()
            finally:
                os.close(fd)

    def exists(self, name: str) -> bool:
        """Whether anything (a link too) is under ``name``."""
        if not self.local:
            return self.read(name) is not None
        dir_fd, base = self._at(name)
        try:
            os.stat(base, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def listing(self) -> dict[str, int | None]:
        """Every file under the folder (prefix folders included): relative name -> size, ``None`` for a link
        or anything that is not a plain file. One listing (on S3 a LIST per 1,000 objects)."""
        if self.local:
            with translate_errors(self.path):
                return dict(nf.walk_sizes(self._dirs[""]))
        self.fs.invalidate_cache(self.path)
        return dict(file_sizes(self.fs, self.path))

    def fsync(self, name: str | None = None) -> None:
        """(POSIX) fsync file ``name`` (never through a link), or the folder itself."""
        if not self.local:
            return
        if name is None:
            os.fsync(self._dirs[""])
            return
        dir_fd, base = self._at(name)
        with translate_errors(self.where(name)):
            fd = os.open(base, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def fsync_dirs(self) -> None:
        """(POSIX) fsync every sub-folder touched, then the folder: new names survive a power loss."""
        with self._lock:
            items = sorted(self._dirs.items(), key=lambda kv: -kv[0].count("/") - bool(kv[0]))
        for _, fd in items:
            os.fsync(fd)

    # -- removal -----------------------------------------------------------------------------------------
    def remove(self, names: Iterable[str]) -> list[str]:
        """Remove exactly these files (relative names); the paths that could not be removed (missing ones
        count as removed). POSIX: ``unlinkat`` relative to the file's folder, opened without following
        links (a link under a name goes itself; a linked prefix folder is never entered: its names fail),
        then the prefix folders left empty. S3: DeleteObjects of up to 1,000 exact keys (never a glob), in no
        order; other object stores: one DELETE per key."""
        names = list(dict.fromkeys(names))
        if not self.local:
            return self._remove_objects(names)
        failed: list[str] = []
        emptied: set[str] = set()
        for name in names:
            rel, _, base = name.rpartition("/")
            try:
                dir_fd = self.dir_fd(rel) if rel else self._dirs[""]
                os.unlink(base, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            except Exception as exc:  # noqa: BLE001 - reported as not removed (UnsafeCheckpoint: a link)
                log.warning("%s not removed: %s", self.where(name), exc)
                failed.append(self.where(name))
                continue
            if rel:
                emptied.add(rel)
        for rel in sorted(emptied, key=lambda r: -r.count("/")):
            parent_rel, _, base = rel.rpartition("/")
            with contextlib.suppress(OSError):  # still holds files: it stays
                os.rmdir(base, dir_fd=self.dir_fd(parent_rel) if parent_rel else self._dirs[""])
        return failed

    def _remove_objects(self, names: list[str]) -> list[str]:
        def one(name: str) -> str | None:
            where = self.where(name)
            try:
                with translate_errors(where):
                    self.fs.rm_file(where)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("%s not removed: %s", where, exc)
                return where
            return None

        def each(names: list[str]) -> list[str]:
            if len(names) < 2:
                return [p for p in map(one, names) if p is not None]
            with concurrent.futures.ThreadPoolExecutor(min(8, len(names)), thread_name_prefix="smpckpt-rm") as pool:
                return [p for p in pool.map(one, names) if p is not None]

        if self.s3 and len(names) > 1 and self.path:  # a folder of one bucket (not remove_files' "")
            # DeleteObjects: up to 1,000 exact keys a request (no order among them: the callers remove
            # what must go first or last in a step of its own)
            return [p for i in range(0, len(names), 1000) for p in self._delete_batch(names[i : i + 1000], each)]
        return each(names)

    def _delete_batch(self, names: list[str], each: Callable[[list[str]], list[str]]) -> list[str]:
        """(S3) One DeleteObjects; the paths not removed. S3 reports a key's failure inside its 200 reply
        (s3fs's ``rm`` drops those): each is logged with its code and returned. A request refused whole
        (a store without DeleteObjects) falls back to one DELETE per key, 8 in flight."""
        bucket, prefix, _ = self.fs.split_path(self.path)
        keys = {f"{prefix}/{n}" if prefix else n: n for n in names}
        objects = [{"Key": k} for k in keys]
        try:
            with translate_errors(self.path):
                resp = self.fs.call_s3("delete_objects", Bucket=bucket, Delete={"Objects": objects, "Quiet": True})
        except OSError as exc:
            log.warning("%s: DeleteObjects failed (%s); removing one key at a time", self.path, exc)
            return each(names)
        finally:
            self.fs.invalidate_cache(self.path)
        failed = []
        for err in resp.get("Errors") or ():
            name = keys.get(str(err.get("Key")), str(err.get("Key")))
            log.warning("%s not removed: %s %s", self.where(name), err.get("Code"), err.get("Message"))
            failed.append(self.where(name))
        return failed


def write_bytes_atomic(fs: Any, path: str, data: bytes, *, sync: bool = True) -> None:
    """Write a small file so a reader sees the old content or all of the new, never a torn file (``newest``,
    markers, the stock ``.metadata``). POSIX: a create-only temporary renamed into place relative to the
    folder's descriptor (a link under the name is replaced, never followed), then the folder's fsync.
    Object stores: one PUT."""
    folder, _, name = path.rstrip("/").rpartition("/")
    with Folder(fs, folder or "/", follow=True) as f:
        f.publish(name, data, sync=sync, replace=True)


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
    if within is not None:
        return _remove_in(fs, within, paths)
    if not is_local(fs):
        return Folder(fs, "").remove(paths)
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
    try:
        with Folder(fs, within) as f:  # (object stores: nothing is opened, each removal reports its own failure)
            return outside + f.remove(inside)
    except FileNotFoundError:
        return outside
    except OSError as exc:  # the folder itself is a link (UnsafeCheckpoint) or unreadable
        log.warning("%s: nothing removed in it: %s", within, exc)
        return outside + [join(within, n) for n in inside]


def remove_tree(fs: Any, folder: str, last: str | None = None) -> list[str]:
    """Delete ``folder`` and everything under it (no globbing anywhere); the paths not removed. POSIX: an
    fd-based walk that never follows a link (:func:`~._nofollow.remove_tree_at`): a folder that is itself a
    link loses the link only; a link inside it goes itself. A missing folder raises ``FileNotFoundError``.
    ``last``: a file removed after the rest, once a listing shows nothing else (kept if files keep appearing)."""
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
            return nf.remove_tree_at(parent, name, where=folder, device=st.st_dev, last=last)
        finally:
            os.close(parent)
    base, found = folder.rstrip("/") + "/", dict[str, Any]()
    for round_ in range(nf.LATE_ROUNDS + 1 if last is not None else 1):
        with translate_errors(folder):
            fs.invalidate_cache(folder)
            listed = fs.find(folder, withdirs=True, detail=True)
        if not listed and not found and not fs.exists(folder):
            raise FileNotFoundError(folder)
        found |= listed
        names = [str(p)[len(base) :] for p, info in listed.items() if info.get("type") != "directory"]
        if last is not None and last not in names:
            raise nf.MarkGone(folder)
        files = [f for f in names if f and f != last]
        if not files or last is None or round_ == nf.LATE_ROUNDS:
            break
        # ``last`` (a removal's mark) goes once a listing shows nothing else: what appeared meanwhile (a
        # racing commit's manifest) goes too, as on POSIX (nofollow._remove_children says why)
        failed = Folder(fs, folder).remove(files)
        if failed:
            return failed
    if last is not None and files:
        return [join(folder, f) for f in files]  # files keep appearing: the mark stays
    failed = Folder(fs, folder).remove(files if last is None else [last])
    return failed + (_remove_dirs(fs, folder, found) if _protocol(fs) == "memory" else [])


def _remove_dirs(fs: Any, folder: str, found: dict[str, Any]) -> list[str]:
    """(memory://, which keeps folders of its own) The folders ``found`` under ``folder``, deepest first."""
    failed = []
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


@contextlib.contextmanager
def flocked(fd: int) -> Iterator[None]:
    """``flock`` of ``fd`` held for the block and released (not left to a close: a child forked meanwhile holds a copy
    of the descriptor, and the next taker waited for it to exit, rev72m); nothing where the filesystem refuses it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as exc:
        if exc.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
            raise
        yield
        return
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)

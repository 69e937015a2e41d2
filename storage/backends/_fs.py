"""The small filesystem seam: open a URL, atomic small writes, durable local writes, removal.

Backends are chosen by URL scheme through fsspec. ``s3://`` needs s3fs, imported lazily (by fsspec)
with an install hint when it is missing. Paths are plain ``str`` (never ``pathlib.Path``) so URLs keep
their scheme.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import logging
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from smpckpt.errors import UnsafeCheckpoint
from smpckpt.storage.backends._errors import translate_errors

__all__ = [
    "supports_url",
    "open_fs",
    "location_key",
    "is_local",
    "join",
    "write_bytes_atomic",
    "create_bytes_exclusive",
    "read_bytes_or_none",
    "fsync_dir",
    "fsync_path",
    "remove_files",
    "remove_tree",
    "pread_into",
]

log = logging.getLogger(__name__)


#: fsspec options LocalFileSystem understands; anything else given for a local path is a mistake.
_LOCAL_OPTIONS = frozenset(
    {"auto_mkdir", "skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths"}
)


def open_fs(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """``(fs, path)`` for ``url``: an fsspec filesystem chosen by the URL scheme and the path in it.

    ``storage_options`` go to the filesystem constructor (for S3: ``key``, ``secret``, ``client_kwargs``
    with ``endpoint_url`` / ``region_name``, ...). Plain paths and ``file://`` give the local filesystem.
    """
    url = os.fspath(url)
    if not isinstance(url, str) or not url:
        raise ValueError(f"checkpoint location must be a non-empty path or URL, got {url!r}")
    scheme = url.split("://", 1)[0] if "://" in url else "file"
    if scheme in ("file", "local") and storage_options:
        unknown = sorted(set(storage_options) - _LOCAL_OPTIONS)
        if unknown:
            # LocalFileSystem swallows unknown keyword arguments: a misplaced S3 option would be ignored
            raise ValueError(
                f"{url}: storage_options {unknown} do not apply to a local path (local disk accepts "
                f"{sorted(_LOCAL_OPTIONS)}); were they meant for an s3:// URL?"
            )
    options = dict(storage_options or {})
    if scheme in ("s3", "s3a"):
        options = _s3_defaults(options)
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        if scheme in ("s3", "s3a"):
            raise ImportError(f"{url}: install smpckpt[s3] (it adds s3fs) to use s3:// paths") from exc
        raise
    except ValueError as exc:
        if "Protocol not known" in str(exc):
            raise ValueError(f"{url}: no fsspec backend for scheme {scheme!r}") from exc
        raise
    if scheme in ("s3", "s3a") and not path.strip("/"):
        # no bucket: S3 would be asked for an object with an empty key (botocore: "Invalid length for
        # parameter Key"), by whichever call came first
        raise OSError(errno.EINVAL, "an S3 location must name a bucket (s3://BUCKET[/PREFIX])", url)
    return fs, path.rstrip("/") if len(path) > 1 else path


def _s3_defaults(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with our S3 client defaults under what the caller set.

    ``payload_signing_enabled=False``: botocore SHA-256-hashes every request body for the signature on
    plain-http endpoints (never on https, where S3 accepts ``UNSIGNED-PAYLOAD``); that is a third of
    a save's client CPU. Bodies still carry their CRC32 (checked by S3), and every data block its
    xxh3 checksum (checked on every read). Set it to ``True`` in ``config_kwargs["s3"]`` to sign.
    """
    config = dict(options.get("config_kwargs") or {})
    s3_config = dict(config.get("s3") or {})
    s3_config.setdefault("payload_signing_enabled", False)
    config["s3"] = s3_config
    return {**options, "config_kwargs": config}


def supports_url(url: str | os.PathLike[str]) -> bool:
    """Whether some backend can open ``url`` (for DCP's ``validate_checkpoint_id``)."""
    try:
        open_fs(url)
    except (ValueError, ImportError):
        return False
    return True


def location_key(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> str:
    """One string per location however ``url`` is spelled (``/x``, ``x/`` from ``/``, ``file:///x``);
    no I/O. Raises like :func:`open_fs`."""
    fs, path = open_fs(url, storage_options)
    return f"{_protocol(fs)}://{path.rstrip('/')}"


def is_local(fs: Any) -> bool:
    return isinstance(fs, LocalFileSystem)


def is_s3(fs: Any) -> bool:
    """Whether ``fs`` is an s3fs filesystem (or a subclass): ``smpckpt.storage.backends._s3`` uploads and streams
    GET bodies through its async client. Decided without importing s3fs or aiohttp, which only the s3
    extra installs; the one test for writes and reads alike."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    # ``_call_s3`` (s3fs's async call, which _s3 uses) marks s3fs itself, not another "s3" backend
    return "s3" in protocols and hasattr(fs, "_call_s3")


def join(folder: str, name: str) -> str:
    """``folder/name`` for any backend (fsspec paths use ``/`` everywhere, local disk included)."""
    return f"{folder.rstrip('/')}/{name}" if folder else name


def fsync_path(path: str, *, directory: bool = False) -> None:
    """fsync a local file by name (its data and metadata), or a ``directory`` so a rename or a new file
    in it survives a power loss."""
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    fsync_path(path, directory=True)


def write_bytes_atomic(fs: Any, path: str, data: bytes, *, sync: bool = True, sync_dir: bool = True) -> None:
    """Write a small file so a reader sees the old content or all of the new, never a torn file.

    Local/POSIX: temp file in the same directory, fsync, rename over the target, fsync the directory
    (``sync=False`` skips both fsyncs: faster, but a power loss may lose the write; ``sync_dir=False``
    leaves the directory fsync to a later write in the same folder). Other backends:
    one ``pipe_file`` call, which on S3 is a single PUT (objects appear atomically; no rename, which
    S3 would implement as copy + delete).
    """
    with translate_errors(path):
        if is_local(fs):
            with _temp_copy(path, data, sync=sync) as tmp:
                os.replace(tmp, path)
            if sync and sync_dir:
                fsync_dir(os.path.dirname(path) or ".")
        else:
            fs.pipe_file(path, data)


@contextlib.contextmanager
def _temp_copy(path: str, data: bytes, *, sync: bool) -> Iterator[str]:
    """A temp file beside ``path`` holding ``data`` (fsynced when ``sync``), removed when still there
    after the block (the block renames or links it into place)."""
    tmp = f"{path}.tmp.{os.getpid()}.{os.urandom(4).hex()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        yield tmp
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        except OSError as exc:
            # After the rename or link the write has landed: a temp name left behind must not turn it
            # into a reported failure (nor replace the block's own error). It is debris, named as such.
            log.warning("could not remove the temporary file %s: %s", tmp, exc)


_MEMORY_LOCK = threading.Lock()


def create_bytes_exclusive(fs: Any, path: str, data: bytes, *, sync: bool = True) -> None:
    """Create ``path`` holding ``data`` only if nothing is there; raise ``FileExistsError`` otherwise.

    This is what makes a commit exclusive: of two saves racing on one folder, exactly one creates
    the commit marker. Readers see no file or all of it, never a torn one.

    * Local/POSIX (also Lustre, NFS): write and fsync a temp file, then ``os.link`` it to the target
      (atomic, fails with ``EEXIST``), drop the temp name, fsync the directory. Where hard links are
      not supported it falls back to ``O_CREAT | O_EXCL`` (exclusive, but a crash mid-write can leave
      a torn file, which readers reject as a corrupt manifest).
    * S3: one conditional PutObject (``If-None-Match: *``, needs botocore > 1.35.20); the server
      answers 412 if the key exists.
    * ``memory://``: check and write under a process-wide lock (the store is per process).
    * Other backends: check, then write (best effort; not exclusive against other processes).
    """
    with translate_errors(path):
        if is_local(fs):
            _create_local_exclusive(path, data, sync=sync)
        elif _protocol(fs) in ("s3", "s3a"):
            # One PutObject whatever the size: s3fs's pipe_file switches to a multipart upload at
            # 100 MiB and drops the condition there, which would make a large commit unconditional.
            bucket, key, _ = fs.split_path(path)
            fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
            fs.invalidate_cache(path)
        else:
            with _MEMORY_LOCK if _protocol(fs) == "memory" else contextlib.nullcontext():
                if fs.exists(path):
                    raise FileExistsError(errno.EEXIST, "exists", path)
                fs.pipe_file(path, data)


def _protocol(fs: Any) -> str:
    proto = getattr(fs, "protocol", "")
    return str(proto[0] if isinstance(proto, (tuple, list)) else proto)


def _create_local_exclusive(path: str, data: bytes, *, sync: bool) -> None:
    folder = os.path.dirname(path) or "."
    with _temp_copy(path, data, sync=sync) as tmp:
        try:
            os.link(tmp, path)
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                raise
            # no hard links here (some FUSE mounts): exclusive create, then write in place
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                if sync:
                    os.fsync(f.fileno())
    if sync:
        fsync_dir(folder)


def read_bytes_or_none(fs: Any, path: str) -> bytes | None:
    """The whole file, or ``None`` when it does not exist (one GET; no HEAD/LIST first)."""
    with translate_errors(path):
        try:
            if _protocol(fs) in ("s3", "s3a"):
                from smpckpt.storage.backends._s3 import get_object

                return get_object(fs, path)
            data = fs.cat_file(path)
        except FileNotFoundError:
            return None
    return bytes(data)


def escapes(folder: str, path: str) -> bool:
    """(local disk) Whether ``path``, a file named inside ``folder``, is reached through a symbolic
    link that leads out of the folder: a linked prefix folder, or the file itself a link. The folder
    may sit under links of its own (``/fsx`` -> ``/mnt/fsx``): only what is inside it counts."""
    base = os.path.realpath(folder)
    return os.path.commonpath([base, os.path.realpath(path)]) != base


def confine(fs: Any, folder: str, names: Iterable[str], *, where: str) -> None:
    """(local disk; object stores have no links) Refuse a checkpoint whose files, as named by its
    manifest or metadata, are reached through links leading out of its folder: reading them would read
    another folder's files, and deleting them (overwrite, retention) would delete them."""
    if not is_local(fs):
        return
    for name in set(names):
        if escapes(folder, join(folder, name)):
            raise UnsafeCheckpoint(
                f"{where}: {name!r} is reached through a symbolic link leading out of the checkpoint folder "
                f"(to {os.path.realpath(join(folder, name))}); refusing to read or delete through it"
            )


def remove_files(fs: Any, paths: list[str], *, within: str | None = None) -> list[str]:
    """Best-effort removal of exactly these files; returns those that could not be removed (missing
    ones count as removed).

    One ``rm_file`` per path, never ``fs.rm``: fsspec's ``rm`` expands glob characters (``*``, ``[``)
    on S3 and ``memory://`` (and on local disk in some fsspec versions), so a name holding them would
    delete other checkpoints. ``within`` (the checkpoint folder the paths are named in): on local disk
    a path reached through a link leading out of it is not removed (it is returned as failed), so a
    crafted or moved checkpoint cannot make an overwrite or a retention delete another folder's files.
    """

    def one(p: str) -> str | None:
        # a link named as the file goes itself (its target stays); a linked folder on the way does not
        parent = os.path.dirname(p)
        if within is not None and is_local(fs) and os.path.normpath(parent) != os.path.normpath(within):
            if escapes(within, parent):
                log.warning("%s is reached through a link leading out of %s: not removed", p, within)
                return p
        try:
            with translate_errors(p):
                fs.rm_file(p)
        except FileNotFoundError:
            pass
        except OSError:
            return p
        return None

    if len(paths) > 1 and not is_local(fs):
        # object stores: one DELETE per request, so a few in flight
        with concurrent.futures.ThreadPoolExecutor(min(8, len(paths)), thread_name_prefix="smpckpt-rm") as pool:
            outcome = list(pool.map(one, paths))
    else:
        outcome = [one(p) for p in paths]
    return [p for p in outcome if p is not None]


def file_sizes(fs: Any, folder: str) -> dict[str, int]:
    """Every file under ``folder`` (prefix folders included): relative name -> size. One listing: on S3
    a LIST per 1,000 objects, never a HEAD per file."""
    base = folder.rstrip("/") + "/"  # ``folder`` is as open_fs gave it: as fs.find names its files
    with translate_errors(folder):
        found = fs.find(folder, detail=True)
    return {
        str(p)[len(base) :]: int(info.get("size") or 0)
        for p, info in found.items()
        if str(p).startswith(base) and info.get("type") != "directory"
    }


def _local_tree(folder: str) -> tuple[list[str], list[str]]:
    """(local disk) Files and folders under ``folder``, never descending into a linked folder: a link
    (to a file or a folder) is listed as a file, so removing it removes the link, not its target."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(folder)
    files: list[str] = []
    dirs: list[str] = []
    with translate_errors(folder):
        for top, subdirs, names in os.walk(folder, followlinks=False):
            files.extend(os.path.join(top, n) for n in names)
            for d in subdirs:
                (files if os.path.islink(os.path.join(top, d)) else dirs).append(os.path.join(top, d))
    return files, dirs


def remove_tree(fs: Any, folder: str) -> list[str]:
    """Delete ``folder`` and everything under it by exact listed paths (no globbing anywhere).

    Lists with ``find`` (a plain listing), removes every file with :func:`remove_files`, then the
    emptied directories deepest first (local disk and ``memory://``; object stores have none).
    Returns the paths that could not be removed. A missing folder raises ``FileNotFoundError``.
    """
    if is_local(fs) and os.path.islink(folder):
        # A link (a folder moved to another disk, or another run's checkpoint linked in): the link goes,
        # what it points at stays -- it may be data this root does not own.
        target = os.path.realpath(folder)
        with translate_errors(folder):
            os.unlink(folder)
        log.warning("%s is a link to %s: removed the link, left its target", folder, target)
        return []
    if is_local(fs):
        files, dirs = _local_tree(folder)
    else:
        with translate_errors(folder):
            found = fs.find(folder, withdirs=True, detail=True)
        if not found and not fs.exists(folder):
            raise FileNotFoundError(folder)
        files = [p for p, info in found.items() if info.get("type") != "directory"]
        dirs = [p for p, info in found.items() if info.get("type") == "directory"]
    failed = remove_files(fs, files, within=folder)
    if is_local(fs) or _protocol(fs) == "memory":
        for d in sorted(set(dirs) | {folder}, key=lambda p: p.count("/"), reverse=True):
            try:
                with translate_errors(d):
                    fs.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError:
                failed.append(d)
    return failed


def pread_into(fd: int, buffers: Sequence[memoryview], offset: int, want: int) -> int:
    """Read file bytes ``[offset, offset + want)`` of ``fd`` into ``buffers`` (byte views, filled in order;
    capacity past ``want`` bytes is left alone), looping on short reads. Returns the bytes read: fewer
    than ``want`` only when the file ends first.

    Every local read goes through here: Linux returns at most 2 GiB - 4 KiB from one ``preadv``, so a
    single call cannot fill a tensor or run past 2**31 bytes however the file is read."""
    got = 0
    while got < want:
        views: list[memoryview] = []
        skip, room = got, want - got
        for mv in buffers:
            if skip >= len(mv):
                skip -= len(mv)
                continue
            part = mv[skip : skip + room]
            views.append(part)
            room -= len(part)
            skip = 0
            if not room:
                break
        n = os.preadv(fd, views, offset + got)
        if n == 0:
            break
        got += n
    return got

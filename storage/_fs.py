"""The small filesystem seam: open a URL, atomic small writes, durable local writes, removal.

Backends are chosen by URL scheme through fsspec. ``s3://`` needs s3fs, imported lazily (by fsspec)
with an install hint when it is missing. Paths are plain ``str`` (never ``pathlib.Path``) so URLs keep
their scheme.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from smpckpt.storage._errors import translate_errors

__all__ = [
    "supports_url",
    "open_fs",
    "is_local",
    "join",
    "write_bytes_atomic",
    "read_bytes_or_none",
    "fsync_dir",
    "remove_files",
]

_INSTALL_HINTS = {"s3": "install smpckpt[s3] (it adds s3fs) to use s3:// paths",
                  "s3a": "install smpckpt[s3] (it adds s3fs) to use s3:// paths"}


def open_fs(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """``(fs, path)`` for ``url``: an fsspec filesystem chosen by the URL scheme and the path in it.

    ``storage_options`` go to the filesystem constructor (for S3: ``key``, ``secret``, ``client_kwargs``
    with ``endpoint_url`` / ``region_name``, ...). Plain paths and ``file://`` give the local filesystem.
    """
    url = os.fspath(url)
    if not isinstance(url, str) or not url:
        raise ValueError(f"checkpoint location must be a non-empty path or URL, got {url!r}")
    scheme = url.split("://", 1)[0] if "://" in url else "file"
    try:
        fs, path = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    except ImportError as exc:
        hint = _INSTALL_HINTS.get(scheme)
        if hint:
            raise ImportError(f"{url}: {hint}") from exc
        raise
    except ValueError as exc:
        if "Protocol not known" in str(exc):
            raise ValueError(f"{url}: no fsspec backend for scheme {scheme!r}") from exc
        raise
    return fs, path.rstrip("/") if len(path) > 1 else path


def supports_url(url: str | os.PathLike[str]) -> bool:
    """Whether some backend can open ``url`` (for DCP's ``validate_checkpoint_id``)."""
    try:
        open_fs(url)
    except (ValueError, ImportError):
        return False
    return True


def is_local(fs: Any) -> bool:
    return isinstance(fs, LocalFileSystem)


def join(fs: Any, folder: str, name: str) -> str:
    return f"{folder.rstrip('/')}/{name}" if folder else name


def fsync_dir(path: str) -> None:
    """fsync a local directory so a rename or a new file in it survives a power loss."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
            folder = os.path.dirname(path) or "."
            tmp = f"{path}.tmp.{os.getpid()}.{os.urandom(4).hex()}"
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    if sync:
                        os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
                raise
            if sync and sync_dir:
                fsync_dir(folder)
        else:
            fs.pipe_file(path, data)


def read_bytes_or_none(fs: Any, path: str) -> bytes | None:
    """The whole file, or ``None`` when it does not exist (one GET; no HEAD/LIST first)."""
    with translate_errors(path):
        try:
            data = fs.cat_file(path)
        except FileNotFoundError:
            return None
    return bytes(data)


def remove_files(fs: Any, paths: list[str]) -> list[str]:
    """Best-effort removal; returns the paths that could not be removed (missing ones count as removed)."""
    failed: list[str] = []
    if not paths:
        return failed
    try:
        with translate_errors(paths[0]):
            fs.rm(paths)
        return failed
    except FileNotFoundError:
        pass
    except OSError:
        pass
    for p in paths:
        try:
            with translate_errors(p):
                fs.rm_file(p)
        except FileNotFoundError:
            pass
        except OSError:
            failed.append(p)
    return failed

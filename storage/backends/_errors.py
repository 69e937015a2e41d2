"""Backend errors -> builtin ``OSError`` family at the storage boundary, naming the file, keeping ``__cause__``.

Callers then catch ``FileNotFoundError`` / ``PermissionError`` the same way for local disk, shared
filesystems and S3. S3's error codes are s3fs's to translate (``s3fs.errors.translate_boto_error``, which
every s3fs call already applies); what is ours is naming the object the request was for (s3fs leaves it
out), turning transport errors that reach us untranslated into ``OSError``, and letting smpckpt's own
errors pass untouched.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator, Mapping
from types import MappingProxyType

from smpckpt.errors import CheckpointError

__all__ = ["translate_errors", "translate"]

_ERRNO: Mapping[type[OSError], int] = MappingProxyType(
    {
        FileNotFoundError: errno.ENOENT,
        PermissionError: errno.EACCES,
        FileExistsError: errno.EEXIST,
        TimeoutError: errno.ETIMEDOUT,
    }
)


def translate(exc: BaseException, path: str) -> BaseException:
    """The exception to raise instead of ``exc`` (``exc`` itself when it is already fine)."""
    if isinstance(exc, CheckpointError):
        return exc
    if isinstance(getattr(exc, "response", None), dict):
        # a botocore ClientError that reached us untranslated (a call made outside s3fs's wrapper):
        # s3fs's table says which builtin it is (a botocore error means s3fs is installed)
        from s3fs.errors import translate_boto_error

        return _named(translate_boto_error(exc), path, cause=exc)
    if isinstance(exc, OSError):
        if exc.filename is None and exc.errno is not None and path and type(exc).__module__ == "builtins":
            return _named(exc, path, cause=exc)  # s3fs's translation without the key
        return exc
    if type(exc).__module__.split(".")[0] in ("botocore", "aiobotocore", "aiohttp", "s3fs"):
        return _named(OSError(errno.EIO, f"{type(exc).__name__}: {exc}"), path, cause=exc)
    return exc


def _named(exc: BaseException, path: str, *, cause: BaseException) -> BaseException:
    """``exc`` again, as ``type(exc)(errno, message, path)``, caused by ``cause``."""
    if not isinstance(exc, OSError) or type(exc).__module__ != "builtins":
        return exc
    code = exc.errno if isinstance(exc.errno, int) else _ERRNO.get(type(exc), errno.EIO)
    named = type(exc)(code, exc.strerror or str(exc), path)
    named.__cause__ = cause
    return named


@contextlib.contextmanager
def translate_errors(path: str) -> Iterator[None]:
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - re-raised (translated) below
        new = translate(exc, path)
        if new is exc:
            raise
        raise new from exc

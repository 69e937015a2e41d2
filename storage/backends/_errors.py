"""Backend errors -> builtin ``OSError`` family at the storage boundary, keeping ``__cause__``.

Callers then catch ``FileNotFoundError`` / ``PermissionError`` the same way for local disk, shared
filesystems and S3. smpckpt's own errors pass through untouched.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator

from smpckpt.errors import CheckpointError

__all__ = ["translate_errors", "translate"]

# botocore error codes (as found in ClientError.response["Error"]["Code"]) by builtin class
_CODE_TO_EXC: dict[str, type[OSError]] = {
    "NoSuchKey": FileNotFoundError,
    "NoSuchBucket": FileNotFoundError,
    "NoSuchUpload": FileNotFoundError,
    "404": FileNotFoundError,
    "NotFound": FileNotFoundError,
    "AccessDenied": PermissionError,
    "403": PermissionError,
    "InvalidAccessKeyId": PermissionError,
    "SignatureDoesNotMatch": PermissionError,
    # a conditional PUT (If-None-Match: *) found the object already there
    "PreconditionFailed": FileExistsError,
    "412": FileExistsError,
}


def translate(exc: BaseException, path: str) -> BaseException:
    """The exception to raise instead of ``exc`` (``exc`` itself when it is already fine)."""
    if isinstance(exc, CheckpointError):
        return exc
    if isinstance(exc, OSError):
        if exc.filename is None and exc.errno is not None and path and type(exc).__module__ == "builtins":
            # s3fs translates S3's errors to OSError without the key: name the file the request was for
            named = type(exc)(exc.errno, exc.strerror or str(exc), path)
            named.__cause__ = exc
            return named
        return exc
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = str(response.get("Error", {}).get("Code", ""))
        cls = _CODE_TO_EXC.get(code, OSError)
        new: OSError = cls(errno.EIO if cls is OSError else _errno_for(cls), f"{code or 'error'}: {exc}", path)
        new.__cause__ = exc
        return new
    if type(exc).__module__.split(".")[0] in ("botocore", "aiobotocore", "aiohttp", "s3fs"):
        new = OSError(errno.EIO, f"{type(exc).__name__}: {exc}", path)
        new.__cause__ = exc
        return new
    return exc


def _errno_for(cls: type[OSError]) -> int:
    return {FileNotFoundError: errno.ENOENT, PermissionError: errno.EACCES, FileExistsError: errno.EEXIST}.get(
        cls, errno.EIO
    )


@contextlib.contextmanager
def translate_errors(path: str) -> Iterator[None]:
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - re-raised (translated) below
        new = translate(exc, path)
        if new is exc:
            raise
        raise new from exc

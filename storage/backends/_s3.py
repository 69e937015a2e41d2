"""S3: concurrent multipart upload straight from the writer thread, through s3fs's async client.

s3fs's own file object uploads the parts of one file serially from the writing thread; here each full
part is handed to s3fs's event loop and the writer thread goes on filling the next one, with at most
``max_in_flight`` parts per file in flight. A file smaller than one part is a single ``PutObject``.

Bodies are not copied on their way to the socket. A part is a :class:`PartBody`: a list of memoryviews
that botocore reads as a file (checksums, signing) and aiohttp writes view by view; ``bytes`` would be
copied about five times on the way. A sink opened with ``borrow=True`` keeps views of the caller's
memory (unchanged until ``commit``/``abort`` returns); otherwise bytes are copied once into reused
part buffers.

Retries of 5xx / throttling replies happen below us (botocore's retry handler and s3fs's
``_error_wrapper``; a retry re-sends the same body from its start); whatever still fails aborts the
upload, so no parts are left billing. Errors name the file. Imported only for ``s3://`` locations.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import concurrent.futures
import contextlib
import errno
import hashlib
import inspect
import itertools
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp.payload import Payload

from smpckpt.storage.backends._fs import translate_errors
from smpckpt.storage.backends._sinks import (
    MAX_PART_SIZE,
    MAX_PARTS,
    MIN_PART_SIZE,
    PART_GROWTH_EVERY,
    byte_view,
    part_size_of,
)

__all__ = ["S3MultipartSink", "PartBody", "get_object", "get_object_and_etag", "get_range_into"]

# bytes handed to aiohttp per write: the event loop interleaves the parts of several files
_SEND_CHUNK = 1 << 20


class PartBody(Payload):
    """One request body made of memoryviews, sent without copying them.

    To botocore it is a seekable file (``read`` returns views, ``len`` the size), so checksums and
    signing stream over it; to aiohttp it is a payload that writes the views in 1 MiB slices. Every
    attempt (a botocore retry) writes the whole body from its start.
    """

    _autoclose = True  # holds no resources: nothing for aiohttp to close

    def __init__(self, views: Sequence[memoryview]) -> None:
        parts = [v for v in (byte_view(v) for v in views) if len(v)]
        super().__init__(parts, content_type="application/octet-stream")
        self._parts = parts
        offsets = [0, *itertools.accumulate(len(v) for v in parts)]
        self._starts, self._total = offsets[:-1], offsets[-1]  # where each part starts; the size
        self._size = self._total  # what aiohttp reads
        self._pos = 0

    # -- file protocol (botocore: checksums, payload hash, retries' reset_stream) ----------------
    def __len__(self) -> int:
        return self._total

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._total}[whence]
        self._pos = min(max(0, base + offset), self._total)
        return self._pos

    def read(self, n: int = -1) -> memoryview | bytes:
        """Up to ``n`` bytes from the current position (a view into one part; ``b""`` at the end)."""
        if self._pos >= self._total:
            return b""
        i = bisect.bisect_right(self._starts, self._pos) - 1
        off = self._pos - self._starts[i]
        view = self._parts[i][off:] if n is None or n < 0 else self._parts[i][off : off + n]
        self._pos += len(view)
        return view

    # -- aiohttp payload ---------------------------------------------------------------------------
    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return b"".join(self._parts).decode(encoding, errors)

    async def write(self, writer: Any) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer: Any, content_length: int | None) -> None:
        left = self._total if content_length is None else min(content_length, self._total)
        for view in self._parts:
            for i in range(0, len(view), _SEND_CHUNK):
                if left <= 0:
                    return
                chunk = view[i : i + min(_SEND_CHUNK, left)]
                await writer.write(chunk)  # drains (waits for the socket) when its buffer is full
                left -= len(chunk)


class S3MultipartSink:
    """One S3 object written as parts in flight (see the module docstring); the writer's Sink.

    Create-only: the object appears through a conditional request, ``PutObject`` or
    ``CompleteMultipartUpload`` with ``If-None-Match: *``, so an object already under the key (another
    save's) is never replaced: the commit fails with ``FileExistsError`` and the upload is aborted.
    ``part_size`` is the first parts' size,
    honoured as given (below S3's minimum it is refused, never raised silently); it doubles every
    ``grow_every`` parts, and once more for the last ``grow_every`` before S3's 10,000
    (:func:`~smpckpt.storage.backends._sinks.part_size_of`), so a file past ``10,000 * part_size`` still
    uploads, up to S3's 5 TiB from any start, and memory in flight grows with it (``max_in_flight`` parts)."""

    def __init__(
        self,
        fs: Any,
        path: str,
        *,
        part_size: int,
        max_in_flight: int,
        borrow: bool = False,
        grow_every: int = PART_GROWTH_EVERY,
        sent: Callable[[int], None] | None = None,
    ) -> None:
        if int(part_size) < MIN_PART_SIZE or int(part_size) > MAX_PART_SIZE:
            raise ValueError(
                f"{path}: part_size {part_size} is outside S3's part sizes ({MIN_PART_SIZE} to {MAX_PART_SIZE} bytes)"
            )
        if int(grow_every) < 1:
            raise ValueError(f"{path}: grow_every must be at least 1, got {grow_every}")
        self._first_part_size, self._grow_every = int(part_size), int(grow_every)
        self.path = path
        self._fs = fs
        bucket, key, _ = fs.split_path(path)
        self._bucket, self._key = bucket, key
        self._part_size = int(part_size)
        self._borrow = borrow
        self.borrows = borrow
        self._views: list[memoryview] = []  # the part being filled (borrow mode) ...
        self._buf: bytearray | None = None  # ... or (copy mode) ...
        self._fill = 0  # ... and its bytes so far
        self._free: collections.deque[bytearray] = collections.deque()  # copy mode: buffers to reuse
        self._upload_id: str | None = None
        self._parts: dict[int, concurrent.futures.Future[str]] = {}
        self._slots = threading.BoundedSemaphore(max(1, max_in_flight))
        self._done = False
        self._sent = sent  # told each part's size once its upload ended (open_sink)

    # -- helpers ------------------------------------------------------------------------------
    def _run(self, coro: Any) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self._fs.loop)

    def _call(self, method: str, **kwargs: Any) -> Any:
        with translate_errors(self.path):
            return self._fs.call_s3(method, Bucket=self._bucket, Key=self._key, **kwargs)

    async def _upload_part(self, number: int, body: PartBody, buf: bytearray | None) -> str:
        try:
            # ``_call_s3`` is the coroutine behind the public ``call_s3`` (fsspec names the async form of
            # every method with a leading underscore): parts run concurrently on s3fs's loop, with
            # s3fs's retries and error translation. tests/storage/test_s3fs_private_api.py pins it.
            resp = await self._fs._call_s3(
                "upload_part",
                Bucket=self._bucket,
                Key=self._key,
                UploadId=self._upload_id,
                PartNumber=number,
                Body=body,
            )
            return str(resp["ETag"])
        finally:
            if buf is not None:
                self._free.append(buf)  # its bytes are sent (or the part failed): reusable
            self._slots.release()
            if self._sent is not None:
                self._sent(len(body))

    def _take_part(self) -> tuple[PartBody, bytearray | None]:
        """The part filled so far as a body (and its buffer, in copy mode); starts an empty one."""
        if self._borrow:
            body, self._views, self._fill = PartBody(self._views), [], 0
            return body, None
        buf, n = self._buf, self._fill
        self._buf, self._fill = None, 0
        if buf is None or n == 0:
            return PartBody([]), buf
        return PartBody([memoryview(buf)[:n]]), buf

    def _flush_part(self) -> None:
        if self._upload_id is None:
            self._upload_id = str(self._call("create_multipart_upload")["UploadId"])
        number = len(self._parts) + 1
        if number > MAX_PARTS:
            raise OSError(f"{self.path}: more than {MAX_PARTS} parts (S3's limit per object); raise part_size")
        # a failed part surfaces now rather than after the whole file was produced
        for fut in self._parts.values():
            if fut.done() and fut.exception() is not None:
                self._result(fut)
        self._slots.acquire()
        body, buf = self._take_part()
        try:
            self._parts[number] = self._run(self._upload_part(number, body, buf))
        except BaseException:
            self._slots.release()
            raise
        # the next part's size: buffers of a smaller one are dropped as they come back (``_next_buffer``)
        self._part_size = part_size_of(number + 1, self._first_part_size, self._grow_every)

    def _next_buffer(self) -> bytearray:
        while self._free:
            buf = self._free.popleft()
            if len(buf) == self._part_size:
                return buf
        return bytearray(self._part_size)

    # -- Sink -----------------------------------------------------------------------------------
    def write(self, data: memoryview) -> None:
        if self._done:
            raise ValueError(f"{self.path}: write after commit/abort")
        mv = byte_view(data)
        i = 0
        while i < len(mv):
            room = self._part_size - self._fill
            take = min(room, len(mv) - i)
            if self._borrow:
                self._views.append(mv[i : i + take])
            else:
                if self._buf is None:
                    self._buf = self._next_buffer()
                self._buf[self._fill : self._fill + take] = mv[i : i + take]
            self._fill += take
            i += take
            if take == room:
                self._flush_part()

    def commit(self) -> None:
        if self._done:
            raise ValueError(f"{self.path}: commit after commit/abort")
        try:
            if self._upload_id is None:
                body, _ = self._take_part()

                def body_md5() -> str:  # only when the PUT was refused: no pass over every file's bytes
                    digest = hashlib.md5(usedforsecurity=False)
                    for view in body._parts:
                        digest.update(view)
                    return digest.hexdigest()

                self._create("put_object", body_md5, Body=body if len(body) else b"")
            else:
                if self._fill:
                    self._flush_part()
                etags = [self._result(f) for _, f in sorted(self._parts.items())]
                parts = [{"PartNumber": n, "ETag": e} for n, e in enumerate(etags, 1)]

                # S3's ETag of a multipart object: the MD5 of its parts' ETags (their MD5s), then the count. Under
                # SSE-KMS or SSE-C ETags are no MD5s (they stay hex): the value may then match no object, and a
                # lost reply stays a failure naming the key (README); never another's object taken as ours
                def parts_etag() -> str:
                    try:
                        md5s = b"".join(bytes.fromhex(e.strip('"')) for e in etags)
                    except ValueError:  # a store whose part ETags are not hex: nothing to compare
                        return ""
                    return f"{hashlib.md5(md5s, usedforsecurity=False).hexdigest()}-{len(etags)}"

                self._create(
                    "complete_multipart_upload", parts_etag, UploadId=self._upload_id, MultipartUpload={"Parts": parts}
                )
        except BaseException:
            self.abort()
            raise
        self._done = True
        self._release()

    def _create(self, method: str, etag: Callable[[], str], **kwargs: Any) -> None:
        """``method`` with ``If-None-Match: *``. Refused (412) by an object under the key: another's, or this
        request's own when it landed and its reply was lost, the retry refused by it (the object's ETag is
        the one this upload makes); another's is a ``FileExistsError`` naming the key."""
        from smpckpt.storage.backends._folder import precondition

        try:
            self._call(method, IfNoneMatch="*", **kwargs)
        except OSError as exc:
            if not precondition(exc):
                raise
            try:
                found = self._call("head_object").get("ETag")
            except FileNotFoundError:  # another's, removed since the 412 (rev68c F3)
                found = None
            ours = etag()
            if not ours or found is None or str(found).strip('"') != ours:
                raise FileExistsError(errno.EEXIST, "another object is under this key", self.path) from exc

    def _result(self, fut: concurrent.futures.Future[str]) -> str:
        with translate_errors(self.path):
            return fut.result()

    def _release(self) -> None:
        """Drop every buffer and borrowed view: the caller's memory is its own again."""
        self._views, self._buf, self._fill = [], None, 0
        self._free.clear()

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        for fut in self._parts.values():
            fut.cancel()
        concurrent.futures.wait(list(self._parts.values()), timeout=60)
        self._release()
        if self._upload_id is not None:
            with contextlib.suppress(Exception):  # best effort; a lifecycle rule catches the rest
                self._call("abort_multipart_upload", UploadId=self._upload_id)


async def _one_attempt(fs: Any, method: str, **kwargs: Any) -> Any:
    """One S3 call without s3fs's retry loop (``_call_s3`` has one): our readers run the request *and*
    its body read inside one ``_error_wrapper``, and a loop inside that loop multiplied the attempts.
    ``_get_s3_method_kwargs`` (private; no public form) applies the filesystem's ``s3_additional_kwargs``
    and ``requester_pays`` as every s3fs call does; tests/storage/test_s3fs_private_api.py pins it."""
    await fs.set_session()
    s3 = await fs.get_s3(kwargs.get("Bucket"))
    call = getattr(s3, method)
    return await call(**fs._get_s3_method_kwargs(call, **kwargs))


def _is_invalid_range(exc: BaseException) -> bool:
    """botocore's ClientError for a range past the object's end (one attempt raises it untranslated)."""
    response = getattr(exc, "response", None)
    return isinstance(response, dict) and response.get("Error", {}).get("Code") == "InvalidRange"


async def _get(fs: Any, bucket: str, key: str) -> tuple[bytes, str]:
    resp = await _one_attempt(fs, "get_object", Bucket=bucket, Key=key)
    try:
        return bytes(await resp["Body"].read()), str(resp.get("ETag") or "")
    finally:
        resp["Body"].close()


def get_object_and_etag(fs: Any, path: str) -> tuple[bytes, str]:
    """The whole object and its ETag from one GET (what a conditional replacement names)."""
    bucket, key, _ = fs.split_path(path)
    with translate_errors(path):
        data, etag = _retried(fs, _get, fs, bucket, key)
    return bytes(data), str(etag)


def get_object(fs: Any, path: str) -> bytes:
    """The whole object in one GET (``FileNotFoundError`` when missing). s3fs's ``cat_file`` first
    asks for the size (a HEAD, and a LIST when that 404s). Retried as s3fs retries its own reads, the
    body's read included, so a body cut short once does not make a checkpoint look unreadable."""
    bucket, key, _ = fs.split_path(path)
    return bytes(_retried(fs, _get, fs, bucket, key)[0])


def _retried(fs: Any, func: Any, *args: Any) -> Any:
    """(any thread but s3fs's loop) ``await func(*args)`` on s3fs's loop, retried as s3fs retries its own
    calls and translated as it translates them (``s3fs.core._error_wrapper``: private, with no public
    form; tests/storage/test_s3fs_private_api.py pins it)."""
    from fsspec.asyn import sync
    from s3fs.core import _error_wrapper

    return sync(fs.loop, _error_wrapper, func, args=args, retries=fs.retries)


async def _get_into(
    fs: Any, bucket: str, key: str, version: str | None, lo: int, hi: int, views: Sequence[memoryview]
) -> int:
    """(s3fs's event loop; one attempt, retried whole by the caller) One ranged GET whose body fills
    ``views`` in order; returns the bytes received (0: the object ends before ``lo``)."""
    extra = {"VersionId": version} if version else {}
    try:
        resp = await _one_attempt(fs, "get_object", Bucket=bucket, Key=key, Range=f"bytes={lo}-{hi - 1}", **extra)
    except Exception as exc:
        if _is_invalid_range(exc):
            return 0  # InvalidRange: the object ends before `lo` (the caller reports the truncation)
        raise
    body = resp["Body"]
    # aiobotocore >= 2.23 reads into a buffer; older ones only hand out chunks (then one more copy)
    readinto = getattr(body, "readinto", None)
    got = 0
    try:
        _check_range(resp, lo, hi, key)
        for view in views:
            at = 0
            while at < len(view):
                if readinto is not None:
                    n = await readinto(view[at:])
                else:
                    chunk = await body.read(len(view) - at)
                    n = len(chunk)
                    view[at : at + n] = chunk
                if n == 0:
                    return got
                at += n
                got += n
        return got
    finally:
        closed = body.close()
        if inspect.isawaitable(closed):  # the httpx backend's close is a coroutine
            await closed


def _check_range(resp: dict[str, Any], lo: int, hi: int, key: str) -> None:
    """The body must start at ``lo``: a server that ignored the Range header would hand us other bytes."""
    content_range = resp.get("ContentRange")
    if content_range:
        m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", str(content_range).strip())
        if m is not None and int(m.group(1)) == lo and int(m.group(2)) < hi:
            return
    elif lo == 0:
        return  # the whole object from its start (200): the first `hi` bytes are the ones asked for
    raise OSError(errno.EIO, f"asked for bytes {lo}..{hi} of {key}, the server answered {content_range!r}")


def get_range_into(fs: Any, path: str, lo: int, hi: int, views: Sequence[memoryview]) -> int:
    """(any thread but s3fs's loop) Object bytes ``[lo, hi)`` of ``path`` in one ranged GET, streamed into
    ``views`` (byte views, filled in order, ``hi - lo`` bytes in all). Returns the bytes received: fewer
    only when the object ends first. Transient failures (a dropped connection mid-body too) are
    retried as s3fs retries its own reads, each attempt from the start; what still fails is raised as
    a builtin error (``FileNotFoundError``, ``PermissionError``, ``OSError``; the caller adds the
    file's name where s3fs's own translation left it out)."""
    if hi <= lo:
        return 0
    bucket, key, version = fs.split_path(path)
    with translate_errors(path):
        return int(_retried(fs, _get_into, fs, bucket, key, version, lo, hi, views))

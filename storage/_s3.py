"""S3: concurrent multipart upload straight from the writer thread, through s3fs's async client.

s3fs's own file object uploads the parts of one file serially from the writing thread; here each full
part is handed to s3fs's event loop and the writer thread goes on filling the next one, with at most
``max_in_flight`` parts (``max_in_flight * part_size`` bytes) buffered. Parts are at least 16 MiB.
Retries of 5xx / throttling replies happen below us (botocore's retry handler and s3fs's
``_error_wrapper``); whatever still fails aborts the upload, so no parts are left billing. A file
smaller than one part is a single ``PutObject``. Imported only for ``s3://`` locations.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any

from smpckpt.storage._errors import translate

__all__ = ["S3MultipartSink", "MIN_PART_SIZE"]

MIN_PART_SIZE = 16 << 20
_MAX_PARTS = 10_000  # S3 limit per upload


class S3MultipartSink:
    def __init__(self, fs: Any, path: str, *, part_size: int, max_in_flight: int) -> None:
        self.path = path
        self._fs = fs
        bucket, key, _ = fs.split_path(path)
        self._bucket, self._key = bucket, key
        self._part_size = max(int(part_size), MIN_PART_SIZE)
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._parts: dict[int, concurrent.futures.Future[str]] = {}
        self._slots = threading.BoundedSemaphore(max(1, max_in_flight))
        self._done = False
        self._written = 0

    # -- helpers ------------------------------------------------------------------------------
    def _run(self, coro: Any) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self._fs.loop)

    def _call(self, method: str, **kwargs: Any) -> Any:
        try:
            return self._run(self._fs._call_s3(method, Bucket=self._bucket, Key=self._key, **kwargs)).result()
        except Exception as exc:  # noqa: BLE001 - translated, cause kept
            new = translate(exc, self.path)
            if new is exc:
                raise
            raise new from exc

    async def _upload_part(self, number: int, body: bytes) -> str:
        try:
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
            self._slots.release()

    def _flush_part(self, body: bytes) -> None:
        if self._upload_id is None:
            self._upload_id = str(self._call("create_multipart_upload")["UploadId"])
        number = len(self._parts) + 1
        if number > _MAX_PARTS:
            raise OSError(f"{self.path}: more than {_MAX_PARTS} parts; raise part_size")
        # a failed part surfaces now rather than after the whole file was produced
        for fut in self._parts.values():
            if fut.done() and fut.exception() is not None:
                fut.result()
        self._slots.acquire()
        try:
            self._parts[number] = self._run(self._upload_part(number, body))
        except BaseException:
            self._slots.release()
            raise

    # -- Sink -----------------------------------------------------------------------------------
    def write(self, data: memoryview) -> None:
        if self._done:
            raise ValueError(f"{self.path}: write after commit/abort")
        mv = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        self._written += len(mv)
        i = 0
        while i < len(mv):
            # the part buffer is the one copy S3 needs: a part must be one contiguous body
            take = min(self._part_size - len(self._buf), len(mv) - i)
            self._buf += mv[i : i + take]
            i += take
            if len(self._buf) == self._part_size:
                body, self._buf = bytes(self._buf), bytearray()
                self._flush_part(body)

    def commit(self) -> None:
        if self._done:
            raise ValueError(f"{self.path}: commit after commit/abort")
        try:
            if self._upload_id is None:
                self._call("put_object", Body=bytes(self._buf))
            else:
                if self._buf:
                    self._flush_part(bytes(self._buf))
                self._buf = bytearray()
                parts = [{"PartNumber": n, "ETag": self._result(f)} for n, f in sorted(self._parts.items())]
                self._call("complete_multipart_upload", UploadId=self._upload_id, MultipartUpload={"Parts": parts})
        except BaseException:
            self.abort()
            raise
        self._done = True

    def _result(self, fut: concurrent.futures.Future[str]) -> str:
        try:
            return fut.result()
        except Exception as exc:  # noqa: BLE001 - translated, cause kept
            new = translate(exc, self.path)
            if new is exc:
                raise
            raise new from exc

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        self._buf = bytearray()
        for fut in self._parts.values():
            fut.cancel()
        concurrent.futures.wait(list(self._parts.values()), timeout=60)
        if self._upload_id is not None:
            try:
                self._call("abort_multipart_upload", UploadId=self._upload_id)
            except Exception:  # noqa: BLE001 - best effort; a lifecycle rule catches the rest
                pass

"""Loopback S3 helpers shared by the storage and API suites (the server fixture is in conftest.py)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def s3_options(endpoint: str) -> dict[str, Any]:
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "skip_instance_cache": True,
        # few, fast retries: a test that needs retries sets its own
        "config_kwargs": {"retries": {"max_attempts": 3, "mode": "standard"}, "connect_timeout": 5, "read_timeout": 30},
    }


def reset_moto(endpoint: str, bucket: str) -> None:
    """Empty moto and create ``bucket``; drop s3fs's cached filesystems."""
    import boto3
    import requests

    requests.post(f"{endpoint}/moto-api/reset", timeout=10).raise_for_status()
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


def upload_folder(folder: Any, endpoint: str, bucket: str, prefix: str) -> dict[str, Any]:
    """A fresh ``bucket`` holding every file of local ``folder`` under ``prefix``; its storage options."""
    import s3fs

    reset_moto(endpoint, bucket)
    opts = s3_options(endpoint)
    fs = s3fs.S3FileSystem(**opts)
    for f in Path(folder).iterdir():
        fs.put_file(str(f), f"{bucket}/{prefix}/{f.name}")
    return opts


def record_ranged_gets(monkeypatch: Any, suffix: str) -> list[tuple[str, int, int]]:
    """Every ranged GET of a key ending in ``suffix`` from now on (s3fs's own and those streamed into our
    buffers), as ``(path, start, end)``."""
    import s3fs

    gets: list[tuple[str, int, int]] = []
    real = s3fs.S3FileSystem._cat_file

    async def counted(self: Any, path: str, version_id: Any = None, start: Any = None, end: Any = None) -> bytes:
        if str(path).endswith(suffix):
            gets.append((str(path), start, end))
        return await real(self, path, version_id=version_id, start=start, end=end)

    monkeypatch.setattr(s3fs.S3FileSystem, "_cat_file", counted)
    # the GETs whose bodies stream into our buffers (storage/backends/_s3.py), not through _cat_file
    from smpckpt.storage.backends import _s3

    real_into = _s3.get_range_into

    def counted_into(fs: Any, path: str, lo: int, hi: int, views: Any) -> int:
        if str(path).endswith(suffix) and hi > lo:
            gets.append((str(path), lo, hi))
        return real_into(fs, path, lo, hi, views)

    monkeypatch.setattr(_s3, "get_range_into", counted_into)
    return gets


def serve_full_artifact(
    monkeypatch: Any, folder: Any, endpoint: str, bucket: str, span_limit: int | None
) -> tuple[dict[str, Any], list[tuple[str, int, int]]]:
    """A full artifact from local ``folder`` served from ``s3://bucket/ck``, with the full reader's
    span limit set (``None``: its default); the storage options and the ranged GETs of its files."""
    from smpckpt.storage.full import _files as _full_files

    opts = upload_folder(folder, endpoint, bucket, "ck")
    if span_limit is not None:
        monkeypatch.setattr(_full_files, "SPAN_BYTES", span_limit)
    return opts, record_ranged_gets(monkeypatch, ".safetensors")


class FreezingProxy:
    """A loopback TCP proxy in front of ``127.0.0.1:port`` that hangs once ``freeze_after`` bytes went up
    through it: from then on it reads and forwards nothing on any connection, open or new, and keeps them
    all open (an endpoint that stops answering mid-request, as a hung S3 does). ``close()`` drops them.
    ``down = True``: an outage instead (every connection reset, new ones at once) until set back."""

    def __init__(self, port: int, freeze_after: int | None = None) -> None:
        import threading

        self.target, self.freeze_after, self.up, self.down = port, freeze_after, 0, False
        self.frozen, self._lock, self._held = threading.Event(), threading.Lock(), list[socket.socket]()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.port = int(self._sock.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import contextlib
        import threading

        with contextlib.suppress(OSError):
            while True:
                client, _ = self._sock.accept()
                self._held.append(client)
                if self.down:
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    client.close()  # reset: connection refused, as an endpoint that is down
                    continue
                if self.frozen.is_set():
                    continue  # accepted, never answered
                server = socket.create_connection(("127.0.0.1", self.target), timeout=10)
                server.settimeout(None)
                self._held.append(server)
                threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
                threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        import contextlib

        with contextlib.suppress(OSError):
            while not self.frozen.is_set():
                data = src.recv(65536)
                if self.down:
                    src.close()
                    dst.close()
                    return
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                if up and self.freeze_after is not None:
                    with self._lock:
                        self.up += len(data)
                        if self.up >= self.freeze_after:
                            self.frozen.set()
                if self.frozen.is_set():
                    return  # what it read is never sent: the request hangs where it was
                dst.sendall(data)

    def close(self) -> None:
        import contextlib

        for s in (self._sock, *self._held):
            with contextlib.suppress(OSError):
                s.close()

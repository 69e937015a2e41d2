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
    """Every ranged GET s3fs makes of a key ending in ``suffix`` from now on, as ``(path, start, end)``."""
    import s3fs

    gets: list[tuple[str, int, int]] = []
    real = s3fs.S3FileSystem._cat_file

    async def counted(self: Any, path: str, version_id: Any = None, start: Any = None, end: Any = None) -> bytes:
        if str(path).endswith(suffix):
            gets.append((str(path), start, end))
        return await real(self, path, version_id=version_id, start=start, end=end)

    monkeypatch.setattr(s3fs.S3FileSystem, "_cat_file", counted)
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

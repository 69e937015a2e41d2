"""Loopback S3 helpers shared by the storage and API suites (the server fixture is in conftest.py)."""

from __future__ import annotations

import socket
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

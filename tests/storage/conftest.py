"""Fixtures for the storage suite: a loopback moto S3 server, backends, and S3-safe environment.

The S3 server is moto's ``ThreadedMotoServer`` on 127.0.0.1 and a port chosen free at run time,
started once per session and reset before every test that uses it. ``AWS_ENDPOINT_URL`` points at
a closed loopback port, so a request that lost its endpoint fails here instead of reaching the
internet; the real endpoint travels in ``storage_options["client_kwargs"]``.
"""

from __future__ import annotations

import os
import socket
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

# Before anything imports botocore: nothing in this suite may reach a real AWS endpoint.
os.environ["AWS_ENDPOINT_URL"] = "http://127.0.0.1:9"
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
os.environ["AWS_ACCESS_KEY_ID"] = "testing"
os.environ["AWS_SECRET_ACCESS_KEY"] = "testing"
os.environ["AWS_SESSION_TOKEN"] = "testing"
os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
os.environ.pop("AWS_PROFILE", None)

BUCKET = "smpckpt-test"

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    moto_server = pytest.importorskip("moto.server")
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def s3_options(endpoint: str) -> dict[str, Any]:
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "skip_instance_cache": True,
        # few, fast retries: a test that needs retries sets its own
        "config_kwargs": {"retries": {"max_attempts": 3, "mode": "standard"}, "connect_timeout": 5, "read_timeout": 30},
    }


def reset_moto(endpoint: str) -> None:
    import boto3
    import requests

    requests.post(f"{endpoint}/moto-api/reset", timeout=10).raise_for_status()
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3(moto_endpoint: str) -> tuple[str, dict[str, Any]]:
    """(base URL, storage_options) on a freshly reset moto with an empty bucket."""
    reset_moto(moto_endpoint)
    return f"s3://{BUCKET}", s3_options(moto_endpoint)


@pytest.fixture(params=["local", "memory", pytest.param("s3", marks=pytest.mark.s3)])
def backend(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """(base URL, storage_options) of a fresh empty location on each backend."""
    if request.param == "local":
        yield str(tmp_path), {}
    elif request.param == "memory":
        base = f"memory://smpckpt-{uuid.uuid4().hex[:8]}"
        yield base, {}
        import fsspec

        fs = fsspec.filesystem("memory")
        if fs.exists(base):
            fs.rm(base, recursive=True)
    else:
        yield request.getfixturevalue("s3")

"""Fixtures for the API/CLI suite: a loopback moto S3 server (same approach as tests/storage).

``AWS_ENDPOINT_URL`` points at a closed loopback port, so a request that lost its endpoint fails here
instead of reaching the internet; the real endpoint travels in ``storage_options["client_kwargs"]``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest

os.environ["AWS_ENDPOINT_URL"] = "http://127.0.0.1:9"
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
os.environ["AWS_ACCESS_KEY_ID"] = "testing"
os.environ["AWS_SECRET_ACCESS_KEY"] = "testing"
os.environ["AWS_SESSION_TOKEN"] = "testing"
os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
os.environ.pop("AWS_PROFILE", None)

API_BUCKET = "smpckpt-api-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def api_moto_endpoint() -> Iterator[str]:
    moto_server = pytest.importorskip("moto.server")
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_root(api_moto_endpoint: str) -> tuple[str, dict[str, Any]]:
    """(checkpoint root URL, storage_options) on a freshly reset moto with an empty bucket."""
    import boto3
    import requests
    import s3fs

    requests.post(f"{api_moto_endpoint}/moto-api/reset", timeout=10).raise_for_status()
    boto3.client("s3", endpoint_url=api_moto_endpoint, region_name="us-east-1").create_bucket(Bucket=API_BUCKET)
    s3fs.S3FileSystem.clear_instance_cache()
    options = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": api_moto_endpoint, "region_name": "us-east-1"},
        "skip_instance_cache": True,
        "config_kwargs": {"retries": {"max_attempts": 3, "mode": "standard"}, "connect_timeout": 5, "read_timeout": 30},
    }
    return f"s3://{API_BUCKET}/run", options

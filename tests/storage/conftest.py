"""Fixtures for the storage suite: a loopback moto S3 server, backends, and S3-safe environment.

The S3 server (``moto_endpoint``) and the S3-safe environment live in ``tests/conftest.py``; the
server is started once per session and reset before every test that uses it.
"""

from __future__ import annotations

import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from s3_env import reset_moto, s3_options  # noqa: F401  (re-exported for the storage tests)

BUCKET = "smpckpt-test"

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


@pytest.fixture
def s3(moto_endpoint: str) -> tuple[str, dict[str, Any]]:
    """(base URL, storage_options) on a freshly reset moto with an empty bucket."""
    reset_moto(moto_endpoint, BUCKET)
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

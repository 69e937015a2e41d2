"""Fixtures for the API/CLI suite; the moto server and S3-safe environment live in tests/conftest.py."""

from __future__ import annotations

from typing import Any

import pytest
from s3_env import reset_moto, s3_options

API_BUCKET = "smpckpt-api-test"


@pytest.fixture
def s3_root(moto_endpoint: str) -> tuple[str, dict[str, Any]]:
    """(checkpoint root URL, storage_options) on a freshly reset moto with an empty bucket."""
    reset_moto(moto_endpoint, API_BUCKET)
    options = s3_options(moto_endpoint)
    return f"s3://{API_BUCKET}/run", options

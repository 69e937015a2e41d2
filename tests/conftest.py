import os
import sys
from collections.abc import Iterator

import pytest

# Before anything imports botocore: no test may reach a real AWS endpoint. AWS_ENDPOINT_URL points at a
# closed loopback port, so a request that lost its endpoint fails here instead of reaching the internet;
# tests pass the loopback moto endpoint in storage_options["client_kwargs"].
os.environ["AWS_ENDPOINT_URL"] = "http://127.0.0.1:9"
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
os.environ["AWS_ACCESS_KEY_ID"] = "testing"
os.environ["AWS_SECRET_ACCESS_KEY"] = "testing"
os.environ["AWS_SESSION_TOKEN"] = "testing"
os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
os.environ.pop("AWS_PROFILE", None)


def _share_botocore_models() -> None:
    """Every botocore session of this process reads the service models through one loader.

    The suite's S3 options skip fsspec's instance cache, so each S3 call of the package makes a new
    filesystem, session and client, and each session's own loader parsed S3's model JSON again: 0.12
    CPU-s per client, 4 clients per save, 9 per ``smpckpt ls`` (a minute of the suite). A loader only
    reads the installed data files and caches what it parsed (one session already shares it between its
    clients), so sharing it changes no request and no client; each client is still new."""
    import functools

    import botocore.loaders
    import botocore.session

    botocore.session.create_loader = functools.cache(botocore.loaders.create_loader)  # type: ignore[attr-defined]


_share_botocore_models()

# Tests import helpers (dist_harness, sim) from this folder, and the demo's model from examples/.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
    import torch

    skip_slow = pytest.mark.skip(reason="slow: pass --run-slow")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """moto's ThreadedMotoServer on 127.0.0.1 and a free port, one per session (suites reset it per test)."""
    # A plain import, not importorskip: moto is a declared test dependency, and a missing one must fail
    # the run rather than quietly skip every S3 test.
    from moto import server as moto_server
    from s3_env import free_port

    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()

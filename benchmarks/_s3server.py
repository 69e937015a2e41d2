"""An S3 endpoint for the benchmark driver: a loopback moto server in a child process, or any endpoint.

moto runs in its own process (``ThreadedMotoServer`` under a tiny script) so that its CPU -- about one
core for the whole of every S3 operation, see /work/shared/reference/s3_baseline.md -- is not counted as
the client's, and client and server do not share a GIL (in-process moto made saves ~40 % slower).
The child exits when its stdin closes, so a crashed driver cannot leave it running.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time
from typing import Any

__all__ = ["S3Endpoint", "start_moto", "connect", "loopback_credentials", "server_cpu_s"]

_CHILD = """
import logging, sys
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
s = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
s.start()
print("ready", flush=True)
sys.stdin.read()  # until the parent closes the pipe or dies
s.stop()
"""


@dataclasses.dataclass
class S3Endpoint:
    url: str  #: http(s)://host:port
    bucket: str
    options: dict[str, Any]  #: s3fs storage options (credentials, endpoint)
    region: str = "us-east-1"
    proc: subprocess.Popen[str] | None = None  #: the moto child, when we started one

    def stop(self) -> None:
        if self.proc is None:
            return
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # our own child, by its handle
            self.proc.wait()
        self.proc = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_moto(bucket: str = "bench", timeout: float = 60.0) -> S3Endpoint:
    """Start moto on 127.0.0.1 and a free port in a child process and create ``bucket``."""
    port = _free_port()
    env = dict(os.environ)
    # objects stay in memory: spooling large ones to temp files would add disk noise to S3 figures
    env.setdefault("MOTO_S3_DEFAULT_KEY_BUFFER_SIZE", str(4 << 30))
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    line = proc.stdout.readline()  # blocks until "ready" or the child dies
    if line.strip() != "ready" or time.monotonic() > deadline:
        proc.kill()
        raise RuntimeError(f"moto server did not start (exit {proc.poll()})")
    loopback_credentials()
    ep = connect(f"http://127.0.0.1:{port}", bucket)
    ep.proc = proc
    return ep


def loopback_credentials() -> None:
    """moto accepts any credentials; set dummy ones unless the environment has some."""
    for k, v in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing")):
        os.environ.setdefault(k, v)


def connect(url: str, bucket: str, region: str = "us-east-1") -> S3Endpoint:
    """Options for ``url`` (credentials from the environment), creating ``bucket`` when it is missing.

    ``AWS_ENDPOINT_URL`` is set to ``url`` because s3torchconnector's DCP classes take no endpoint
    argument (its CRT client reads the variable); s3fs gets the endpoint explicitly as well.
    """
    import boto3

    os.environ["AWS_ENDPOINT_URL"] = url
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    os.environ.setdefault("AWS_DEFAULT_REGION", region)
    client = boto3.client("s3", endpoint_url=url, region_name=region)
    try:
        client.head_bucket(Bucket=bucket)
    except Exception:  # missing (or not ours to see): try to create it; a real failure shows on first use
        client.create_bucket(Bucket=bucket)
    opts: dict[str, Any] = {"client_kwargs": {"endpoint_url": url, "region_name": region}}
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if key and secret:
        opts.update(key=key, secret=secret)
    return S3Endpoint(url=url, bucket=bucket, options=opts, region=region)


def server_cpu_s(ep: S3Endpoint | None) -> float | None:
    """CPU seconds used so far by the moto child (user + system), or None when we did not start it."""
    if ep is None or ep.proc is None:
        return None
    try:
        with open(f"/proc/{ep.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

"""Loads from S3 (a loopback moto server): large tensors stream from their GET bodies straight into the
destinations (no ``bytes`` per request), verified there; corruption, truncation and transient errors
on that path behave as on local disk."""

from __future__ import annotations

import ctypes
import re
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from storage_helpers import assert_state_equal, load_error, roundtrip_load, save, zeros_like_state

from smpckpt.errors import CheckpointCorrupt
from smpckpt.storage import FsspecStorageReader, open_fs, read_manifest
from smpckpt.storage.backends import _s3

Backend = tuple[str, dict[str, Any]]
MiB = 1 << 20

pytestmark = pytest.mark.s3


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(3 * MiB // 4, generator=g),  # 3 MiB: read straight into its destination
        "mid": torch.randn(512, 1024, generator=g).to(torch.bfloat16),  # 1 MiB
        "small": torch.randn(100, generator=g),
        "step": 9,
    }


class _Spy:
    """Counts the calls of a real function and passes them on."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.calls = fn, []

    def __call__(self, *args: Any, **kw: Any) -> Any:
        self.calls.append(args)
        return self.fn(*args, **kw)


def _largest_file(url: str, opts: dict[str, Any]) -> tuple[Any, str, Any]:
    """The filesystem, path and record of the largest data file (the one holding ``big``)."""
    fs, path = open_fs(url, opts)
    rec = max(read_manifest(url, opts).files, key=lambda f: f.size)
    return fs, f"{path}/{rec.name}", rec


def _address(mv: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mv))


def test_large_tensors_stream_from_get_bodies_into_their_destinations(
    s3: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    import s3fs

    # reads straight into CPU destinations: the CPU stand-in of the device stage stages every load
    # through pool buffers (as CUDA destinations go; tests/storage/test_staging.py covers that path)
    monkeypatch.delenv("SMPCKPT_TEST_DEVICE", raising=False)
    base, opts = s3
    url = f"{base}/direct"
    sd = _state()
    save(sd, url, opts)
    gets = _Spy(_s3.get_range_into)
    monkeypatch.setattr(_s3, "get_range_into", gets)
    cats = _Spy(s3fs.S3FileSystem._cat_file)
    monkeypatch.setattr(s3fs.S3FileSystem, "_cat_file", cats)
    out = zeros_like_state(sd)
    reader = FsspecStorageReader(url, storage_options=opts)
    dcp.load(out, storage_reader=reader)
    assert_state_equal(sd, out)
    # no data file went through cat_file (a `bytes` per request); every request was a streamed GET
    assert not [c for c in cats.calls if str(c[1]).endswith(".distcp")]
    assert reader.last_read_stats is not None and reader.last_read_stats.requests == len(gets.calls)
    # ... and the large tensors' bytes landed in their destinations' own memory
    spans = [(_address(mv), len(mv)) for call in gets.calls for mv in call[4] if len(mv)]
    for key in ("big", "mid"):
        t = out[key]
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        assert sum(max(0, min(hi, a + n) - max(lo, a)) for a, n in spans) == hi - lo, key


def _saved(s3: Backend, name: str) -> tuple[dict[str, Any], str, dict[str, Any], Any, str, Any]:
    """(state, url, options, fs, path of the largest data file, its record) of a fresh save."""
    base, opts = s3
    url = f"{base}/{name}"
    sd = _state()
    save(sd, url, opts)
    return (sd, url, opts, *_largest_file(url, opts))


def test_a_flipped_byte_in_a_streamed_tensor_is_caught(s3: Backend) -> None:
    sd, url, opts, fs, fpath, rec = _saved(s3, "flip")
    data = bytearray(fs.cat_file(fpath))
    big = sd["big"].numpy().tobytes()
    start = bytes(data).find(big[:64])
    assert start >= 0
    pos = start + len(big) // 2  # inside the 3 MiB tensor
    data[pos] ^= 0x10
    fs.pipe_file(fpath, bytes(data))
    err = load_error(sd, url, opts)
    assert isinstance(err, CheckpointCorrupt) and "checksum mismatch" in str(err) and "big" in str(err)
    assert rec.name in str(err)


def test_a_truncated_object_fails_the_streamed_read(s3: Backend) -> None:
    sd, url, opts, fs, fpath, rec = _saved(s3, "trunc")
    fs.pipe_file(fpath, bytes(fs.cat_file(fpath))[: rec.size // 3])
    err = load_error(sd, url, opts)
    assert isinstance(err, CheckpointCorrupt) and "truncated" in str(err)


def test_a_get_answered_with_slowdown_is_retried(s3: Backend, moto_endpoint: str) -> None:
    from storage_faulty_proxy import FaultyProxy

    sd, url, opts, *_ = _saved(s3, "retry")
    failed: list[str] = []

    def should_fail(method: str, path: str, query: dict[str, list[str]]) -> int | None:
        if method == "GET" and path.endswith(".distcp") and not failed:
            failed.append(path)
            return 503
        return None

    with FaultyProxy(moto_endpoint, should_fail) as proxy:
        popts = dict(opts)
        popts["client_kwargs"] = dict(opts["client_kwargs"], endpoint_url=proxy.url)
        popts["config_kwargs"] = {"retries": {"max_attempts": 3, "mode": "standard"}}
        assert_state_equal(sd, roundtrip_load(sd, url, popts))
        assert len(proxy.injected) == 1


def test_a_server_that_ignores_ranges_is_refused_not_trusted(s3: Backend, moto_endpoint: str) -> None:
    """A ranged GET answered with the whole object (200, no Content-Range) would hand the object's first
    bytes to a request for later ones: the load fails naming the range and the file, at once."""
    from storage_faulty_proxy import FaultyProxy

    sd, url, opts, *_ = _saved(s3, "norange")
    with FaultyProxy(moto_endpoint, lambda *_: None, drop_request_headers=("range",)) as proxy:
        popts = dict(opts)
        popts["client_kwargs"] = dict(opts["client_kwargs"], endpoint_url=proxy.url)
        err = load_error(sd, url, popts)
        forwarded = proxy.forwarded
    assert isinstance(err, OSError) and not isinstance(err, CheckpointCorrupt), repr(err)
    assert re.search(r"asked for bytes [1-9]\d*\.\.\d+ of \S+\.distcp", str(err)), str(err)
    assert forwarded < 20  # refused at once, not retried


def test_a_read_past_the_end_of_a_truncated_object_reports_the_truncation(s3: Backend) -> None:
    """A range that starts beyond the object's end (S3 answers InvalidRange) is a truncated file, named."""
    from smpckpt.storage.backends._s3 import get_range_into

    base, opts = s3
    fs, path = open_fs(f"{base}/short", opts)
    fs.pipe_file(f"{path}/f", bytes(range(100)))
    buf = bytearray(50)
    assert get_range_into(fs, f"{path}/f", 200, 250, [memoryview(buf)]) == 0
    assert get_range_into(fs, f"{path}/f", 80, 130, [memoryview(buf)]) == 20 and bytes(buf[:20]) == bytes(
        range(80, 100)
    )
    parts = [memoryview(bytearray(3)), memoryview(bytearray(7))]
    assert get_range_into(fs, f"{path}/f", 10, 20, parts) == 10
    assert bytes(parts[0]) + bytes(parts[1]) == bytes(range(10, 20))
    with pytest.raises(FileNotFoundError):
        get_range_into(fs, f"{path}/missing", 0, 10, [memoryview(bytearray(10))])

"""Neighbouring items of one file merged into one request -- read straight into their destinations
(``ReadRun._batched``) or into a pooled buffer when a destination cannot take the stored bytes as they
are (``ReadRun._tasks``: CUDA tensors; every destination under the CPU stand-in,
``SMPCKPT_TEST_DEVICE=cpu``) -- take the read-ahead mark of the item that ends them (what follows the
request is what follows it), and both kinds taper alike at the file's end."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter
from smpckpt.storage.read import _run

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MiB = 1 << 20


def _data_file(path: str) -> str:
    (data,) = [os.path.join(path, f) for f in os.listdir(path) if os.path.getsize(os.path.join(path, f)) >= MiB]
    return data


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_a_merged_request_followed_by_unread_bytes_gets_no_read_ahead(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, staged: bool
) -> None:
    """Three 1 MiB tensors back to back in one file; a load of the first two only merges them into one
    request, which the third's (unread) bytes follow: its descriptor is advised ``POSIX_FADV_RANDOM``
    (read-ahead would fetch the third from the device for nothing)."""
    sd = {k: torch.full((MiB // 4,), float(i + 1)) for i, k in enumerate("abc")}
    path = str(tmp_path / "ck")
    dcp.save(sd, storage_writer=FsspecStorageWriter(path, thread_count=1))
    data = open(_data_file(path), "rb").read()
    order = sorted(sd, key=lambda k: data.find(sd[k].numpy().tobytes()))
    assert all(data.find(sd[k].numpy().tobytes()) >= 0 for k in sd)
    loaded = order[:2]  # the first two in the file: they touch, and the last one's bytes follow them
    if staged:
        monkeypatch.setenv("SMPCKPT_TEST_DEVICE", "cpu")
    advice: list[int] = []
    fadvise = os.posix_fadvise

    def spy(fd: int, offset: int, length: int, what: int) -> None:
        advice.append(what)
        fadvise(fd, offset, length, what)

    requests: list[tuple[int, int]] = []
    read_range, read_direct = _run.read_range, _run.read_direct

    def spy_range(fs: Any, path: str, lo: int, hi: int, *a: Any, **k: Any) -> Any:
        requests.append((lo, hi))
        return read_range(fs, path, lo, hi, *a, **k)

    def spy_direct(fs: Any, path: str, parts: Any, *a: Any, **k: Any) -> Any:
        requests.append((parts[0].lo, parts[-1].hi))
        return read_direct(fs, path, parts, *a, **k)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    monkeypatch.setattr(_run, "read_range", spy_range)
    monkeypatch.setattr(_run, "read_direct", spy_direct)
    dest = {k: torch.zeros_like(sd[k]) for k in loaded}
    dcp.load(dest, storage_reader=FsspecStorageReader(path))
    monkeypatch.undo()
    assert all(torch.equal(dest[k], sd[k]) for k in loaded)
    assert len(requests) == 1 and requests[0][1] - requests[0][0] >= 2 * MiB, requests  # merged
    assert advice == [os.POSIX_FADV_RANDOM], advice


def _request_sizes(path: str, sd: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch, staged: bool) -> list[int]:
    """The bytes of each request of a one-thread load of ``sd`` (staged: under the CPU stand-in),
    after checking that it loaded bit-exactly."""
    requests: list[int] = []
    read_range, read_direct = _run.read_range, _run.read_direct

    def spy_range(fs: Any, p: str, lo: int, hi: int, *a: Any, **k: Any) -> Any:
        requests.append(hi - lo)
        return read_range(fs, p, lo, hi, *a, **k)

    def spy_direct(fs: Any, p: str, parts: Any, *a: Any, **k: Any) -> Any:
        requests.append(parts[-1].hi - parts[0].lo)
        return read_direct(fs, p, parts, *a, **k)

    with monkeypatch.context() as m:
        if staged:
            m.setenv("SMPCKPT_TEST_DEVICE", "cpu")
        m.setattr(_run, "read_range", spy_range)
        m.setattr(_run, "read_direct", spy_direct)
        dest = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(dest, storage_reader=FsspecStorageReader(path, thread_count=1))
    assert all(torch.equal(dest[k], v) for k, v in sd.items()), staged
    return requests


def test_staged_merged_requests_taper_at_the_file_end_as_direct_ones_do(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twelve 4 MiB tensors in one file (48 MiB, more than ``max_request_bytes``): loaded straight into
    their destinations and through the stand-in's pooled buffers, the requests have the same sizes --
    each at most half the file's bytes not yet handed out (down to ``TAPER_FLOOR``) -- and the values
    are bit-exact both ways."""
    g = torch.Generator().manual_seed(5)
    sd = {f"t{i:02d}": torch.randn(MiB, generator=g) for i in range(12)}
    path = str(tmp_path / "ck")
    dcp.save(sd, storage_writer=FsspecStorageWriter(path, thread_count=1))
    sizes = {staged: _request_sizes(path, sd, monkeypatch, staged) for staged in (False, True)}
    assert sum(sizes[True]) >= 48 * MiB and max(sizes[True]) <= 24 * MiB + MiB, sizes
    assert sizes[True] == sizes[False], sizes

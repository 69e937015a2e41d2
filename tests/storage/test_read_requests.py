"""How a load's reads reach the device: neighbouring direct items are read with one large request
(``max_request_bytes``), and ``reads_in_flight`` below ``thread_count`` starts reads one at a time in
file order while the other workers verify -- without hanging when a read fails."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from damage import flip_byte
from storage_helpers import unwrap, zeros_like_state
from torch.distributed.checkpoint.api import CheckpointException

from smpckpt.errors import CheckpointCorrupt
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter
from smpckpt.storage.read import _fetch
from smpckpt.storage.read._run import InOrder, ReadAborted

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MiB = 1 << 20


def _state(n: int = 20) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {f"w{i:02d}": torch.randn(512, 1024, generator=g) for i in range(n)}  # 2 MiB each


def _saved(tmp_path: Any, sd: dict[str, torch.Tensor]) -> str:
    path = str(tmp_path / "ck")
    dcp.save(sd, storage_writer=FsspecStorageWriter(path, thread_count=1))  # one data file
    return path


def _load(path: str, sd: dict[str, torch.Tensor], **kw: Any) -> tuple[dict[str, torch.Tensor], FsspecStorageReader]:
    dest = zeros_like_state(sd)
    reader = FsspecStorageReader(path, **kw)
    dcp.load(dest, storage_reader=reader)
    return dest, reader


@pytest.mark.parametrize("verify", [True, False])
# 20 items of 2 MiB back to back (40 MiB): batches of up to limit_mib and at most half the bytes left,
# but not below 16 MiB (an item larger than the cap goes alone): 64 -> 20 + 16 + 4, 16 -> 16 + 16 + 8
@pytest.mark.parametrize(("limit_mib", "requests"), [(64, 3), (16, 3), (1, 20)])
def test_neighbouring_items_share_one_request(
    tmp_path: Any, verify: bool, limit_mib: int, requests: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # reads straight into CPU destinations (their batching is what is counted): not under the CPU
    # stand-in of the device stage, which stages every load as CUDA destinations are (next test)
    monkeypatch.delenv("SMPCKPT_TEST_DEVICE", raising=False)
    sd = _state()
    dest, reader = _load(_saved(tmp_path, sd), sd, verify_checksums=verify, max_request_bytes=limit_mib * MiB)
    for k, t in sd.items():
        assert torch.equal(dest[k], t), k
    stats = reader.last_read_stats
    assert stats is not None
    assert stats.requests == requests
    assert stats.bytes_read == stats.bytes_needed == 20 * 2 * MiB


@pytest.mark.parametrize("verify", [True, False])
# the same 20 items of 2 MiB into destinations that cannot take them in place (CUDA tensors; under the
# CPU stand-in of the device stage, every destination): read into pooled buffers, neighbours merged up
# to limit_mib per request and, as straight into destinations (above), at most half the bytes left down
# to 16 MiB -- 64 -> 20 + 16 + 4, 16 -> 16 + 16 + 8, 1 -> two per item (larger than the cap: cut into
# parts of it; it was one request and buffer of its whole size). Before merging, every item was a
# request of its own: 20 at every limit.
@pytest.mark.parametrize(("limit_mib", "requests"), [(64, 3), (16, 3), (1, 40)])
def test_neighbouring_items_staged_for_a_device_share_one_request(
    tmp_path: Any, verify: bool, limit_mib: int, requests: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SMPCKPT_TEST_DEVICE", "cpu")
    sd = _state()
    sizes: list[int] = []
    real = _fetch.BufferPool.take

    def take(self: Any, n: int) -> Any:
        sizes.append(n)
        return real(self, n)

    monkeypatch.setattr(_fetch.BufferPool, "take", take)
    dest, reader = _load(_saved(tmp_path, sd), sd, verify_checksums=verify, max_request_bytes=limit_mib * MiB)
    for k, t in sd.items():
        assert torch.equal(dest[k], t), k
    stats = reader.last_read_stats
    assert stats is not None
    assert stats.requests == requests, stats
    assert stats.bytes_read == stats.bytes_needed == 20 * 2 * MiB
    # every request's buffer within the cap, one buffer per request
    assert len(sizes) == requests and max(sizes) <= limit_mib * MiB, sizes


def test_one_read_in_flight_reads_in_file_order(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    sd = _state()
    path = _saved(tmp_path, sd)
    calls: list[int] = []
    active, most = [0], [0]
    lock = threading.Lock()
    preadv = os.preadv

    def spy(fd: int, buffers: Any, offset: int, *rest: Any) -> int:
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
            calls.append(offset)
        try:
            return preadv(fd, buffers, offset, *rest)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(os, "preadv", spy)
    dest, _ = _load(path, sd, thread_count=4, reads_in_flight=1, max_request_bytes=2 * MiB)
    monkeypatch.undo()
    for k, t in sd.items():
        assert torch.equal(dest[k], t), k
    assert most[0] == 1
    assert len(calls) >= 20
    assert calls == sorted(calls)


def test_failed_read_in_order_does_not_hang(tmp_path: Any) -> None:
    sd = _state()
    path = _saved(tmp_path, sd)
    data = [os.path.join(path, n) for n in os.listdir(path) if os.path.getsize(os.path.join(path, n)) > 30 * MiB]
    assert len(data) == 1
    flip_byte(data[0], 5 * MiB)  # a byte of the third item
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            _load(path, sd, thread_count=4, reads_in_flight=1, max_request_bytes=2 * MiB)
        except CheckpointException as exc:
            outcome.append(unwrap(exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "load hung after a failed read"
    assert len(outcome) == 1 and isinstance(outcome[0], CheckpointCorrupt), outcome
    assert data[0] in str(outcome[0])


def test_in_order_gate_releases_waiters_on_abort() -> None:
    gate = InOrder(1)
    got: list[BaseException] = []

    def wait_for_ticket_one() -> None:
        try:
            with gate.turn(1):
                pass
        except ReadAborted as exc:
            got.append(exc)

    t = threading.Thread(target=wait_for_ticket_one, daemon=True)
    t.start()
    t.join(timeout=0.2)
    assert t.is_alive()  # ticket 0 never came
    gate.abort()
    t.join(timeout=10)
    assert not t.is_alive() and len(got) == 1


@pytest.mark.parametrize("bad", [0, -1])
def test_reads_in_flight_must_be_positive(tmp_path: Any, bad: int) -> None:
    with pytest.raises(ValueError, match="reads_in_flight"):
        FsspecStorageReader(str(tmp_path), reads_in_flight=bad)
    with pytest.raises(ValueError, match="reads in flight"):
        InOrder(bad)


def test_small_reads_first_then_files_side_by_side(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(5)
    sd = {f"w{i:02d}": torch.randn(512, 1024, generator=g) for i in range(16)}  # 2 MiB each
    sd.update({f"b{i:02d}": torch.randn(256, generator=g) for i in range(16)})  # 1 KiB each
    path = str(tmp_path / "ck")
    dcp.save(sd, storage_writer=FsspecStorageWriter(path, thread_count=4))  # four data files
    reads: list[tuple[str, int, int]] = []  # (file, offset, bytes asked), in call order
    preadv = os.preadv

    def spy(fd: int, buffers: Any, offset: int, *rest: Any) -> int:
        reads.append((os.readlink(f"/proc/self/fd/{fd}"), offset, sum(len(b) for b in buffers)))
        return preadv(fd, buffers, offset, *rest)

    monkeypatch.setattr(os, "preadv", spy)
    # one worker: the calls come in the order the tasks were issued
    dest, _ = _load(path, sd, thread_count=1, max_request_bytes=64 * MiB)
    monkeypatch.undo()
    for k, t in sd.items():
        assert torch.equal(dest[k], t), k
    # a verified read of bytes in memory is carried out a chunk of check units at a time (one preadv each,
    # back to back): calls that continue the one before in the same file are one request
    merged: list[tuple[str, int, int]] = []
    for f, off, n in reads:
        chunk = merged and merged[-1][2] >= _fetch.FUSE_BYTES  # a fused chunk (the small records are far below)
        if chunk and merged[-1][0] == f and merged[-1][1] + merged[-1][2] == off:
            merged[-1] = (f, merged[-1][1], merged[-1][2] + n)
        else:
            merged.append((f, off, n))
    reads = merged
    small = [i for i, r in enumerate(reads) if r[2] < MiB]
    large = [i for i, r in enumerate(reads) if r[2] >= MiB]
    assert small and large and max(small) < min(large), reads
    # the first large read of every file comes before the second large read of any file
    first_four = [reads[i][0] for i in large[:4]]
    assert len(set(first_four)) == 4, reads
    for f in set(first_four):  # within a file, offsets ascend
        offsets = [reads[i][1] for i in large if reads[i][0] == f]
        assert offsets == sorted(offsets)

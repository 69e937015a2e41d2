"""The save and load pipeline's device stage, through its CPU stand-in (``SMPCKPT_TEST_DEVICE=cpu``).

Under the stand-in every tensor goes the way a CUDA tensor goes -- copied into a small pool of reused
buffers in chunks (large tensors) or packed (small ones), each buffer written and hashed while the
next is copied, and loads copied from pool buffers into their destinations -- so these tests run the
GPU machine's pipeline on the CPU: values bit-exact, chunk and pack boundaries, and the rule that a
buffer is never refilled before its write and its hash are done. Real-CUDA versions: tests/test_gpu.py.
"""

from __future__ import annotations

import math
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from storage_helpers import assert_state_equal, unwrap
from torch.distributed.checkpoint.api import CheckpointException

from smpckpt.errors import CheckpointCorrupt
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter
from smpckpt.storage.format._check_units import item_checks
from smpckpt.storage.format._reading import range_boxes
from smpckpt.storage.format._staging import MIN_STAGING_BYTES, BufferPool, buffer_size
from smpckpt.storage.tools import verify_checkpoint
from smpckpt.storage.write._pipeline import PACK_BELOW, chunk_bytes

CAP = MIN_STAGING_BYTES  # 1 MiB: four buffers of 256 KiB
BUF = buffer_size(CAP)


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMPCKPT_TEST_DEVICE", "cpu")


class Hooks:
    """Records what the pipeline did with its buffers: each staged buffer's write (index, bytes),
    each wait for a free buffer, and (``gate``) holds the first staged hash until the pool ran dry."""

    def __init__(self, gate: bool = False) -> None:
        self.written: list[tuple[int, int]] = []
        self.waits: list[tuple[int, int]] = []  # (buffers in use, buffers written so far) at each wait
        self.pool: BufferPool | None = None
        self._gate = threading.Event() if gate else None
        self._lock = threading.Lock()

    def on_written(self, index: int, nbytes: int = 0) -> None:
        with self._lock:
            self.written.append((index, nbytes))

    def on_wait(self) -> None:
        with self._lock:
            self.waits.append((self.pool.in_use if self.pool else -1, len(self.written)))
        if self._gate is not None:
            self._gate.set()

    def on_hash(self, index: int) -> None:
        if self._gate is not None:
            # bounded: with a pipeline that refilled buffers before their hash, no wait would ever come
            assert self._gate.wait(30), "no acquire ever waited for a buffer whose hash was pending"


def _writer(url: str, hooks: Hooks, **kw: Any) -> FsspecStorageWriter:
    w = FsspecStorageWriter(url, staging_bytes=CAP, sync_files=False, **kw)
    w._staging_hooks = hooks
    real = w._stages

    def stages() -> Any:
        s = real()
        hooks.pool = s.pool
        return s

    w._stages = stages  # type: ignore[method-assign]
    return w


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        "big": torch.randn(600, 1024, generator=g),  # 2.3 MiB: chunked, tiled (4 KiB rows x 1 group)
        "wide": torch.randn(96, 4096, generator=g),  # 1.5 MiB, 16 KiB rows: tiles in row groups
        "transposed": torch.randn(700, 300, generator=g).t(),  # strided source, chunked
        "bf16": torch.randn(333, 129, generator=g).to(torch.bfloat16),  # odd byte count, packed
        "small": [torch.randn(3 + i, generator=g) for i in range(40)],  # packed several to a buffer
        "flag": torch.rand(13, generator=g) > 0.5,
        "i64": torch.randint(-(2**40), 2**40, (97,), generator=g),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 5),
        "cplx": torch.randn(17, dtype=torch.complex64, generator=g).conj(),  # a conjugate view
        "step": 3,
    }


def _zeros(sd: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros(v.shape, dtype=v.dtype)
        elif isinstance(v, list):
            out[k] = [torch.zeros_like(t) for t in v]
        else:
            out[k] = None
    return out


def _resolved(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: v.resolve_conj() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}


def test_saves_and_loads_through_the_stand_in_are_bit_exact(tmp_path: Path, stand_in: None) -> None:
    sd = _state()
    hooks = Hooks()
    dcp.save(sd, storage_writer=_writer(str(tmp_path), hooks, thread_count=2))
    assert hooks.pool is not None and hooks.written, "the stand-in staged nothing"
    assert hooks.pool.peak_in_use <= hooks.pool.count and hooks.pool.limit <= CAP
    verify_checkpoint(str(tmp_path)).raise_if_failed()  # every digest was computed from the bytes that were written
    out = _zeros(sd)
    dcp.load(out, storage_reader=FsspecStorageReader(str(tmp_path), staging_bytes=CAP))
    assert_state_equal(_resolved(sd), out)


def test_strided_destinations_and_column_slices_load_through_the_stand_in(tmp_path: Path, stand_in: None) -> None:
    from sim import sim_load

    from smpckpt import ParallelLayout, ShardSpec
    from smpckpt.planners import ParallelLoadPlanner

    full = torch.randn(64, 4096)
    dcp.save({"w": full}, storage_writer=FsspecStorageWriter(str(tmp_path), staging_bytes=CAP))
    # a TP=4 rank's column slice (tiles: read row by row into a box) into a transposed destination
    dest = {"w": torch.zeros(1024, 64).t()}
    layout = ParallelLayout(tp=4)
    sim_load([dest], [ParallelLoadPlanner(layout, {"w": ShardSpec(1)}, rank=2)], [FsspecStorageReader(str(tmp_path))])
    assert torch.equal(dest["w"], full[:, 2048:3072])


@pytest.mark.parametrize("dest", ["device", "strided"])
@pytest.mark.parametrize("cols", [1024, 1000])  # 1000: parts end inside rows (a partial row, rows, a partial row)
def test_a_piece_larger_than_max_request_bytes_is_read_in_requests_of_at_most_that(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dest: str, cols: int
) -> None:
    # one 1M x 768 fp32 embedding resumed into a CUDA model (or merged TP=2 -> 1 by columns on the CPU)
    # took a host buffer of its whole 2.86 GiB (README: buffers of up to max_request_bytes)
    from smpckpt.storage.read import _fetch

    cap = 1 << 20
    full = torch.arange(1024 * cols, dtype=torch.int32).view(1024, cols).view(torch.float32)  # 4 MiB
    dcp.save({"w": full}, storage_writer=FsspecStorageWriter(str(tmp_path)))
    asked: list[int] = []
    take = _fetch.BufferPool.take

    def counted(self: _fetch.BufferPool, n: int) -> bytearray:
        asked.append(n)
        return take(self, n)

    monkeypatch.setattr(_fetch.BufferPool, "take", counted)
    if dest == "device":
        monkeypatch.setenv("SMPCKPT_TEST_DEVICE", "cpu")  # every destination goes the CUDA way
        target = torch.zeros(1024, cols)
    else:
        target = torch.zeros(cols, 1024).t()  # strided: the stored bytes cannot land in it as they are
    reader = FsspecStorageReader(str(tmp_path), max_request_bytes=cap)
    dcp.load({"w": target}, storage_reader=reader)
    assert torch.equal(target.view(torch.int32), full.view(torch.int32))
    assert asked and max(asked) <= cap, (
        f"read buffers of {[n >> 10 for n in asked]} KiB with max_request_bytes of 1 MiB"
    )
    stats = reader.last_read_stats
    assert stats is not None and stats.bytes_requested == full.nbytes  # every byte read once
    # each part verified: a byte flipped in the third fails the load, naming the file and the key
    (info,) = FsspecStorageReader(str(tmp_path)).read_metadata().storage_data.values()
    with open(tmp_path / info.relative_path, "r+b") as f:
        f.seek(info.offset + info.length * 5 // 8)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(CheckpointException) as failed:
        dcp.load({"w": target}, storage_reader=FsspecStorageReader(str(tmp_path), max_request_bytes=cap))
    assert isinstance(unwrap(failed.value), CheckpointCorrupt)
    assert re.search(rf"{info.relative_path}: checksum mismatch .*\['w'\]", str(unwrap(failed.value)))


def test_chunks_end_on_row_groups_and_small_tensors_share_buffers(tmp_path: Path, stand_in: None) -> None:
    hooks = Hooks()
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(200, 4096, generator=g)  # 16 KiB rows: tiles in row groups
    smalls = {f"s{i}": torch.randn(100, generator=g) for i in range(60)}  # 400 B each
    dcp.save({"wide": wide, **smalls}, storage_writer=_writer(str(tmp_path), hooks, thread_count=1))
    checks = item_checks((200, 4096), 4, 1 << 20)
    group = checks.rows_per_group * checks.row_bytes
    step = chunk_bytes(BUF, checks)
    assert checks.groups > 1 and step % group == 0 and step <= BUF
    sizes = [n for _, n in hooks.written]
    total = wide.numel() * 4
    chunks = [step] * (total // step) + ([total % step] if total % step else [])
    assert sizes[: len(chunks)] == chunks or sizes[-len(chunks) :] == chunks, sizes
    # the 60 small tensors went out packed: far fewer writes than tensors, none over a buffer
    assert len(sizes) - len(chunks) <= 2 and max(sizes) <= BUF
    assert 400 < PACK_BELOW
    verify_checkpoint(str(tmp_path)).raise_if_failed()
    out = {"wide": torch.zeros_like(wide), **{k: torch.zeros(100) for k in smalls}}
    dcp.load(out, storage_reader=FsspecStorageReader(str(tmp_path)))
    assert torch.equal(out["wide"], wide) and all(torch.equal(out[k], v) for k, v in smalls.items())


def test_a_buffer_is_not_refilled_before_its_hash_is_done(tmp_path: Path, stand_in: None) -> None:
    """The first staged buffer's hash is held until the file's thread has to wait for a buffer. It must
    wait: every buffer is written but not one is free while that hash runs. Refilling the first buffer
    after its write alone would have overwritten the bytes being hashed (and never waited)."""
    hooks = Hooks(gate=True)
    big = torch.randn(1024, 1024)  # 4 MiB: 16 chunks through 4 buffers
    dcp.save({"big": big}, storage_writer=_writer(str(tmp_path), hooks, thread_count=1))
    assert hooks.pool is not None
    in_use, written = hooks.waits[0]
    assert in_use == hooks.pool.count == 4 and written == 4, hooks.waits
    verify_checkpoint(str(tmp_path)).raise_if_failed()
    out = {"big": torch.zeros_like(big)}
    dcp.load(out, storage_reader=FsspecStorageReader(str(tmp_path)))
    assert torch.equal(out["big"], big)


def test_buffers_pass_between_threads_and_the_cap_holds(tmp_path: Path, stand_in: None) -> None:
    """Four files on four threads share one pool of four buffers: none waits forever, none exceeds it."""
    hooks = Hooks()
    g = torch.Generator().manual_seed(3)
    sd = {f"t{i}": torch.randn(256, 1024, generator=g) for i in range(8)}
    dcp.save(sd, storage_writer=_writer(str(tmp_path), hooks, thread_count=4))
    assert hooks.pool is not None and hooks.pool.peak_in_use <= hooks.pool.count
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=FsspecStorageReader(str(tmp_path)))
    assert_state_equal(sd, out)


def test_full_artifacts_stage_boxes_in_chunks(tmp_path: Path, stand_in: None) -> None:
    from safetensors.torch import load_file

    from smpckpt import ParallelLayout
    from smpckpt.planners import ParallelSavePlanner
    from smpckpt.storage import FullArtifactWriter, FullOptions

    g = torch.Generator().manual_seed(5)
    sd = {"model": {"w": torch.randn(512, 1024, generator=g), "t": torch.randn(300, 600, generator=g).t()}}
    writer = FullArtifactWriter(str(tmp_path / "full"), full=FullOptions(dtype=torch.bfloat16), staging_bytes=CAP)
    dcp.save(sd, storage_writer=writer, planner=ParallelSavePlanner(ParallelLayout(), rank=0))
    got = load_file(str(tmp_path / "full" / "model.safetensors"))
    assert torch.equal(got["model.w"], sd["model"]["w"].to(torch.bfloat16))
    assert torch.equal(got["model.t"], sd["model"]["t"].to(torch.bfloat16))
    verify_checkpoint(str(tmp_path / "full")).raise_if_failed()


@settings(max_examples=200, deadline=None, derandomize=True)
@given(data=st.data())
def test_range_boxes_are_the_range_in_row_major_order(data: st.DataObject) -> None:
    shape = tuple(data.draw(st.lists(st.integers(0, 5), min_size=0, max_size=4)))
    total = math.prod(shape)
    a = data.draw(st.integers(0, total))
    b = data.draw(st.integers(a, total))
    flat = np.arange(total).reshape(shape)
    got: list[int] = []
    for offsets, sizes in range_boxes(shape, a, b):
        assert len(offsets) == len(sizes) == len(shape)
        got.extend(flat[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].reshape(-1).tolist())
    assert got == list(range(a, b))


_MEMORY_SCRIPT = r"""
import resource, sys, torch
import torch.distributed.checkpoint as dcp
from smpckpt import ParallelLayout
from smpckpt.planners import ParallelSavePlanner
from smpckpt.storage import FsspecStorageWriter, FullArtifactWriter

kind, root, cap = sys.argv[1], sys.argv[2], int(sys.argv[3])

def save(sd, name):
    url = f"{root}/{name}"
    if kind == "partial":
        writer = FsspecStorageWriter(url, staging_bytes=cap, sync_files=False)
        dcp.save(sd, storage_writer=writer)
    else:
        writer = FullArtifactWriter(url, staging_bytes=cap, sync_files=False)
        dcp.save(sd, storage_writer=writer, planner=ParallelSavePlanner(ParallelLayout(), rank=0))

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

torch.manual_seed(0)
save({"w": torch.randn(512, 256).t()}, "warm")  # imports, threads and arenas in place before measuring
state = {"w": torch.randn(6144, 4096).t()}  # 96 MiB, strided: no write can come from its own memory
base = peak()
save(state, "big")
print(peak() - base)
"""


@pytest.mark.parametrize("kind", ["partial", "full"])
def test_host_memory_above_the_state_stays_within_the_cap(tmp_path: Path, kind: str) -> None:
    """A 96 MiB strided tensor saved with an 8 MiB cap, in a fresh process: its peak resident memory
    grows by the cap and some slack, not by the tensor (which a whole-tensor copy would add)."""
    import subprocess
    import sys

    cap = 8 << 20
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, kind, str(tmp_path), str(cap)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    extra = int(out.stdout.strip().splitlines()[-1])
    assert extra < cap + (24 << 20), f"peak RSS grew by {extra / 2**20:.1f} MiB with a cap of {cap >> 20} MiB"


def test_a_buffer_is_not_refilled_while_its_write_is_still_running() -> None:
    """File A's first buffer is hashed at once but its write is held until file B, sharing the pool,
    had to wait for a buffer (or finished). B must wait: A's buffer is not free until its write
    returns. Releasing a buffer when its hash alone was done let B refill it under A's write."""
    from smpckpt.storage.format._checksum import BlockHasher
    from smpckpt.storage.format._staging import Stages
    from smpckpt.storage.write._pipeline import FileStream

    b_waited_or_done = threading.Event()
    stages = Stages(CAP, on_wait=b_waited_or_done.set)

    class _Sink:
        path, borrows = "mem", False

        def __init__(self, hold: bool) -> None:
            self.data, self.hold = bytearray(), hold
            self.changed_under_write = False

        def write(self, data: memoryview) -> None:
            if self.hold:
                self.hold = False
                before = bytes(data)
                assert b_waited_or_done.wait(30), "file B neither waited nor finished"
                self.changed_under_write = bytes(data) != before
            self.data += data

    a_data = torch.full((BUF // 4,), 1.0)  # one buffer's worth
    b_data = torch.arange(4 * CAP // 4, dtype=torch.float32)  # four pools' worth
    sinks = {"a": _Sink(hold=True), "b": _Sink(hold=False)}
    errors: list[BaseException] = []

    def run(name: str, t: torch.Tensor) -> None:
        stream = FileStream(sinks[name], BlockHasher(1 << 20), stages)  # type: ignore[arg-type]
        try:
            stream.stage(t, stages.get(t, "host"), None)
            stream.finish()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            stream.close()
            if name == "b":
                b_waited_or_done.set()

    a = threading.Thread(target=run, args=("a", a_data))
    a.start()
    while stages.pool.in_use == 0 and a.is_alive():  # bounded: A takes its buffer or ends
        a.join(0.01)
    b = threading.Thread(target=run, args=("b", b_data))
    b.start()
    a.join(60)
    b.join(60)
    stages.close()
    assert not errors, errors
    assert not sinks["a"].changed_under_write, "file A's buffer was refilled while it was being written"
    assert bytes(sinks["a"].data) == a_data.numpy().tobytes()
    assert bytes(sinks["b"].data) == b_data.numpy().tobytes()


@pytest.mark.parametrize("cap", [MIN_STAGING_BYTES, 5 << 20, 20 << 20, 100 << 20, 128 << 20, (1 << 30) + 12345])
def test_buffers_are_powers_of_two_and_the_pool_stays_within_its_cap(cap: int) -> None:
    """torch's pinned allocator rounds each request up to a power of two: a 20 MiB cap cut into 5 MiB
    buffers would pin 4 x 8 MiB. Buffers are powers of two, so what is pinned is what is counted."""
    pool = BufferPool(cap)
    size = pool.buffer_bytes
    assert size & (size - 1) == 0 and 4096 <= size <= 16 << 20
    assert pool.count * size <= cap and pool.count >= 4


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_packed_dtypes_never_take_the_raw_address_path() -> None:
    """The value digests' fast path reads samples from raw addresses at ``index * itemsize``; a packed
    dtype (``quint4x2``: two elements a byte) would read past its storage (a crash, or bytes of other
    memory), so it takes the bounds-checked ``torch.take`` path, which refuses it as before."""
    from smpckpt.planners._value_digests import value_digests

    packed = torch.quantize_per_tensor(torch.rand(1 << 22), 0.1, 0, torch.quint4x2)
    assert packed.untyped_storage().nbytes() < packed.numel() * packed.element_size()
    with pytest.raises(NotImplementedError):
        value_digests([packed])

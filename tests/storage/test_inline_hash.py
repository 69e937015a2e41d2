"""In-place records are hashed by the thread that writes them, a chunk at a time, each chunk hashed just
before its write (``storage/write/_pipeline.py``): the bytes come from memory once. The checksums must
be exactly those of the whole record hashed at once, whatever the chunk boundaries cut."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from damage import flip_byte
from storage_helpers import unwrap
from torch.distributed.checkpoint.api import CheckpointException

from smpckpt.errors import CheckpointCorrupt
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter
from smpckpt.storage.format._check_units import item_checks
from smpckpt.storage.format._checksum import BlockHasher
from smpckpt.storage.format._staging import Stages
from smpckpt.storage.format.manifest import read_manifest
from smpckpt.storage.write import writer as writer_mod
from smpckpt.storage.write._pipeline import INLINE_CHUNK, FileStream, inline_chunk

# shapes whose records the chunks cut in every way: 1-D units, tiles with rows dividing a chunk and not
# (12 KiB rows), rows longer than a chunk (1.5 MiB), a record under one chunk, an odd byte count
SHAPES: list[tuple[tuple[int, ...], torch.dtype]] = [
    ((3 * (1 << 20) // 4 + 5,), torch.float32),
    ((256, 4096), torch.float32),
    ((200, 3072), torch.float32),
    ((6, 3 << 17), torch.float32),
    ((100, 1000), torch.float16),
    ((7,), torch.int8),
]


def _tensor(i: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g, dtype=dtype)


class _Recorder:
    """A sink keeping the bytes, and a log of (event, thread, first byte's address, length) shared with
    the hasher below."""

    path, borrows = "mem", False

    def __init__(self) -> None:
        self.data = bytearray()
        self.log: list[tuple[str, str, int, int]] = []

    def write(self, data: memoryview) -> None:
        self.log.append(("write", threading.current_thread().name, _address(data), data.nbytes))
        self.data += data

    def commit(self) -> None:
        pass

    def abort(self) -> None:
        pass


def _address(mv: memoryview) -> int:
    return int(torch.frombuffer(mv, dtype=torch.uint8).data_ptr()) if mv.nbytes else 0


def _put_all(
    block_size: int, tensors: list[torch.Tensor], *, hash_beside: bool = False
) -> tuple[_Recorder, BlockHasher]:
    sink = _Recorder()

    class Logged(BlockHasher):
        def update(self, data: memoryview) -> None:
            sink.log.append(("hash", threading.current_thread().name, _address(data), data.nbytes))
            super().update(data)

    hasher = Logged(block_size)
    stages = Stages(8 << 20)
    stream = FileStream(sink, hasher, stages, hash_beside=hash_beside)  # type: ignore[arg-type]
    try:
        for t in tensors:
            data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            stream.put(data, item_checks(tuple(t.shape), t.element_size(), block_size))
        stream.finish()
    finally:
        stream.close()
        stages.close()
    return sink, hasher


@pytest.mark.parametrize("block_size", [1 << 20, 4 << 20, 64 << 10])
def test_in_place_chunks_are_hashed_by_the_writing_thread_just_before_their_write(block_size: int) -> None:
    """Every chunk of an in-place record: hashed on the caller's thread, then written from the same
    memory, before the next chunk is touched; no hash thread started. Before, chunks of 8 MiB went to
    a hash thread while the writer wrote them, and the bytes came from memory twice."""
    tensors = [_tensor(i, s, d) for i, (s, d) in enumerate(SHAPES)]
    sink, _ = _put_all(block_size, tensors)
    threads = {name for _, name, _, _ in sink.log}
    assert threads == {threading.current_thread().name}, f"chunks hashed or written on {threads}"
    events = [(kind, addr, n) for kind, _, addr, n in sink.log]
    # hash, write, hash, write, ... of the same chunk each time
    assert [k for k, _, _ in events] == ["hash", "write"] * (len(events) // 2)
    for (_, a1, n1), (_, a2, n2) in zip(events[::2], events[1::2]):
        assert (a1, n1) == (a2, n2), "a chunk was written other than as it was hashed"
        assert n1 <= max(INLINE_CHUNK, block_size, 3 << 19), "a chunk past a unit or row beyond INLINE_CHUNK"
    assert bytes(sink.data) == b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors)


@pytest.mark.parametrize("block_size", [1 << 20, 4 << 20, 64 << 10])
def test_inline_chunks_give_the_digests_of_each_record_hashed_whole(block_size: int) -> None:
    """The file's unit ends and digests equal those of a hasher fed each record in one ``update``
    (the chunking is invisible in the format), and each chunk is whole units or whole rows."""
    tensors = [_tensor(i, s, d) for i, (s, d) in enumerate(SHAPES)]
    _, hasher = _put_all(block_size, tensors)
    whole = BlockHasher(block_size)
    for t in tensors:
        whole.start_item(t.numel() * t.element_size(), item_checks(tuple(t.shape), t.element_size(), block_size))
        whole.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    assert hasher.finish() == whole.finish()
    assert hasher.tilings == whole.tilings and hasher.tilings  # tiled records among them
    for t in tensors:
        checks = item_checks(tuple(t.shape), t.element_size(), block_size)
        step = inline_chunk(checks)
        quantum = checks.row_bytes if checks.groups > 1 else checks.unit
        assert step % quantum == 0 and step >= quantum
        assert step <= max(INLINE_CHUNK, quantum)


def test_a_save_hashed_inline_round_trips_and_a_flipped_byte_is_caught(tmp_path: Path) -> None:
    """A real save of those records (in place, 4 file threads): loaded bit-exactly with verification,
    and a byte flipped inside the record whose rows are longer than a chunk fails the load."""
    state = {f"t{i}": _tensor(i, s, d) for i, (s, d) in enumerate(SHAPES)}
    path = str(tmp_path / "ck")
    dcp.save({"m": state}, storage_writer=FsspecStorageWriter(path, thread_count=4))
    dest = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load({"m": dest}, storage_reader=FsspecStorageReader(path))
    for k, v in state.items():
        assert torch.equal(dest[k], v), k
    # the record with 1.5 MiB rows: the file holding its tiling, a byte in row 3 past the first MiB
    (rec, tiling) = [(f, t) for f in read_manifest(path).files for t in f.tilings if t.row_bytes == 3 << 19][0]
    flip_byte(os.path.join(path, rec.name), tiling.start + 3 * tiling.row_bytes + (1 << 20) + 77)
    with pytest.raises(CheckpointException) as info:
        dcp.load({"m": {k: torch.empty_like(v) for k, v in state.items()}}, storage_reader=FsspecStorageReader(path))
    err: Any = unwrap(info.value)
    assert isinstance(err, CheckpointCorrupt) and "checksum mismatch" in str(err), err


def test_hashed_beside_the_writes_the_digests_are_the_same() -> None:
    """``hash_beside`` (a rank with CPUs to spare): chunks hashed on the file's hash thread while its
    thread writes them, with the same digests as inline."""
    tensors = [_tensor(i, s, d) for i, (s, d) in enumerate(SHAPES)]
    _, inline = _put_all(1 << 20, tensors)
    sink, beside = _put_all(1 << 20, tensors, hash_beside=True)
    assert any(kind == "hash" and name.startswith("smpckpt-hash") for kind, name, _, _ in sink.log)
    assert beside.finish() == inline.finish() and beside.tilings == inline.tilings


@pytest.mark.parametrize(
    ("cpus", "forced", "beside"),
    [(1, None, False), (2, None, False), (4, None, False), (5, None, True), (64, None, True)]
    + [(1, True, True), (64, False, False)],
)
def test_the_writer_hashes_inline_when_its_files_keep_the_cpus_busy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpus: int, forced: bool | None, beside: bool
) -> None:
    """4 files written at once: hashed inline where the rank has at most 4 CPUs, beside the writes (on
    hash threads) where CPUs would idle, unless the writer's ``hash_beside`` forces one way against
    that choice; the checkpoint loads bit-exactly either way."""
    monkeypatch.setattr(writer_mod, "rank_cpus", lambda: cpus)
    names: set[str] = set()
    update = BlockHasher.update

    def logged(self: BlockHasher, data: memoryview) -> None:
        names.add(threading.current_thread().name)
        update(self, data)

    monkeypatch.setattr(BlockHasher, "update", logged)
    state = {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(8)}  # 1 MiB each: 4 files of 2
    path = str(tmp_path / "ck")
    dcp.save({"m": state}, storage_writer=FsspecStorageWriter(path, thread_count=4, hash_beside=forced))
    assert names and all(n.startswith("smpckpt-hash" if beside else "smpckpt-write") for n in names), names
    dest = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load({"m": dest}, storage_reader=FsspecStorageReader(path))
    assert all(torch.equal(dest[k], v) for k, v in state.items())


def test_a_hash_beside_other_than_none_true_or_false_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="hash_beside must be True or False"):
        FsspecStorageWriter(str(tmp_path / "ck"), hash_beside="no")  # type: ignore[arg-type]

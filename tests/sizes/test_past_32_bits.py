"""Past 32-bit byte offsets (opt in: ``--run-slow``; two tests of 1-2 minutes each, 8.5 and 4.7 GiB
peak RSS; run one at a time).

One int32 tensor of 1,081,344 x 1024 elements: 4.125 GiB, so its file is past 2**32 bytes and each
half (a TP=2 rank's rows) past 2**31 -- where a single ``read``/``pread`` on Linux returns at most
2 GiB - 4 KiB, and 32-bit offsets or counts wrap. Every element holds its own flat index (int32 is
exact where float32 stops counting at 2**24), so any misplaced, repeated or lost byte shows.

Through a partial save with default options, a TP=1 resume, a resharded TP=2 load (one-process
simulated world), a full export read by the reference ``safetensors`` reader, and a resharded TP=2
load from that full artifact; every value compared bit-exact; then ``verify_checkpoint`` of the full
artifact, and flipped bytes named by tensor unit. A tiered save of it (``local_path``, every save
drained): the drain's per-file check refuses a byte flipped past 4 GiB in the fast-tier file, by file
and block; a clean save drains (checked, copied); ``verify_checkpoint`` and ``smpckpt verify`` read
every block of the durable copy and name each flipped byte's block; a resume from ``path`` is
bit-exact. Run it with
``python -m pytest --run-slow tests/sizes/test_past_32_bits.py``; its last run is recorded in
``benchmarks/RESULTS.md`` ("Real model sizes")."""

from __future__ import annotations

import bisect
import gc
import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from sim import sim_load
from torch import nn

from smpckpt import (
    FastTier,
    ParallelLayout,
    ResumeOptions,
    SaveOptions,
    ShardSpec,
    last_resume_info,
    resume_from_checkpoint,
    save_checkpoint,
    wait_for_saves,
)
from smpckpt.errors import CheckpointError
from smpckpt.planners import ParallelLoadPlanner
from smpckpt.storage import FsspecStorageReader, read_manifest, verify_checkpoint
from smpckpt.storage.format._check_units import item_checks
from smpckpt.storage.format._checksum import DEFAULT_BLOCK_SIZE
from smpckpt.storage.format.manifest import MANIFEST_NAME, FileRecord
from smpckpt.tools.cli import main as cli_main

ROWS, COLS = 1_081_344, 1024
SPECS = {"model.w": ShardSpec(dim=0)}

pytestmark = pytest.mark.slow


class Holder(nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("w", w)


def _indexed() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.int32).view(ROWS, COLS)


def _rows(lo: int, hi: int) -> torch.Tensor:
    return torch.arange(lo * COLS, hi * COLS, dtype=torch.int32).view(hi - lo, COLS)


def _load_tp2(folder: Path) -> None:
    """Each of two simulated TP ranks loads its half (2.06 GiB, past 2**31 bytes) bit-exact (the model
    alone: the save's user_content and RNG keys are left out)."""
    half = ROWS // 2
    dests = [{"model": {"w": torch.zeros(half, COLS, dtype=torch.int32)}} for _ in range(2)]
    sim_load(
        dests,
        [ParallelLoadPlanner(ParallelLayout(tp=2), SPECS, rank=r, allow_partial_load=True) for r in range(2)],
        [FsspecStorageReader(str(folder)) for _ in range(2)],
    )
    for r in range(2):
        if not torch.equal(dests[r]["model"]["w"], _rows(r * half, (r + 1) * half)):
            raise AssertionError(f"{folder}: TP rank {r}'s rows differ")


def test_one_tensor_past_4_gib(tmp_path: Path) -> None:
    nbytes = ROWS * COLS * 4
    assert nbytes > 2**32 and nbytes // 2 > 2**31
    root = tmp_path / "ckpt"
    model = Holder(_indexed())
    save_checkpoint(root, "p1", model=model, save_rng=False)
    sizes = [f.stat().st_size for f in (root / "p1_partial").iterdir()]
    assert max(sizes) > 2**32  # one data file holds the whole tensor

    save_checkpoint(root, "f1", partial=False, model=model)
    del model
    gc.collect()

    got = Holder(torch.zeros(ROWS, COLS, dtype=torch.int32))
    resume_from_checkpoint(root, tag="p1", model=got, load_rng=False)
    assert torch.equal(got.w, _indexed())
    del got
    gc.collect()

    _load_tp2(root / "p1_partial")

    full = root / "f1"
    (artifact,) = [f for f in os.listdir(full) if f.endswith(".safetensors")]
    assert (full / artifact).stat().st_size > 2**32
    with safe_open(str(full / artifact), framework="pt") as f:  # the reference reader
        assert torch.equal(f.get_tensor("w"), _indexed())
    gc.collect()
    _load_tp2(full)
    gc.collect()
    _verify_full_artifact(full, full / artifact)


def _verify_full_artifact(folder: Path, path: Path) -> None:
    """``verify_checkpoint`` of the full export reads every check unit of the 4.125 GiB tensor (a box of
    rows each; those holding bytes either side of 2 and 4 GiB among them), then names the unit of each
    byte flipped -- either side of 4 GiB, past it, the last -- as does ``smpckpt verify``."""
    report = verify_checkpoint(folder)
    assert report.ok and report.bytes_checked == read_manifest(str(folder)).total_bytes, report.problems
    with open(path, "rb") as f:  # the tensor's bytes start after the safetensors header
        data_start = 8 + int.from_bytes(f.read(8), "little")
    # a row-major run of whole rows per unit: the writer's block, for a tensor past 64 of them
    rows_per_unit = item_checks((ROWS, COLS), 4, DEFAULT_BLOCK_SIZE).unit // (COLS * 4)
    flipped = [2**32 - 1, 2**32, 2**32 + 4097, path.stat().st_size - 1]
    first_rows = sorted({(off - data_start) // (COLS * 4) // rows_per_unit * rows_per_unit for off in flipped})
    _flip(path, flipped)
    try:
        report = verify_checkpoint(folder)
        assert list(report.problems) == [f"{path}: checksum mismatch in 'w' at [{r}, 0]" for r in first_rows]
        rc, text = _cli("verify", str(folder))
        assert rc == 1 and all(p in text for p in report.problems), text
    finally:
        _flip(path, flipped)


def _flip(path: Path, offsets: list[int]) -> None:
    """XOR one byte at each of ``offsets`` of the file in place (again: restored), without reading it."""
    fd = os.open(path, os.O_RDWR)
    try:
        for off in offsets:
            (b,) = os.pread(fd, 1, off)
            os.pwrite(fd, bytes([b ^ 0xFF]), off)
    finally:
        os.close(fd)


def _named_blocks(rec: FileRecord, where: str, offsets: list[int]) -> list[str]:
    """The problems a block check reports for bytes changed at ``offsets`` of ``rec``'s file: one per
    block, each block at most the writer's 1 MiB and holding its offset (so the name points at it)."""
    out = []
    for i in sorted({bisect.bisect_right(rec.block_ends, off) for off in offsets}):
        bs, be = rec.block_start(i), rec.block_ends[i]
        if not (be - bs <= DEFAULT_BLOCK_SIZE and any(bs <= off < be for off in offsets)):
            raise AssertionError(f"block {i} ({bs}..{be}) does not pin an offset of {offsets}")
        out.append(f"{where}: checksum mismatch in bytes {bs}..{be} (block {i})")
    return out


def _cli(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = cli_main(list(argv), stdout=out, stderr=err)
    return rc, out.getvalue() + err.getvalue()


def test_tiered_drain_and_verify_past_4_gib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The 4.125 GiB tensor through a tiered save (``local_path``, ``durable_every=1``: every save
    drains). First a byte just past 4 GiB of the fast-tier file changes between the save and its drain:
    the drain's per-file check (``check_blocks`` as it copies) refuses it by file and block, nothing of the tag
    is in ``path``, and ``smpckpt verify --local`` names the same block of the fast-tier copy. A second
    save drains (checked as copied past 2**32 bytes); ``verify_checkpoint`` reads every block of the
    durable copy (those straddling 2 and 4 GiB included), then finds flipped bytes -- either side of 2
    and of 4 GiB, just past 4 GiB, the last -- each by file and block, as does ``smpckpt verify``; restored, a
    resume from ``path`` alone gives every element bit-exact. One copy of the tensor in memory at a
    time: verify and the drain stream the files; the comparison goes a slice at a time."""
    import smpckpt.api._drain as drain

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    durable, local = tmp_path / "durable", tmp_path / "fast"
    past_4 = 2**32 + 4097
    real_check, checked = drain.check_blocks, []

    def damaged_t1(fs: Any, path: str, rec: FileRecord, *args: Any, **kwargs: Any) -> bool:
        """Flip a byte of t1's large file just before the drain checks (and copies) it, as a failing disk would."""
        tag = Path(path).parent.name.removesuffix("_partial")
        if tag == "t1" and rec.size > past_4:
            _flip(Path(path), [past_4])
        checked.append((tag, rec.name, rec.size))
        return real_check(fs, path, rec, *args, **kwargs)

    monkeypatch.setattr(drain, "check_blocks", damaged_t1)
    model = Holder(_indexed())
    options = (SaveOptions(save_rng=False), FastTier(str(local), replicas=1, durable_every=1))

    save_checkpoint(durable, "t1", model=model, options=options)
    with pytest.raises(CheckpointError, match="the drain of 't1' copies nothing damaged") as refused:
        wait_for_saves()
    message = str(refused.value)
    del refused  # its traceback reaches the drain's frames, which hold the saved tensor
    (big,) = [(name, size) for tag, name, size in checked if tag == "t1" and size > 2**32]
    (fast_file,) = local.glob(f"smpckpt-job-*/t1_partial/{big[0]}")
    fast_rec = _record(fast_file.parent, big[0])
    assert _named_blocks(fast_rec, str(fast_file), [past_4])[0] in message
    assert sorted(p.name for p in durable.iterdir()) == []  # no copy, no newest
    rc, text = _cli("verify", f"{durable}/t1", "--local", str(local))
    assert rc == 1 and "checksum mismatch" in text and f"(block {_block(fast_rec, past_4)})" in text, text
    assert big[0] in text and text.count("checksum mismatch") == 1, text

    checked.clear()
    save_checkpoint(durable, "t2", model=model, options=options)
    wait_for_saves()
    (big,) = [(name, size) for tag, name, size in checked if tag == "t2" and size > 2**32]  # checked as copied
    del model
    gc.collect()
    folder = durable / "t2_partial"
    assert (folder / MANIFEST_NAME).is_file() and not (durable / "t1_partial").exists()
    rec = _record(folder, big[0])
    assert rec.size == big[1] and rec.block_ends[-1] > 2**32

    seen: list[tuple[int, int]] = []
    report = verify_checkpoint(folder, progress=lambda done, total: seen.append((done, total)))
    total = read_manifest(str(folder)).total_bytes
    assert report.ok and report.checksummed, report.problems
    assert report.bytes_checked == total and seen[-1] == (total, total)

    # both sides of 2 GiB and of 4 GiB (one block where a block straddles the boundary, as the record's
    # header puts them), just past 4 GiB, and the last byte
    flipped = [2**31 - 1, 2**31, 2**32 - 1, 2**32, past_4, rec.size - 1]
    _flip(folder / rec.name, flipped)
    report = verify_checkpoint(folder)
    assert list(report.problems) == _named_blocks(rec, rec.name, flipped)
    rc, text = _cli("verify", f"{durable}/t2")
    assert rc == 1 and all(p in text for p in report.problems), text
    _flip(folder / rec.name, flipped)  # restored

    got = Holder(torch.zeros(ROWS, COLS, dtype=torch.int32))
    resume_from_checkpoint(durable, tag="t2", model=got, options=ResumeOptions(load_rng=False))
    info = last_resume_info()
    assert info is not None and (info.tag, info.tier) == ("t2", "durable")
    step = ROWS // 16
    for lo in range(0, ROWS, step):  # a slice at a time: no second 4 GiB tensor
        if not torch.equal(got.w[lo : lo + step], _rows(lo, min(lo + step, ROWS))):
            raise AssertionError(f"rows {lo}.. differ after the resume from {durable}")


def _record(folder: Path, name: str) -> FileRecord:
    (rec,) = [r for r in read_manifest(str(folder)).files if r.name == name]
    return rec


def _block(rec: FileRecord, offset: int) -> int:
    return bisect.bisect_right(rec.block_ends, offset)

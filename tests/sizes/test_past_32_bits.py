"""Past 32-bit byte offsets (opt in: ``--run-slow``; about a minute and 13 GiB of memory at its peak).

One int32 tensor of 1,081,344 x 1024 elements: 4.125 GiB, so its file is past 2**32 bytes and each
half (a TP=2 rank's rows) past 2**31 -- where a single ``read``/``pread`` on Linux returns at most
2 GiB - 4 KiB, and 32-bit offsets or counts wrap. Every element holds its own flat index (int32 is
exact where float32 stops counting at 2**24), so any misplaced, repeated or lost byte shows.

Through a partial save with default options, a TP=1 resume, a resharded TP=2 load (one-process
simulated world), a full export read by the reference ``safetensors`` reader, and a resharded TP=2
load from that full artifact; every value compared bit-exact. Run it with
``python -m pytest --run-slow tests/sizes/test_past_32_bits.py``; its last run is recorded in
``benchmarks/RESULTS.md`` ("Real model sizes")."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from sim import sim_load
from torch import nn

from smpckpt import ParallelLayout, ShardSpec, resume_from_checkpoint, save_checkpoint
from smpckpt.planners import ParallelLoadPlanner
from smpckpt.storage import FsspecStorageReader

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

"""The full export's gather-to-owner with one gloo message past 2 GiB (opt in: ``--run-slow``; about
6.5 GiB of memory at its peak over both ranks).

Gather-to-owner (``storage/full/_write.py``, ``gather_rank``) is how a full export reaches an object
store: each file's owner rank assembles its tensors from every rank's boxes, the others' arriving as one
gloo ``send``/``recv`` of the box's bytes each. Here 2 gloo ranks export one int32 tensor split on dim 0
unevenly -- rank 0 holds 1 row, rank 1 the other 524,800 rows of 4 KiB: 2.002 GiB, past 2**31 bytes --
so rank 1's box crosses to rank 0 (the one file's owner) as one message of that size. The algorithm
is forced on POSIX as ``benchmarks/bench_full_algorithms.py`` does (the package picks it only for
object stores); the rank functions check it ran. Every element holds its flat index; the artifact is
read back with the reference ``safetensors`` reader, a block of rows at a time, bit-exact. Run it with
``python -m pytest --run-slow tests/sizes/test_gather_past_2_gib.py``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import size_workers
import torch
from dist_harness import run_world
from safetensors import safe_open

pytestmark = [pytest.mark.slow, pytest.mark.dist]

ROWS, COLS = [1, 524_800], 1024
BLOCK_ROWS = 65536


def test_gather_to_owner_sends_one_box_past_2_gib(tmp_path: Path) -> None:
    big = ROWS[1] * COLS * 4
    assert big > 2**31
    root = tmp_path / "full"
    results = run_world(size_workers.gather_export, 2, str(root), ROWS, COLS, timeout=900.0)
    assert [r["gather_calls"] for r in results] == [1, 1]
    assert results[1]["max_sent"] == big  # rank 1's box went to the owner as one message
    (artifact,) = [f for f in os.listdir(root) if f.endswith(".safetensors")]
    total = sum(ROWS)
    with safe_open(str(root / artifact), framework="pt") as f:  # the reference reader
        w = f.get_slice("model.w")
        assert w.get_shape() == [total, COLS]
        for r0 in range(0, total, BLOCK_ROWS):
            r1 = min(total, r0 + BLOCK_ROWS)
            want = torch.arange(r0 * COLS, r1 * COLS, dtype=torch.int32).view(r1 - r0, COLS)
            assert torch.equal(w[r0:r1], want), (r0, r1)

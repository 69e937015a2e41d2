"""The multi-rank test harness itself (``dist_harness.run_world``): ranks forked from one fork server
must not share what separate interpreters would not, or tests of per-rank state pass when they should
fail (a resume restoring rank 0's RNG states on every rank passed ``test_api_dist``'s check once ranks
shared torch's import-time seed)."""

from __future__ import annotations

import os
from typing import Any

import pytest
from dist_harness import run_world


def _draws(rank: int, world_size: int) -> tuple[int, float, int, str | None]:
    import numpy as np
    import torch

    return torch.initial_seed(), float(torch.rand(1)), int(np.random.randint(1 << 30)), os.environ.get("SMPCKPT_T")


@pytest.mark.dist
def test_ranks_draw_their_own_random_streams_and_get_the_callers_environment(monkeypatch: Any) -> None:
    monkeypatch.setenv("SMPCKPT_T", "first")
    first = run_world(_draws, 3)
    monkeypatch.setenv("SMPCKPT_T", "second")
    second = run_world(_draws, 2)
    for name, i in (("torch seed", 0), ("torch.rand", 1), ("numpy", 2)):
        values = [r[i] for r in first + second]
        assert len(set(values)) == len(values), (name, values)  # no two ranks (or worlds) alike
    assert [r[3] for r in first] == ["first"] * 3 and [r[3] for r in second] == ["second"] * 2

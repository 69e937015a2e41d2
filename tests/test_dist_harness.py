"""The multi-rank test harness itself (``dist_harness.run_world``): ranks forked from one fork server
must not share what separate interpreters would not, or tests of per-rank state pass when they should
fail (a resume restoring rank 0's RNG states on every rank passed ``test_api_dist``'s check once ranks
shared torch's import-time seed); and a rank's teardown must stay cheap (it runs for every rank of
every world of the suite)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from dist_harness import run_world


def _draws(rank: int, world_size: int, folder: str) -> tuple[int, float, int, str | None]:
    import gc

    import numpy as np
    import torch

    def full_collection(phase: str, info: dict[str, int]) -> None:  # one file per full collection from now on
        if phase == "start" and info["generation"] == 2:
            with open(os.path.join(folder, f"rank{rank}-full-collection"), "a") as f:
                f.write("x")

    gc.callbacks.append(full_collection)  # last: only what runs after fn returned (the teardown) is seen
    return torch.initial_seed(), float(torch.rand(1)), int(np.random.randint(1 << 30)), os.environ.get("SMPCKPT_T")


@pytest.mark.dist
def test_ranks_draw_their_own_random_streams_and_get_the_callers_environment(monkeypatch: Any, tmp_path: Path) -> None:
    monkeypatch.setenv("SMPCKPT_T", "first")
    first = run_world(_draws, 3, str(tmp_path))
    monkeypatch.setenv("SMPCKPT_T", "second")
    second = run_world(_draws, 2, str(tmp_path))
    for name, i in (("torch seed", 0), ("torch.rand", 1), ("numpy", 2)):
        values = [r[i] for r in first + second]
        assert len(set(values)) == len(values), (name, values)  # no two ranks (or worlds) alike
    assert [r[3] for r in first] == ["first"] * 3 and [r[3] for r in second] == ["second"] * 2
    # a full collection in the teardown walks the ~255,000 objects the fork server imported: 0.2-0.5 CPU-s
    # per rank of every world, for nothing (os._exit follows)
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a rank's teardown ran a full gc collection"

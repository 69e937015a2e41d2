"""Tied heads in full artifacts: a DTensor model whose head is tied to its embedding writes what the
plain-tensor model writes, and what ``save_pretrained`` writes (the head left out), on 2 gloo ranks.
(Online and offline saves of every family: tests/hf/test_hf_seams.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import tied_workers
import torch
from dist_harness import run_world
from safetensors.torch import load_file


def _artifact(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(str(folder / name)))
    return out


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(
        k
        for k in set(a) | set(b)
        if k not in a or k not in b or a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])
    )


@pytest.mark.dist
def test_dtensor_model_with_a_tied_head_writes_what_the_plain_model_writes(tmp_path: Path) -> None:
    (r0, r1) = run_world(tied_workers.dtensor_tied_world, 2, str(tmp_path), timeout=240)
    assert r0["resumed_equal"] and r1["resumed_equal"]
    assert r0["still_tied"] and r1["still_tied"]
    plain, dtensor = _artifact(tmp_path / "plain"), _artifact(tmp_path / "dtensor")
    assert "lm_head.weight" not in plain  # as save_pretrained writes a tied GPT-2
    assert _differ(plain, dtensor) == []
    model = tied_workers.gpt2(0)
    assert _differ(plain, {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}) == []

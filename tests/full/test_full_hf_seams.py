"""Where full exports meet Hugging Face: the offline and online paths write one artifact (tied heads
included), translations that do not fit the model are refused, ``config.json`` states the dtype written,
a TP=1 model in our names exports without specs, and ``consolidate_checkpoint`` takes ``PATH/TAG``
(tier 1, one process)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from full_models import assert_state_equal, trained_model
from safetensors.torch import load_file

import smpckpt
from smpckpt.tools.consolidate import consolidate_checkpoint
from smpckpt.tools.convert import convert_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_consolidate_and_convert_take_path_slash_tag_as_the_cli_does(tmp_path: Path) -> None:
    model, _ = trained_model(0)
    root = str(tmp_path / "run")
    smpckpt.save_checkpoint(root, "step3", model=model, save_rng=False)
    report = consolidate_checkpoint(os.path.join(root, "step3"), tmp_path / "full", progress=False)
    assert "model.safetensors" in report["files"]
    got = load_file(str(tmp_path / "full" / "model.safetensors"))
    assert_state_equal(model.state_dict(), got)
    converted = convert_checkpoint(Path(root) / "step3", tmp_path / "one.pt")
    assert converted["tensors"] == len(model.state_dict())
    back = torch.load(tmp_path / "one.pt", weights_only=True)
    assert_state_equal(model.state_dict(), back["model"])

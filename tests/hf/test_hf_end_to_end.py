"""Hugging Face model -> tp=2 x pp=2 (real gloo ranks) -> a training step -> partial and full saves ->
``from_pretrained`` of the full artifact (online ``partial=False`` and offline ``smpckpt consolidate``)
gives the sharded model's logits."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_world
from hf_e2e_workers import end_to_end
from hf_reference import tiny_model

pytestmark = pytest.mark.dist


def test_hf_to_tp_pp_train_and_back_to_hf(tmp_path):
    hf_dir = tmp_path / "pretrained"
    tiny_model("gpt2", seed=3, dtype=torch.float32, vocab_size=96).save_pretrained(hf_dir)
    results = run_world(end_to_end, 4, str(tmp_path / "ckpt"), str(hf_dir), timeout=300)
    assert all(r["loaded_exact"] for r in results), "an HF tensor landed in the wrong TP/PP piece"
    out = results[0]
    # the step changed the model, so equal logits below are not the pretrained ones passing through
    assert not torch.allclose(out["sharded"], out["before"], atol=1e-3)
    for name, logits in out["logits"].items():
        torch.testing.assert_close(logits, out["sharded"], atol=1e-5, rtol=1e-5, msg=f"{name} artifact")

"""A partial checkpoint of a Llama with ``mlp_bias`` and ``attention_bias`` written by smpckpt f3c7484
(tests/data/llama_bias_v0, made once by tests/data/make_llama_bias_v0.py): TP=1, our names, Adam state, saved
under that tree's ``llama.tp_specs(1)``, which had no bias rules, so the fused ``gate_up_proj.bias`` is stored
flat ``[2I]``. Today's rules view it ``(2, -1)`` (split per gate/up half over TP); resuming it with them at TP=1
reads the same row-major bytes, bit-exactly, Adam moments included (rev69d: it was a LayoutMismatch). At TP=2
its pieces are no box of the stored shape: refused, naming the way out (tests/full/test_full_view_reshape.py).
Its bytes are committed; never regenerate them."""

from __future__ import annotations

import shutil
from pathlib import Path

from golden_model import assert_adam_resumed, stale_adam
from safetensors.torch import load_file
from transformers import LlamaConfig

import smpckpt
from smpckpt.hf import llama

DATA = Path(__file__).with_name("data") / "llama_bias_v0"


def test_old_tp1_llama_with_biases_resumes_under_todays_specs_bit_exact(tmp_path: Path) -> None:
    root = tmp_path / "run"
    shutil.copytree(DATA, root)  # never risk the fixture
    ref = load_file(str(root / "reference.safetensors"))
    config = LlamaConfig.from_json_file(str(root / "config.json"))
    specs = llama.tp_specs(1, config, prefix="model.")
    assert "model.model.layers.*.mlp.gate_up_proj.bias" in specs  # today's rule, absent when it was saved
    model, opt, params = stale_adam(ref)
    assert params["model.layers.0.mlp.gate_up_proj.bias"].shape == (16,)
    sharding = smpckpt.Sharding(layout=smpckpt.ParallelLayout(), specs=specs)
    smpckpt.resume_from_checkpoint(str(root), "step2", model=model, optimizer=opt, options=[sharding])
    assert_adam_resumed(model, opt, ref)
    assert len(params) == len(list(model.parameters())) == 17

"""A Hugging Face export with optimizer state written by smpckpt f2abde6 (tests/data/hf_opt_v0, made once by
tests/data/make_hf_opt_v0.py): a tiny GPT-2 in our names, ``partial=False, include_optimizer=True`` with the
GPT-2 translation. Before c3a3dec such an export keyed ``optimizer.safetensors`` by our names while
``model.safetensors`` holds HF's; main resumes it (through the artifact's own metadata) bit-exactly into a
TP=1 model in our names, Adam moments and ``step`` included, over live state of other values. Its bytes are
committed; never regenerate them."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from golden_model import holder
from safetensors.torch import load_file

import smpckpt
import smpckpt.hf.gpt2 as gpt2

DATA = Path(__file__).with_name("data") / "hf_opt_v0"


def test_old_hf_export_with_optimizer_keyed_by_our_names_resumes_bit_exact(tmp_path: Path) -> None:
    root = tmp_path / "run"
    shutil.copytree(DATA, root)  # never risk the fixture
    ref = load_file(str(root / "reference.safetensors"))
    assert "transformer.h.0.attn.qkv.weight.exp_avg" in load_file(str(root / "export" / "optimizer.safetensors"))
    assert "transformer.h.0.attn.c_attn.weight" in load_file(str(root / "export" / "model.safetensors"))
    params = {k: v for k, v in ref.items() if k.rsplit(".", 1)[1] in ("weight", "bias")}
    model = holder({k: torch.zeros_like(v) for k, v in params.items()})
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for p in model.parameters():  # live state of other values: the resume must replace it
        p.grad = torch.ones_like(p)
    opt.step()
    smpckpt.resume_from_checkpoint(
        str(root), "export", partial=False, model=model, optimizer=opt, translate_function=gpt2.TRANSLATION
    )
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), ref[name]), name
        state = opt.state[p]
        assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"], name
        for k, v in state.items():
            assert v.dtype == ref[f"{name}.{k}"].dtype and torch.equal(v, ref[f"{name}.{k}"]), f"{name}.{k}"
    assert len(params) == len(list(model.parameters())) == 16

"""A Hugging Face export with optimizer state written by smpckpt f2abde6 (tests/data/hf_opt_v0, made once by
tests/data/make_hf_opt_v0.py): a tiny GPT-2 in our names, ``partial=False, include_optimizer=True`` with the
GPT-2 translation. Before c3a3dec such an export keyed ``optimizer.safetensors`` by our names while
``model.safetensors`` holds HF's; main resumes it (through the artifact's own metadata) bit-exactly into a
TP=1 model in our names, Adam moments and ``step`` included, over live state of other values. Its bytes are
committed; never regenerate them."""

from __future__ import annotations

import shutil
from pathlib import Path

from golden_model import assert_adam_resumed, stale_adam
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
    model, opt, params = stale_adam(ref)
    smpckpt.resume_from_checkpoint(
        str(root), "export", partial=False, model=model, optimizer=opt, translate_function=gpt2.TRANSLATION
    )
    assert_adam_resumed(model, opt, ref)
    assert len(params) == len(list(model.parameters())) == 16

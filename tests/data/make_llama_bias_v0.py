"""How tests/data/llama_bias_v0 was made (once; never regenerate): a tiny Llama with ``mlp_bias`` and
``attention_bias``, TP=1, in our names (fused ``mlp.gate_up_proj`` weight ``[2I, d]`` and bias ``[2I]``), with
two Adam steps, saved as a partial checkpoint by smpckpt at commit f3c7484 (2026-11-30) under that tree's
``llama.tp_specs(1, config, prefix="model.")``, which had no bias rules: ``gate_up_proj.bias`` is stored flat
``[2I]``, where fix69e's rule ``ShardSpec(1, view=(2, -1))`` lays it out ``[2, I]``; the saved tensors are beside
it (reference.safetensors). Run from a checkout of f3c7484 (transformers installed):

    git -C REPO archive f3c7484 | tar -x -C OLD && ln -s ../planners OLD/smpckpt/planners
    ln -s ../storage OLD/smpckpt/storage && PYTHONPATH=OLD python tests/data/make_llama_bias_v0.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

import smpckpt
import smpckpt.hf.llama as llama

CONFIG = dict(hidden_size=8, intermediate_size=8, num_attention_heads=2, num_key_value_heads=1)
CONFIG |= dict(num_hidden_layers=1, vocab_size=11, max_position_embeddings=8, mlp_bias=True, attention_bias=True)


class Holder(nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, t in tensors.items():
            *path, leaf = name.split(".")
            mod: nn.Module = self
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, nn.Parameter(t))


if __name__ == "__main__":
    out = Path(sys.argv[1])
    config = LlamaConfig(**CONFIG)
    torch.manual_seed(5)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").state_dict()
    ours = {}
    for k, t in hf.items():
        if ".mlp.gate_proj." in k:  # our fused gate/up, weight and bias, as a TP=1 Megatron model holds them
            ours[k.replace("gate_proj", "gate_up_proj")] = torch.cat([t, hf[k.replace("gate_proj", "up_proj")]])
        elif ".mlp.up_proj." not in k:
            ours[k] = t.clone()
    ours = {k: v + torch.randn_like(v) * 0.1 for k, v in ours.items()}  # HF's constant biases would hide mix-ups
    model = Holder(ours)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for i in range(2):
        for p in model.parameters():
            p.grad = torch.sin(p.detach() * (3 + i))
        opt.step()
    specs = llama.tp_specs(1, config, prefix="model.")
    assert not any("bias" in k for k in specs), specs  # the old rules: no bias rule
    smpckpt.save_checkpoint(
        str(out), "step2", model=model, optimizer=opt, layout=smpckpt.ParallelLayout(), specs=specs, save_rng=False
    )
    config.to_json_file(str(out / "config.json"))
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref.update({f"{n}.{k}": v.clone() for n, p in model.named_parameters() for k, v in opt.state[p].items()})
    save_file(ref, str(out / "reference.safetensors"))

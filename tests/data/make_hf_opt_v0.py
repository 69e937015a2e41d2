"""How tests/data/hf_opt_v0 was made (once; never regenerate): a tiny GPT-2 in our names exported with its Adam
state by smpckpt at commit f2abde6 (2026-11-26), ``partial=False, include_optimizer=True`` with the GPT-2
translation: before c3a3dec (2026-11-28) an export's ``optimizer.safetensors`` was keyed by our names
(``transformer.h.0.attn.qkv.weight.exp_avg``), not the translated ones; the saved tensors are beside it
(reference.safetensors). That tree exported a TP=1 model only under the family's specs (spelled ``model.``). Run from a
checkout of f2abde6 (transformers installed):

    git -C REPO archive f2abde6 | tar -x -C OLD && ln -s ../planners OLD/smpckpt/planners
    ln -s ../storage OLD/smpckpt/storage && PYTHONPATH=OLD python tests/data/make_hf_opt_v0.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM, GPT2Config

import smpckpt
import smpckpt.hf.gpt2 as gpt2


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
    config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=11, n_positions=8)
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model = Holder({k: v.clone() for k, v in gpt2.translate_hf_state_dict_to_smpckpt(hf.state_dict()).items()})
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for i in range(2):
        for p in model.parameters():
            p.grad = torch.sin(p.detach() * (3 + i))
        opt.step()
    specs = {"model." + k: v for k, v in gpt2.tp_specs(1, config).items()}
    smpckpt.save_checkpoint(
        str(out),
        "export",
        partial=False,
        model=model,
        optimizer=opt,
        include_optimizer=True,
        translate_function=gpt2.TRANSLATION,
        hf_config=config,
        layout=smpckpt.ParallelLayout(),
        specs=specs,
    )
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref.update({f"{n}.{k}": v.clone() for n, p in model.named_parameters() for k, v in opt.state[p].items()})
    save_file(ref, str(out / "reference.safetensors"))

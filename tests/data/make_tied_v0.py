"""How tests/data/tied_v0 was made (once; never regenerate): a tied embedding/head model and its Adam state
saved by smpckpt 0.1.0 (commit 48ac769, before 1a28db0 recorded ties: both keys stored, Adam state under
the first key only), with the saved tensors beside it (reference.pt). Run from a checkout of 48ac769:

    git -C REPO archive 48ac769 | tar -x -C OLD && ln -s ../planners OLD/smpckpt/planners
    ln -s ../storage OLD/smpckpt/storage && PYTHONPATH=OLD python tests/data/make_tied_v0.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import smpckpt


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight  # as transformers ties lm_head to the input embedding


def trained() -> tuple[Tied, torch.optim.Adam]:
    torch.manual_seed(5)
    model = Tied()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for i in range(2):
        opt.zero_grad()
        model.head(model.embed(torch.arange(i, i + 4))).pow(2).mean().backward()
        opt.step()
    return model, opt


if __name__ == "__main__":
    out = Path(sys.argv[1])
    model, opt = trained()
    smpckpt.save_checkpoint(str(out), "step2", model=model, optimizer=opt, user_content={"step": 2}, save_rng=False)
    state = opt.state[model.embed.weight]
    torch.save(
        {"weight": model.embed.weight.detach().clone(), **{k: v.clone() for k, v in state.items()}},
        out / "reference.pt",
    )

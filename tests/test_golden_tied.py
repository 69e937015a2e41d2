"""A tied model's checkpoint written by smpckpt 0.1.0 (tests/data/tied_v0, made once by
tests/data/make_tied_v0.py): written before ties were recorded (1a28db0), it holds the head and the
embedding apart with Adam state under the first key only, as a frozen head beside a trained embedding
would; main refuses it without keep_tied (the two cannot be told apart), naming the keep_tied that loads
it, and with that keep_tied resumes it bit-exactly. Its bytes are committed; never regenerate them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import smpckpt

DATA = Path(__file__).with_name("data") / "tied_v0"


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight


def _fresh() -> tuple[_Tied, torch.optim.Adam]:
    """A tied model with other values and Adam state of its own (one step), so a load must replace both."""
    model = _Tied()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.embed.weight.grad = torch.ones_like(model.embed.weight)
    opt.step()
    return model, opt


def test_old_tied_checkpoint_is_refused_naming_keep_tied_and_loads_with_it(tmp_path: Path) -> None:
    root = tmp_path / "tied"
    shutil.copytree(DATA, root)  # never risk the fixture
    ref = torch.load(root / "reference.pt", weights_only=True)
    model, opt = _fresh()
    with pytest.raises(
        smpckpt.LayoutMismatch,
        match=r"'model\.head\.weight' and 'model\.embed\.weight' are one tensor.*only one holds .*"
        r"keep_tied=\['model\.embed\.weight'\]",
    ):
        smpckpt.resume_from_checkpoint(str(root), model=model, optimizer=opt)
    model, opt = _fresh()
    options = smpckpt.ResumeOptions(keep_tied=("model.embed.weight",))
    uc = smpckpt.resume_from_checkpoint(str(root), model=model, optimizer=opt, options=options)
    assert uc == {"step": 2}
    assert model.head.weight is model.embed.weight
    assert torch.equal(model.embed.weight.detach(), ref["weight"])
    state = opt.state[model.embed.weight]
    assert sorted(state) == sorted(k for k in ref if k != "weight")
    for k, v in state.items():
        assert torch.equal(v, ref[k]), k

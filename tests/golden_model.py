"""The model and state of the golden checkpoint in tests/data/golden_v1 (written by smpckpt 0.1.0 before
the one-owner refactor): regenerate nothing from it; tests load it to prove old checkpoints keep loading."""

from __future__ import annotations

import torch
from torch import nn

GOLDEN_ROOT = "golden_v1"
GOLDEN_TAG = "step3"
GOLDEN_USER_CONTENT = {"step": 3, "lr": 0.5, "note": "golden"}


def golden_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The exact model and Adam state saved in the golden checkpoint."""
    torch.manual_seed(1234)
    m = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3))
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        o.zero_grad()
        m(torch.randn(5, 6, generator=g)).pow(2).mean().backward()
        o.step()
    return m, o


def holder(tensors: dict[str, torch.Tensor]) -> nn.Module:
    """Parameters under dotted names (nested empty modules)."""
    root = nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, nn.Parameter(t))
    return root


def stale_adam(ref: dict[str, torch.Tensor]) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor]]:
    """A :func:`holder` of ``ref``'s parameters (its ``weight``/``bias`` keys) at zero with Adam state of other
    values (one step): a resume must replace all of it. Returns the model, its optimizer and those parameters."""
    params = {k: v for k, v in ref.items() if k.rsplit(".", 1)[1] in ("weight", "bias")}
    model = holder({k: torch.zeros_like(v) for k, v in params.items()})
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return model, opt, params


def assert_adam_resumed(model: nn.Module, opt: torch.optim.Optimizer, ref: dict[str, torch.Tensor]) -> None:
    """Every parameter and its Adam state equal ``ref``'s (``name`` and ``name.exp_avg`` ...), bit-exact and dtype."""
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), ref[name]), name
        state = opt.state[p]
        assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"], name
        for k, v in state.items():
            assert v.dtype == ref[f"{name}.{k}"].dtype and torch.equal(v, ref[f"{name}.{k}"]), f"{name}.{k}"

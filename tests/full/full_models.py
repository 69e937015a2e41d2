"""Models and comparisons the single-process full-checkpoint tests share."""

from __future__ import annotations

import torch
from torch import nn

MANIFEST = "smpckpt.manifest.json"
MARKER = "smpckpt.writing"


def trained_model(seed: int, steps: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small model with an int64 buffer (BatchNorm's counter), trained a few Adam steps."""
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    for _ in range(steps):
        o.zero_grad()
        m(torch.randn(5, 8)).pow(2).mean().backward()
        o.step()
    return m, o


def assert_state_equal(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert want and set(want) == set(got), (sorted(want), sorted(got))
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, (k, g.dtype, w.dtype, g.shape, w.shape)
        assert torch.equal(g, w), k


def assert_models_equal(a: nn.Module, b: nn.Module) -> None:
    assert_state_equal(a.state_dict(), b.state_dict())


def models_differ(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return any(not torch.equal(sa[k], sb[k]) for k in sa)


def optim_state(m: nn.Module, o: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """``<param fqn>.<state name>`` -> tensor, as optimizer.safetensors names them."""
    out = {}
    for name, p in m.named_parameters():
        for k, v in o.state[p].items():
            out[f"{name}.{k}"] = v
    return out

"""A two-layer model whose second layer may get no gradient (an unused branch): the state-dict shape of
an expert never routed to, for tests of optimizer state saved without some parameters."""

from __future__ import annotations

import torch
from torch import nn


def unused_branch_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    return m, torch.optim.Adam(m.parameters(), lr=0.1)


def unused_branch_step(m: nn.Module, o: torch.optim.Optimizer, both: bool) -> None:
    """One step; ``both=False`` leaves the second layer without a gradient (so without Adam state)."""
    o.zero_grad()
    x = torch.ones(2, 3)
    (m(x) if both else m[0](x)).sum().backward()
    o.step()

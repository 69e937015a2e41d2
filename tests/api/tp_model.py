"""A tiny residual MLP with Megatron-style TP shards (column-parallel fc1, row-parallel fc2) and DP.

Every rank builds the full weights from a seed and keeps its slice, so the global model is the same
under any layout; ``tp=dp=1`` without a process group is the single-process reference.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from demo_model import _CopyToTP as _Copy  # Megatron f/g ops, shared with the demo model
from demo_model import _ReduceFromTP as _Reduce
from torch import nn

from smpckpt import ParallelLayout, ShardSpec

D, F_DIM, BLOCKS, BATCH = 8, 16, 2, 8

SPECS = {
    "model.blocks.*.fc1.weight": ShardSpec(dim=0),
    "model.blocks.*.fc1.bias": ShardSpec(dim=0),
    "model.blocks.*.fc2.weight": ShardSpec(dim=1),
}


@dataclasses.dataclass
class Ctx:
    layout: ParallelLayout
    tp_rank: int = 0
    dp_rank: int = 0
    tp_group: Any = None
    dp_group: Any = None


def build_ctx(layout: ParallelLayout) -> Ctx:
    """Collective on every rank when a process group exists (new_group calls in the same order)."""
    if not dist.is_initialized():
        return Ctx(layout)
    rank = dist.get_rank()
    c = layout.coords(rank)
    ctx = Ctx(layout, c.tp, c.dp)
    for d in range(layout.dp):
        ranks = [layout.rank_of(tp=t, dp=d) for t in range(layout.tp)]
        g = dist.new_group(ranks) if layout.tp > 1 else None
        if rank in ranks:
            ctx.tp_group = g
    for t in range(layout.tp):
        ranks = [layout.rank_of(tp=t, dp=d) for d in range(layout.dp)]
        g = dist.new_group(ranks) if layout.dp > 1 else None
        if rank in ranks:
            ctx.dp_group = g
    return ctx


class Block(nn.Module):
    def __init__(self, ctx: Ctx, full: dict[str, torch.Tensor]) -> None:
        super().__init__()
        tp, r = ctx.layout.tp, ctx.tp_rank
        n = F_DIM // tp
        self.ctx = ctx
        self.fc1 = nn.Linear(D, n)
        self.fc2 = nn.Linear(n, D, bias=False)
        self.bias2 = nn.Parameter(full["bias2"].clone())
        with torch.no_grad():
            self.fc1.weight.copy_(full["fc1.weight"][r * n : (r + 1) * n])
            self.fc1.bias.copy_(full["fc1.bias"][r * n : (r + 1) * n])
            self.fc2.weight.copy_(full["fc2.weight"][:, r * n : (r + 1) * n])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.ctx.layout.tp > 1
        h = _Copy.apply(x, self.ctx.tp_group) if tp else x
        y = self.fc2(F.gelu(self.fc1(h)))
        if tp:
            y = _Reduce.apply(y, self.ctx.tp_group)
        return x + y + self.bias2


class TPMLP(nn.Module):
    def __init__(self, ctx: Ctx, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        blocks = []
        for _ in range(BLOCKS):
            full = {
                "fc1.weight": torch.randn(F_DIM, D, generator=g) / D**0.5,
                "fc1.bias": 0.1 * torch.randn(F_DIM, generator=g),
                "fc2.weight": torch.randn(D, F_DIM, generator=g) / F_DIM**0.5,
                "bias2": 0.1 * torch.randn(D, generator=g),
            }
            blocks.append(Block(ctx, full))
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def build(layout: ParallelLayout, seed: int = 0) -> tuple[Ctx, TPMLP, torch.optim.Adam]:
    ctx = build_ctx(layout)
    model = TPMLP(ctx, seed)
    return ctx, model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(ctx: Ctx, model: TPMLP, opt: torch.optim.Optimizer, step: int) -> float:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(BATCH, D, generator=g), torch.randn(BATCH, D, generator=g)
    per = BATCH // ctx.layout.dp
    x, y = x[ctx.dp_rank * per : (ctx.dp_rank + 1) * per], y[ctx.dp_rank * per : (ctx.dp_rank + 1) * per]
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    if ctx.layout.dp > 1:
        for p in model.parameters():
            dist.all_reduce(p.grad, group=ctx.dp_group)
            p.grad /= ctx.layout.dp
    opt.step()
    value = loss.detach().clone()
    if ctx.layout.dp > 1:
        dist.all_reduce(value, group=ctx.dp_group)
        value /= ctx.layout.dp
    return float(value)


def local_state(model: TPMLP, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters and optimizer tensors by name (local pieces), cloned."""
    out = {f"param.{k}": v.detach().clone() for k, v in model.named_parameters()}
    names = {id(p): k for k, p in model.named_parameters()}
    for p, st in opt.state.items():
        for n, v in st.items():
            out[f"optim.{names[id(p)]}.{n}"] = v.detach().clone()
    return out


def global_state(pieces: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full tensors from every TP rank's local_state (in TP rank order)."""
    out = {}
    for name in pieces[0]:
        dim = None
        if not name.endswith(".step"):
            if ".fc1." in name:
                dim = 0
            elif ".fc2.weight" in name:
                dim = 1
        out[name] = (
            torch.cat([p[name] for p in pieces], dim=dim) if dim is not None and len(pieces) > 1 else pieces[0][name]
        )
    return out

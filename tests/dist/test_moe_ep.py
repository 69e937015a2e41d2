"""Mixture-of-experts state with expert parallelism over DP, as plain tensors, on real gloo ranks.

The experts are stacked (grouped-GEMM style: ``w1 [E_local, h, f]``, ``w2 [E_local, f, h]``) and laid over
the DP ranks with the README's ``ShardSpec(0, axis="dp", sizes=...)``: 6 experts over 4 ranks (2, 2, 1, 1),
resumed on 2 ranks (3, 3). The router and norm are replicas (their gradients averaged). AdamW steps twice;
the experts' weights and moments, ``step`` and the learning rate must come back bit for bit, compared per
expert with what the saving run gathered from its live tensors (not through DCP).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_world
from torch import nn

import smpckpt
from smpckpt import ParallelLayout, ShardSpec

pytestmark = pytest.mark.dist

E, H, F = 6, 4, 5
PARTS = {4: (2, 2, 1, 1), 2: (3, 3)}


class _MoE(nn.Module):
    def __init__(self, world: int, rank: int, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        first = sum(PARTS[world][:rank])
        self.ids = list(range(first, first + PARTS[world][rank]))
        self.norm = nn.LayerNorm(H)
        self.router = nn.Linear(H, E, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(torch.randn(E, H, generator=gen))
        self.w1 = nn.Parameter(torch.randn(E, H, F, generator=gen)[self.ids].clone())
        self.w2 = nn.Parameter(torch.randn(E, F, H, generator=gen)[self.ids].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        logits = self.router(h)
        idx = logits[:, : E - 1].argmax(-1)  # the last expert gets no token: zero gradients, still stepped
        gate = logits.softmax(-1).gather(1, idx[:, None])
        y = h
        for j, g in enumerate(self.ids):
            rows = (idx == g).nonzero()[:, 0]
            y = y.index_add(0, rows, gate[rows] * (torch.relu(h[rows] @ self.w1[j]) @ self.w2[j]))
        return y


def _build(rank: int, world: int, seed: int) -> tuple[_MoE, torch.optim.Optimizer, dict[str, Any]]:
    torch.set_num_threads(1)
    model = _MoE(world, rank, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01 * (seed + 1), weight_decay=0.1)
    sizes = PARTS[world] if len(set(PARTS[world])) > 1 else None
    split = ShardSpec(0, axis="dp", sizes=sizes)
    return model, opt, {"layout": ParallelLayout(dp=world), "specs": {"w1": split, "w2": split}}


def _gathered(model: _MoE, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Every expert's weights and AdamW state by expert id, the replicas', ``step`` and ``lr``."""
    names = {id(p): n for n, p in model.named_parameters()}
    mine: dict[str, Any] = {}
    tensors = [(n, p.detach()) for n, p in model.named_parameters()]
    tensors += [(f"{names[id(p)]}.{k}", v) for p, state in opt.state.items() for k, v in state.items()]
    for name, value in tensors:
        if name.split(".")[0] in ("w1", "w2") and value.dim():
            mine.update({f"{name}[{g}]": value[j].clone() for j, g in enumerate(model.ids)})
        else:
            mine[name] = value.clone()
    mine["lr"] = opt.param_groups[0]["lr"]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged: dict[str, Any] = {}
    for part in everyone:
        merged.update(part)
    return merged


def _save(rank: int, world: int, root: str) -> dict[str, Any]:
    model, opt, sharding = _build(rank, world, seed=0)
    for step in range(2):
        model(torch.randn(16, H, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
        for p in (*model.norm.parameters(), model.router.weight):  # replicas: average their gradients
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad)
            p.grad = grad / world
        opt.step()
        opt.zero_grad()
    smpckpt.save_checkpoint(root, "ep4", model=model, optimizer=opt, **sharding)
    return _gathered(model, opt)


def _resume(rank: int, world: int, root: str) -> dict[str, Any]:
    model, opt, sharding = _build(rank, world, seed=1)
    smpckpt.resume_from_checkpoint(root, "ep4", model=model, optimizer=opt, **sharding)
    return _gathered(model, opt)


def test_stacked_experts_over_dp_resume_from_four_ranks_on_two(tmp_path: Any) -> None:
    root = str(tmp_path / "ckpt")
    saved = run_world(_save, 4, root)[0]
    resumed = run_world(_resume, 2, root)[0]
    assert len([k for k in saved if k.startswith("w1.exp_avg[")]) == E
    assert saved.keys() == resumed.keys()
    assert resumed["lr"] == saved["lr"] == 0.01
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert resumed[key].dtype == value.dtype and torch.equal(resumed[key], value), key

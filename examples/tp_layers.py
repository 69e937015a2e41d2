"""Tensor-parallel building blocks of the demo GPT: the process groups of a TP x PP x DP layout,
Megatron's f/g communication ops, and vocab- and row-parallel layers. (Column-parallel layers are
plain ``nn.Linear`` pieces whose shards the demo's ShardSpecs describe.)"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from smpckpt.errors import SpecError
from smpckpt.model.layout import ParallelLayout, RankCoords

__all__ = [
    "ParallelContext",
    "build_context",
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "RowParallelLinear",
    "_CopyToTP",
    "_ReduceFromTP",
    "_GatherFromTP",
    "_copy_to_tp",
    "_reduce_from_tp",
    "_param",
]


# -- process groups --------------------------------------------------------------------------------
@dataclasses.dataclass
class ParallelContext:
    """This rank's place in the layout and the process groups it talks over."""

    layout: ParallelLayout
    rank: int
    coords: RankCoords
    tp_group: Any = None  #: ``None`` when tp == 1 or without a process group
    dp_group: Any = None  #: ``None`` when dp == 1 or without a process group

    @property
    def distributed(self) -> bool:
        return self.layout.world_size > 1

    @property
    def first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def last_stage(self) -> bool:
        return self.coords.pp == self.layout.pp - 1

    def stage_peer(self, delta: int) -> int:
        """Global rank of the same (tp, dp) position in stage ``pp + delta``."""
        return self.layout.rank_of(tp=self.coords.tp, dp=self.coords.dp, pp=self.coords.pp + delta)


def build_context(layout: ParallelLayout) -> ParallelContext:
    """Create the TP and DP subgroups of ``layout`` (collective on every rank) and this rank's context.

    Without an initialised process group the layout must be a single rank.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if layout.world_size != 1:
            raise SpecError(f"{layout} needs {layout.world_size} ranks but no process group is initialised")
        return ParallelContext(layout, 0, layout.coords(0))
    if dist.get_world_size() != layout.world_size:
        raise SpecError(f"{layout} needs {layout.world_size} ranks, the process group has {dist.get_world_size()}")
    rank = dist.get_rank()
    coords = layout.coords(rank)
    tp_group = dp_group = None
    for pp in range(layout.pp):
        for dp in range(layout.dp):  # TP groups: all new_group calls run on every rank, same order
            ranks = [layout.rank_of(tp=t, dp=dp, pp=pp) for t in range(layout.tp)]
            group = dist.new_group(ranks) if layout.tp > 1 else None
            if rank in ranks:
                tp_group = group
        for tp in range(layout.tp):
            ranks = [layout.rank_of(tp=tp, dp=d, pp=pp) for d in range(layout.dp)]
            group = dist.new_group(ranks) if layout.dp > 1 else None
            if rank in ranks:
                dp_group = group
    return ParallelContext(layout, rank, coords, tp_group, dp_group)


# -- TP communication ops (Megatron's f / g), identities without a TP group ------------------------
class _CopyToTP(torch.autograd.Function):
    """Forward identity, backward all-reduce (input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Forward all-reduce, backward identity (output of a row-parallel layer)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """Forward all-gather along the last dim (uneven pieces), backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, sizes: tuple[int, ...], tp_rank: int) -> torch.Tensor:
        ctx.sizes, ctx.tp_rank = sizes, tp_rank
        width = max(sizes)
        padded = F.pad(x, (0, width - x.shape[-1])).contiguous()
        buffers = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(buffers, padded, group=group)
        return torch.cat([b[..., :n] for b, n in zip(buffers, sizes)], dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        start = sum(ctx.sizes[: ctx.tp_rank])
        return grad[..., start : start + ctx.sizes[ctx.tp_rank]].contiguous(), None, None, None


def _copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if group is None else _CopyToTP.apply(x, group)


def _reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if group is None else _ReduceFromTP.apply(x, group)


# -- modules ----------------------------------------------------------------------------------------
def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape))


class VocabParallelEmbedding(nn.Module):
    def __init__(self, sizes: tuple[int, ...], tp_rank: int, d: int, group: Any) -> None:
        super().__init__()
        self.start = sum(sizes[:tp_rank])
        self.stop = self.start + sizes[tp_rank]
        self.group = group
        self.weight = _param(sizes[tp_rank], d)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        outside = (tokens < self.start) | (tokens >= self.stop)
        local = (tokens - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return _reduce_from_tp(out, self.group)


class VocabParallelHead(nn.Module):
    def __init__(self, sizes: tuple[int, ...], tp_rank: int, d: int, group: Any) -> None:
        super().__init__()
        self.sizes, self.tp_rank, self.group = sizes, tp_rank, group
        self.weight = _param(sizes[tp_rank], d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(_copy_to_tp(x, self.group), self.weight)
        if self.group is None:
            return logits
        return _GatherFromTP.apply(logits, self.group, self.sizes, self.tp_rank)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_r @ W_r^T) + b`` with ``W`` split by columns, ``b`` replicated."""

    def __init__(self, in_local: int, out: int, group: Any) -> None:
        super().__init__()
        self.group = group
        self.weight = _param(out, in_local)
        self.bias = _param(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _reduce_from_tp(F.linear(x, self.weight), self.group) + self.bias

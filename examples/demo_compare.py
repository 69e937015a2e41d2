"""The demo's ground truth for comparisons: every rank's pieces gathered into global tensors, and a
bit-exact comparison of two global states."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from demo_model import GPTConfig, GPTStage, _global_name, _split_rule, global_from_shards
from tp_layers import ParallelContext

from smpckpt.errors import ReplicaMismatch

__all__ = ["gather_global_state", "compare_states"]


# -- gathering the global state for comparisons ------------------------------------------------------
_ADAM_STATE = ("exp_avg", "exp_avg_sq", "step")


def _local_pieces(stage: GPTStage, optim: torch.optim.Optimizer, ctx: ParallelContext) -> dict[str, torch.Tensor]:
    """This rank's tensors under their global keys (``model.<name>``, ``optim.state.<name>.<x>``)."""
    pieces: dict[str, torch.Tensor] = {}
    lrs = {id(p): group["lr"] for group in optim.param_groups for p in group["params"]}
    for local, param in stage.named_parameters():
        name = _global_name(ctx, local)
        pieces[f"model.{name}"] = param.detach().clone()
        state = optim.state.get(param, {})
        for key in _ADAM_STATE:
            if key in state:
                pieces[f"optim.state.{name}.{key}"] = torch.as_tensor(state[key]).detach().clone()
        pieces[f"optim.param_groups.{name}.lr"] = torch.tensor(float(lrs[id(param)]), dtype=torch.float64)
    return pieces


def _param_of(key: str) -> str:
    """Global parameter name behind a gathered key."""
    if key.startswith("model."):
        return key[len("model.") :]
    return key.split(".", 2)[2].rsplit(".", 1)[0]


def gather_global_state(
    cfg: GPTConfig, stage: GPTStage, optim: torch.optim.Optimizer, ctx: ParallelContext
) -> dict[str, torch.Tensor]:
    """Every parameter, Adam state tensor and learning rate as global tensors, on every rank.

    Raises :class:`ReplicaMismatch` if DP replicas (or TP replicas of unsharded tensors) differ.
    """
    pieces = _local_pieces(stage, optim, ctx)
    if ctx.distributed:
        everyone: list[Any] = [None] * ctx.layout.world_size
        dist.all_gather_object(everyone, (tuple(ctx.coords), pieces))
    else:
        everyone = [(tuple(ctx.coords), pieces)]
    by_key: dict[str, dict[int, list[torch.Tensor]]] = {}
    for (tp_rank, _dp, _pp), rank_pieces in everyone:
        for key, tensor in rank_pieces.items():
            by_key.setdefault(key, {}).setdefault(tp_rank, []).append(tensor)
    result: dict[str, torch.Tensor] = {}
    for key, per_tp in sorted(by_key.items()):
        name = _param_of(key)
        sharded = _split_rule(cfg, name) is not None and not key.endswith((".step", ".lr"))
        replicas = [t for tp_rank in sorted(per_tp) for t in per_tp[tp_rank]] if not sharded else None
        groups = [replicas] if replicas is not None else [per_tp[r] for r in sorted(per_tp)]
        for copies in groups:
            if any(not torch.equal(copies[0], c) for c in copies[1:]):
                raise ReplicaMismatch(f"replicas of {key} differ across ranks")
        if sharded:
            if sorted(per_tp) != list(range(ctx.layout.tp)):
                raise ReplicaMismatch(f"{key}: pieces for TP ranks {sorted(per_tp)} of {ctx.layout.tp}")
            result[key] = global_from_shards(cfg, name, [per_tp[r][0] for r in range(ctx.layout.tp)])
        else:
            result[key] = groups[0][0]
    return result


def compare_states(expected: Mapping[str, torch.Tensor], actual: Mapping[str, torch.Tensor]) -> list[str]:
    """Human-readable differences (keys, shapes, dtypes, bit-exact values); empty when identical."""
    problems = [f"missing {k}" for k in sorted(set(expected) - set(actual))]
    problems += [f"unexpected {k}" for k in sorted(set(actual) - set(expected))]
    for key in sorted(set(expected) & set(actual)):
        a, b = expected[key], actual[key]
        if a.shape != b.shape or a.dtype != b.dtype:
            problems.append(f"{key}: {tuple(a.shape)} {a.dtype} != {tuple(b.shape)} {b.dtype}")
        elif not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item()
            problems.append(f"{key}: values differ (max abs diff {diff:.3g})")
    return problems

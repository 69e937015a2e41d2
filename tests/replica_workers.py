"""Rank functions of tests/test_replica_values.py (two real gloo ranks through the public API)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

import smpckpt
from smpckpt import ParallelLayout


class _Col(nn.Module):
    def __init__(self, piece: torch.Tensor) -> None:
        super().__init__()
        self.fc1 = nn.Linear(piece.shape[1], piece.shape[0], bias=False)
        with torch.no_grad():
            self.fc1.weight.copy_(piece)


def forgotten_spec(rank: int, world: int, root: str) -> dict[str, Any]:
    """Each TP rank holds its own [8, 16] piece of fc1 under one key, and the save forgets its spec."""
    full = torch.arange(16 * 16, dtype=torch.float32).reshape(16, 16)
    model = _Col(full.chunk(2)[rank].clone())
    out: dict[str, Any] = {}
    try:
        smpckpt.save_checkpoint(root, "forgot", model=model, layout=ParallelLayout(tp=2), save_rng=False)
        out["error"] = None
    except smpckpt.CheckpointError as exc:
        out["error"] = (type(exc).__name__, str(exc))
    out["committed"] = os.path.exists(os.path.join(root, "forgot_partial", "smpckpt.manifest.json"))
    # the opt-out saves (one piece, as asked), and the spec saves both pieces
    smpckpt.save_checkpoint(
        root, "optout", model=model, layout=ParallelLayout(tp=2), save_rng=False, verify_replicas=False
    )
    specs = {"fc1.weight": smpckpt.ShardSpec(0)}
    smpckpt.save_checkpoint(root, "spec", model=model, layout=ParallelLayout(tp=2), specs=specs, save_rng=False)
    return out

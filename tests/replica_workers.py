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


def dtensor_replicas(rank: int, world: int, root: str) -> dict[str, Any]:
    """A (dp=2, tp=2) DeviceMesh; DTensors built from local values with ``run_check=False``, as a job
    whose replicas drifted would hold them. Returns each save's error text (None: it saved)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from smpckpt.planners import ParallelSavePlanner

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh.get_coordinate()[1]

    def save(name: str, state: dict[str, Any], planner: ParallelSavePlanner | None = None) -> str | None:
        planner = planner or ParallelSavePlanner(ParallelLayout(tp=2, dp=2))
        try:
            dcp.save(state, checkpoint_id=f"{root}/{name}", planner=planner)
        except CheckpointException as exc:
            return str(exc)
        return None

    def dt(local: torch.Tensor, placements: list[Any]) -> DTensor:
        return DTensor.from_local(local, mesh, placements, run_check=False)

    piece = torch.arange(8, dtype=torch.float32).chunk(2)[tp].clone()
    out: dict[str, Any] = {}
    # Replicate over both mesh dims: rank 3's copy differs
    out["replicate"] = save("rep", {"w": dt(torch.full((4,), float(rank == 3)), [Replicate(), Replicate()])})
    # Replicate over dp, Shard over tp: the tp pieces differ (as they must); rank 3 (dp 1, tp 1) holds
    # another value of the piece rank 1 (dp 0, tp 1) holds
    drifted = piece + 100 if rank == 3 else piece
    out["mixed"] = save("mix", {"w": dt(drifted, [Replicate(), Shard(0)]), "ok": dt(piece, [Replicate(), Shard(0)])})
    # consistent replicas, some holding -0.0 where others hold +0.0 (equal values): saved
    signed = torch.tensor([-0.0 if rank % 2 else 0.0, 1.0, 2.0])
    out["fine"] = save("fine", {"w": dt(piece, [Replicate(), Shard(0)]), "z": dt(signed, [Replicate(), Replicate()])})
    # a kept planner reuses its plan (the global cache) and still compares this save's values
    kept = ParallelSavePlanner(ParallelLayout(tp=2, dp=2))
    state = {"z": dt(signed.clone(), [Replicate(), Replicate()])}
    out["kept"] = [save("kept1", state, kept), save("kept2", state, kept)]
    if rank == 2:
        state["z"].to_local()[2] = 7.0
    out["kept"].append(save("kept3", state, kept))
    return out

"""Planners through the real dcp.save / dcp.load on spawned gloo ranks (tier 2)."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_world

pytestmark = pytest.mark.dist

FULL = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
D = torch.arange(4 * 8, dtype=torch.int64).reshape(4, 8)
E = torch.arange(3 * 2, dtype=torch.float32).reshape(3, 2)  # a tied pair's tensor, TP rank 0's piece empty


def _world(rank: int, world: int, path: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from smpckpt import ParallelLayout, ShardSpec
    from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner

    out: dict = {}
    save_layout = ParallelLayout(tp=2, dp=2)
    c = save_layout.coords(rank)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    state = {
        "w": FULL.chunk(2, dim=0)[c.tp].clone(),
        "b": torch.full((3,), 5.0),
        "d": distribute_tensor(D, mesh, [Shard(0), Replicate()]),
        "step": 11,
    }
    state["emb"] = state["head"] = E[: 3 * c.tp].clone()  # tied; sizes=(0, 3): TP rank 0 holds no row
    tied = {"emb": ShardSpec(0, sizes=(0, 3)), "head": ShardSpec(0, sizes=(0, 3))}
    planner = ParallelSavePlanner(save_layout, {"w": ShardSpec(0), **tied})
    dcp.save(state, checkpoint_id=f"{path}/ok", planner=planner)
    out["balance"] = planner.report.balance if rank == 0 else None

    # Reload with TP=4 (w split in four), DTensor on a 1-D mesh sharded along dim 1.
    mesh4 = init_device_mesh("cpu", (4,))
    dest = {
        "w": torch.zeros(2, 6),
        "b": torch.zeros(3),
        "d": distribute_tensor(torch.zeros_like(D), mesh4, [Shard(1)]),
        "step": 0,
    }
    dest["emb"] = dest["head"] = torch.zeros(int(rank < 3), 2)  # the empty ranks hold rows now
    tied = {"emb": ShardSpec(0, sizes=(1, 1, 1, 0)), "head": ShardSpec(0, sizes=(1, 1, 1, 0))}
    loader = ParallelLoadPlanner(ParallelLayout(tp=4), {"w": ShardSpec(0), **tied})
    dcp.load(dest, checkpoint_id=f"{path}/ok", planner=loader)
    out["w_ok"] = torch.equal(dest["w"], FULL.chunk(4, dim=0)[rank])
    out["b_ok"] = torch.equal(dest["b"], torch.full((3,), 5.0))
    out["d_ok"] = torch.equal(dest["d"].full_tensor(), D)
    out["step"] = dest["step"]
    out["resharded"] = loader.report.resharded
    out["tied"] = (planner.tied, loader.saved_tied, torch.equal(dest["head"], E[rank : rank + 1]))

    # A spec that lies about one rank's size fails the save on every rank, naming the key.
    bad = {"w": FULL.chunk(2, dim=0)[c.tp].clone()}
    sizes = (4, 4) if rank != 2 else (3, 5)
    try:
        dcp.save(
            bad, checkpoint_id=f"{path}/bad", planner=ParallelSavePlanner(save_layout, {"w": ShardSpec(0, sizes=sizes)})
        )
        out["bad"] = "saved"
    except CheckpointException as exc:
        out["bad"] = str(exc)
    dist.barrier()
    return out


def test_real_world_mixed_state_reshards_and_errors_reach_every_rank(tmp_path):
    results = run_world(_world, 4, str(tmp_path))
    for rank, out in enumerate(results):
        assert out["w_ok"] and out["b_ok"] and out["d_ok"], (rank, out)
        assert out["step"] == 11
        assert "w" in out["resharded"]
        # a tied pair split so that TP rank 0's pieces are empty: tied by the ranks holding rows (fix71a)
        assert out["tied"] == ({"head": "emb"} if rank % 2 else {}, {"head": "emb"}, True), (rank, out["tied"])
        assert "holds extent 4 along dim 0" in out["bad"] and "spec's sizes say 3" in out["bad"], out["bad"]
    assert results[0]["balance"] < 2.0
    assert not (tmp_path / "bad" / ".metadata").exists()

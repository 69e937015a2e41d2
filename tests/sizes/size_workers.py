"""Rank functions for tests/sizes/test_real_sizes.py (2 gloo ranks at TP=2)."""

from __future__ import annotations

import torch.distributed as dist
from size_model import Big, same

from smpckpt import ParallelLayout, ShardSpec, resume_from_checkpoint, save_checkpoint

LAYOUT = ParallelLayout(tp=2)
SPEC = {"up.weight": ShardSpec(dim=0)}


def reshard_then_save(rank: int, world: int, tp1_root: str, tp2_root: str) -> dict[str, bool]:
    """Resume the TP=1 checkpoint of the MLP weight at TP=2 (each rank reads its 5504 rows: 22.5 M
    elements, still past 2**24), then save at TP=2."""
    want = Big(tp=2, tp_rank=rank, seed=1, embedding=False)
    got = Big(tp=2, tp_rank=rank, seed=7, embedding=False)
    resume_from_checkpoint(tp1_root, model=got, layout=LAYOUT, specs=SPEC)
    exact = same(got, want)
    save_checkpoint(tp2_root, "tp2", model=want, layout=LAYOUT, specs=SPEC)
    dist.barrier()
    return {"resharded_exact": exact}

"""Rank functions for the tiered-checkpoint tests (tests/api/test_tiers.py): 2 simulated nodes of 2 ranks
each (``LOCAL_WORLD_SIZE=2``), every node's fast tier its own folder under ``base``."""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Any

import torch
import torch.distributed as dist
import tp_model

from smpckpt import ParallelLayout, last_resume_info, resume_from_checkpoint, save_checkpoint, wait_for_saves

LAYOUT = ParallelLayout(tp=2, dp=2)


def node_dir(base: str, rank: int, local_world_size: int = 2) -> str:
    return os.path.join(base, f"node{rank // local_world_size}")


def _clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _info() -> dict[str, Any]:
    info = last_resume_info()
    assert info is not None
    return {"tag": info.tag, "tier": info.tier, "from_peers": info.from_peers, "path_taken": info.path_taken}


def five_saves(rank: int, world: int, base: str, durable: str, async_save: bool = False) -> dict[str, Any]:
    """Five saves with replicas=2, durable_every=3; then a resume after node 1's fast tier is lost, and
    one after both are. Returns what every rank saw and whether each resume was bit-exact."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    local = node_dir(base, rank)
    ctx, model, opt = tp_model.build(LAYOUT)
    states: dict[int, dict[str, torch.Tensor]] = {}
    for step in range(1, 6):
        tp_model.train_step(ctx, model, opt, step)
        fut = save_checkpoint(
            durable,
            f"step{step}",
            model=model,
            optimizer=opt,
            user_content={"step": step},
            layout=LAYOUT,
            specs=tp_model.SPECS,
            local_path=local,
            replicas=2,
            durable_every=3,
            async_save=async_save,
        )
        if fut is not None:
            fut.result()
        states[step] = _clone(tp_model.local_state(model, opt))
    wait_for_saves()
    out: dict[str, Any] = {
        "local_after_saves": sorted(os.listdir(local)),
        "durable_after_saves": sorted(os.listdir(durable)),
    }
    dist.barrier()
    if rank == 2:
        shutil.rmtree(node_dir(base, rank))  # node 1 lost
    dist.barrier()
    ctx, model, opt = tp_model.build(LAYOUT, seed=99)
    uc = resume_from_checkpoint(
        durable, model=model, optimizer=opt, layout=LAYOUT, specs=tp_model.SPECS, local_path=local
    )
    out["one_node_lost"] = {**_info(), "uc": uc, "exact": _same(tp_model.local_state(model, opt), states[5])}
    out["local_after_heal"] = sorted(os.listdir(local)) if os.path.isdir(local) else None
    dist.barrier()
    if rank % 2 == 0:
        shutil.rmtree(node_dir(base, rank))  # every fast tier lost
    dist.barrier()
    ctx, model, opt = tp_model.build(LAYOUT, seed=98)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        uc = resume_from_checkpoint(
            durable, model=model, optimizer=opt, layout=LAYOUT, specs=tp_model.SPECS, local_path=local
        )
    out["all_lost"] = {**_info(), "uc": uc, "exact": _same(tp_model.local_state(model, opt), states[3])}
    return out

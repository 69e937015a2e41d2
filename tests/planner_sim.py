"""Shared pieces of the simulated planner tests (test_planner_checks, test_planner_ranks, test_planner_inputs):
a TP=2 layout, a 6x4 tensor split in two by rows, and save/load through our planners in one process."""

from __future__ import annotations

import torch
from sim import MemoryReader, MemoryStore, MemoryWriter, sim_load, sim_save

from smpckpt import ParallelLayout
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner

__all__ = ["TP2", "FULL", "tp_state", "save", "load"]


TP2 = ParallelLayout(tp=2)
FULL = torch.arange(24, dtype=torch.float32).reshape(6, 4)


def tp_state(rank: int, blank: bool = False) -> dict:
    piece = FULL.chunk(2, dim=0)[rank].clone()
    return {"w": torch.zeros_like(piece) if blank else piece, "b": torch.zeros(4) if blank else torch.ones(4)}


def save(sds, layout, specs=None, store=None, **kw):
    store = store or MemoryStore()
    planners = [ParallelSavePlanner(layout, specs, rank=r, **kw) for r in range(layout.world_size)]
    sim_save(sds, planners, [MemoryWriter(store) for _ in sds])
    return store, planners


def load(sds, layout, store, specs=None, **kw):
    planners = [ParallelLoadPlanner(layout, specs, rank=r, **kw) for r in range(layout.world_size)]
    sim_load(sds, planners, [MemoryReader(store) for _ in sds])
    return planners

"""Planning cost at scale: bytes gathered to the coordinator and global-planning time vs world size.

Runs a simulated world (one process, the same planner calls dcp.save makes) for a Megatron-like state
(TP-sharded and replicated tensors, Adam state, DP replicas) at growing DP degree, with our
ParallelSavePlanner and with DCP's DefaultSavePlanner (plain shards given as DTensor-free local
tensors would lose data there, so the default planner sees the replicated part only -- the part whose
gather grows with world size). Prints a table and writes JSON.

    python benchmarks/bench_planning.py [--out benchmarks/out/planning.json] [--layers 24]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from sim import reset_dcp_caches  # noqa: E402

from smpckpt import ParallelLayout, ShardSpec  # noqa: E402
from smpckpt.planners import ParallelSavePlanner  # noqa: E402

SPECS = {
    "model.layers.*.qkv.weight": ShardSpec(0),
    "model.layers.*.proj.weight": ShardSpec(1),
    "model.layers.*.fc1.weight": ShardSpec(0),
    "model.layers.*.fc2.weight": ShardSpec(1),
}


def state(layers: int, tp: int) -> dict:
    # Meta tensors: planning needs shapes only, so large worlds fit in memory.
    def t(*shape):
        return torch.empty(*shape, device="meta")

    model, optim = {}, {}
    for i in range(layers):
        for name, shape in (
            ("qkv.weight", (96 // tp, 32)),
            ("proj.weight", (32, 32 // tp)),
            ("fc1.weight", (128 // tp, 32)),
            ("fc2.weight", (32, 128 // tp)),
            ("ln.weight", (32,)),
            ("ln.bias", (32,)),
        ):
            key = f"layers.{i}.{name}"
            model[key] = t(*shape)
            optim[f"state.{key}.exp_avg"] = t(*shape)
            optim[f"state.{key}.exp_avg_sq"] = t(*shape)
    return {"model": model, "optim": optim}


def plan(planners, sds):
    local = []
    for rank, (p, sd) in enumerate(zip(planners, sds)):
        p.set_up_planner(state_dict=sd, storage_meta=None, is_coordinator=rank == 0)
        local.append(pickle.dumps(p.create_local_plan()))
    gathered = sum(len(b) for b in local)
    plans = [pickle.loads(b) for b in local]
    start = time.perf_counter()
    global_plans, metadata = planners[0].create_global_plan(plans)
    elapsed = time.perf_counter() - start
    for p, g in zip(planners, pickle.loads(pickle.dumps(global_plans))):
        p.finish_plan(g)
    return gathered, elapsed, len(pickle.dumps(metadata))


def run(layers: int, tp: int, dps: list[int], log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """One row per (world size, planner): gathered bytes, global-plan seconds, 2nd-save bytes, metadata."""
    rows = []
    log(f"{'world':>6} {'who':>8} {'gathered KiB':>13} {'global plan s':>14} {'2nd save KiB':>13} {'metadata KiB':>13}")
    for dp in dps:
        layout = ParallelLayout(tp=tp, dp=dp)
        world = layout.world_size
        sds = [state(layers, tp) for _ in range(world)]
        for who in ("smpckpt", "dcp"):
            reset_dcp_caches()
            if who == "smpckpt":
                planners = [ParallelSavePlanner(layout, SPECS, rank=r) for r in range(world)]
            else:
                planners = [DefaultSavePlanner(enable_plan_caching=False) for _ in range(world)]
            gathered, elapsed, md_bytes = plan(planners, sds)
            again, _, _ = plan(planners, sds)  # same structure: our per-instance cache sends almost nothing
            rows.append(
                {
                    "world": world,
                    "who": who,
                    "gathered_bytes": gathered,
                    "global_plan_s": elapsed,
                    "second_save_gathered_bytes": again,
                    "metadata_bytes": md_bytes,
                }
            )
            log(
                f"{world:>6} {who:>8} {gathered / 1024:>13.1f} {elapsed:>14.4f} {again / 1024:>13.1f} {md_bytes / 1024:>13.1f}"
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--out", default="benchmarks/out/planning.json")
    args = ap.parse_args()
    rows = run(args.layers, args.tp, args.dp)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "machine": platform.platform(),
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
                "layers": args.layers,
                "tp": args.tp,
                "rows": rows,
            },
            f,
            indent=1,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

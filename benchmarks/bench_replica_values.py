"""What checking replicas by value costs (``ParallelSavePlanner(verify_replicas=True)``, the default).

Every rank samples each tensor another rank holds too (16 elements) and digests it; it sends a summary
per split code and, from the first two ranks of each group, a digest per tensor; the coordinator
compares the ranks that hold the same piece. Measured here, interleaved rounds, medians, on this
thread's CPU time (``time.thread_time``: what the planning costs, whatever else the machine runs) and
wall time:

* local planning of one rank (tp=2 x dp=2, rank 1: every tensor has a replica), with the check on and
  off, beside DCP's ``DefaultSavePlanner`` making a fresh plan of the same state: as
  ``save_checkpoint`` pays it from its second save on (a kept planner, ``cache_scope="local"``, whose
  first round finished as ``dcp.save`` finishes it: the structure is reused -- checked: the plan's
  items are the first plan's -- and the values are sampled afresh) and for a fresh planner (its first
  save), for a
  GPT-like state of many small tensors (``--layers``; 150 layers ~ 2,700 tensors with Adam state) on
  the CPU;
* the bytes the check adds to each rank's gathered plan;
* the coordinator's comparison for simulated worlds (``--worlds``; TP=2 x DP), every rank's values
  built as the ranks would send them, and the bytes of them all.

Ratios are medians of per-round ratios (each case beside DCP's plan of the same round); the load
average before and after the rounds is printed and recorded, as the CPU columns still move with it.

    python benchmarks/bench_replica_values.py [--quick] [--rounds N] [--out benchmarks/out/replica_values.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

sys.path.insert(0, os.path.dirname(__file__))
from bench_planning import SPECS, state  # noqa: E402

from smpckpt import ParallelLayout  # noqa: E402
from smpckpt.planners import ParallelSavePlanner  # noqa: E402
from smpckpt.planners._replica_values import (  # noqa: E402
    check_replica_values,
    detail_codes,
    rank_values,
    stage_keys,
    value_digests,
)


def _clock() -> tuple[float, float]:
    return time.thread_time(), time.perf_counter()


def _since(start: tuple[float, float]) -> tuple[float, float]:
    cpu, wall = _clock()
    return cpu - start[0], wall - start[1]


def local_planning(sd: dict[str, Any], verify: bool, kept: bool) -> tuple[tuple[float, float], int]:
    """One rank's local plan, (CPU s, wall s) and its pickled bytes: a kept planner's second plan
    (``kept``), else a fresh planner's first."""
    layout = ParallelLayout(tp=2, dp=2)
    planner = ParallelSavePlanner(layout, SPECS, rank=1, cache_scope="local", verify_replicas=verify)
    first = None
    if kept:
        # the first save plans; the kept planner reuses the structure after. finish_plan closes the
        # round as dcp.save does: without it the next round drops the caches (a save that stopped
        # part-way) and the "kept" plan is a fresh one
        planner.set_up_planner(sd, None, False)
        first = planner.create_local_plan()
        planner.finish_plan(first)
    start = _clock()
    planner.set_up_planner(sd, None, False)
    plan = planner.create_local_plan()
    took = _since(start)
    if first is not None and plan.items is not first.items:
        raise RuntimeError("the kept planner planned afresh: the benchmark measures no reuse")
    return took, len(pickle.dumps(plan))


def dcp_local_planning(sd: dict[str, Any]) -> tuple[float, float]:
    """DCP's default planner, for scale: one fresh local plan (its plan cache is class-level: off)."""
    planner = DefaultSavePlanner(enable_plan_caching=False)
    start = _clock()
    planner.set_up_planner(sd, None, False)
    planner.create_local_plan()
    return _since(start)


def coordinator(world: int, tensors: list[torch.Tensor]) -> tuple[float, int]:
    """Seconds to compare ``world`` ranks' values of ``tensors`` (TP=2; a third replicated over the
    stage, the rest TP shards; all equal), and the bytes of every rank's values together."""
    layout = ParallelLayout(tp=2, dp=world // 2)
    keys = len(tensors)
    names = [f"model.layers.{i}.w" for i in range(keys)]
    splits = [frozenset({"tp"}) if i % 3 else frozenset() for i in range(keys)]
    codes = stage_keys(names, splits)[1]
    by_detail: dict[tuple[int, ...], bytes] = {}  # a rank's values depend on its detail codes only
    plans = []
    for rank in range(world):
        detail = detail_codes(layout, rank)
        if detail not in by_detail:
            by_detail[detail] = rank_values(layout, rank, tensors, codes)
        data: dict[str, Any] = {"rank": rank, "values": by_detail[detail]}
        if rank == 0:
            data["value_keys"] = stage_keys(names, splits)
        plans.append(SimpleNamespace(planner_data=data))
    start = time.perf_counter()
    check_replica_values(plans, plans, layout)
    return time.perf_counter() - start, sum(len(p.planner_data["values"]) for p in plans)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small state and few rounds (seconds)")
    ap.add_argument("--layers", type=int, default=None, help="layers of the state (default 150, quick 10)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 11, quick 3)")
    ap.add_argument("--worlds", type=int, nargs="+", default=None, help="coordinator worlds (default 8 64 512 4096)")
    ap.add_argument("--out", default="benchmarks/out/replica_values.json")
    args = ap.parse_args()
    layers = args.layers or (10 if args.quick else 150)
    rounds = args.rounds or (3 if args.quick else 11)
    worlds = args.worlds or ([8, 64] if args.quick else [8, 64, 512, 4096])
    torch.manual_seed(0)
    sd = state(layers, 2, device="cpu")
    for part in sd.values():
        for t in part.values():
            t.normal_()
    tensors = sum(len(part) for part in sd.values())

    load_before = os.getloadavg()
    cases = [(verify, kept) for kept in (True, False) for verify in (True, False)]
    times: dict[tuple[bool, bool], list[tuple[float, float]]] = {c: [] for c in cases}
    dcp_s: list[tuple[float, float]] = []
    sizes: dict[bool, int] = {}
    digest_s: list[tuple[float, float]] = []
    flat = [t for part in sd.values() for t in part.values()]
    for i in range(rounds):
        order = cases if i % 2 == 0 else cases[::-1]  # each pair swaps order every other round
        for verify, kept in order:
            seconds, size = local_planning(sd, verify, kept)
            times[(verify, kept)].append(seconds)
            if kept:
                sizes[verify] = size
        dcp_s.append(dcp_local_planning(sd))
        start = _clock()
        value_digests(flat)
        digest_s.append(_since(start))

    def med(xs: list[tuple[float, float]], j: int) -> float:
        return statistics.median(x[j] for x in xs)

    def ratio(xs: list[tuple[float, float]], j: int) -> float:
        return statistics.median(x[j] / d[j] for x, d in zip(xs, dcp_s))

    load_after = os.getloadavg()
    print(
        f"local planning of one rank ({tensors} tensors, {rounds} rounds; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after; on a shared machine read the CPU column)"
    )
    print(f"  {'case':34s} {'CPU ms':>8s} {'wall ms':>8s} {'CPU / DCP':>10s} {'wall / DCP':>10s}")
    local: dict[str, Any] = {}
    for verify, kept in cases:
        name = f"{'kept (2nd save)' if kept else 'fresh (1st save)'}, check {'on' if verify else 'off'}"
        xs = times[(verify, kept)]
        row = {"cpu_ms": med(xs, 0) * 1e3, "wall_ms": med(xs, 1) * 1e3, "cpu_vs_dcp": ratio(xs, 0)}
        row["wall_vs_dcp"] = ratio(xs, 1)
        local[name] = row
        print(
            f"  {name:34s} {row['cpu_ms']:8.2f} {row['wall_ms']:8.2f} {row['cpu_vs_dcp']:10.2f} {row['wall_vs_dcp']:10.2f}"
        )
    print(f"  {'DCP DefaultSavePlanner, fresh':34s} {med(dcp_s, 0) * 1e3:8.2f} {med(dcp_s, 1) * 1e3:8.2f}")
    print(f"  digests alone: {med(digest_s, 0) * 1e3:.2f} ms CPU")
    print(f"  plan bytes: check on {sizes[True] / 1024:.1f} KiB, off {sizes[False] / 1024:.1f} KiB")
    coord = []
    print(f"\ncoordinator comparison ({tensors} tensors per rank)")
    for world in worlds:
        runs = [coordinator(world, flat) for _ in range(3)]
        seconds = statistics.median(r[0] for r in runs)
        coord.append({"world": world, "seconds": seconds, "values_bytes": runs[0][1]})
        print(f"  world {world:>6}: {seconds * 1e3:8.2f} ms, values of every rank {runs[0][1] / 1024:9.1f} KiB")
    result = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "load_average": {"before": load_before, "after": load_after},
        "tensors_per_rank": tensors,
        "rounds": rounds,
        "local_planning": local,
        "dcp_default_ms": {"cpu": med(dcp_s, 0) * 1e3, "wall": med(dcp_s, 1) * 1e3},
        "plan_bytes": {"on": sizes[True], "off": sizes[False]},
        "digests_cpu_ms": med(digest_s, 0) * 1e3,
        "coordinator": coord,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

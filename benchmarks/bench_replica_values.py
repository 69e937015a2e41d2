"""What checking replicas by value costs (``ParallelSavePlanner(verify_replicas=True)``, the default).

Every rank samples each tensor it holds (16 elements) and sends a 4-byte digest per tensor; the
coordinator compares the ranks that hold the same piece. Measured here, interleaved rounds, medians:

* local planning of one rank, as ``save_checkpoint`` pays it from its second save on (a kept planner,
  ``cache_scope="local"``: the structure is reused, the values are sampled afresh), with the check on
  and off, for a GPT-like state of many small tensors (``--layers``; 150 layers ~ 2,700 tensors with
  Adam state) on the CPU;
* the bytes the check adds to each rank's gathered plan;
* the coordinator's comparison for simulated worlds (``--worlds``; TP=2 x DP), every rank's digests
  built as the ranks would send them.

    python benchmarks/bench_replica_values.py [--quick] [--out benchmarks/out/replica_values.json]
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
from smpckpt.planners._replica_values import check_replica_values, stage_keys, value_digests  # noqa: E402


def local_planning(sd: dict[str, Any], verify: bool) -> tuple[ParallelSavePlanner, float, int]:
    """A kept planner's second local plan: (planner, seconds, pickled plan bytes)."""
    layout = ParallelLayout(tp=2, dp=2)
    planner = ParallelSavePlanner(layout, SPECS, rank=1, cache_scope="local", verify_replicas=verify)
    planner.set_up_planner(sd, None, False)
    planner.create_local_plan()  # the first save plans; the kept planner reuses the structure after
    start = time.perf_counter()
    planner.set_up_planner(sd, None, False)
    plan = planner.create_local_plan()
    return planner, time.perf_counter() - start, len(pickle.dumps(plan))


def dcp_local_planning(sd: dict[str, Any]) -> float:
    """DCP's default planner, for scale: one fresh local plan (its plan cache is class-level: off)."""
    planner = DefaultSavePlanner(enable_plan_caching=False)
    start = time.perf_counter()
    planner.set_up_planner(sd, None, False)
    planner.create_local_plan()
    return time.perf_counter() - start


def coordinator(world: int, keys: int) -> float:
    """Seconds to compare ``world`` ranks' digests of ``keys`` tensors each (TP=2, all equal)."""
    layout = ParallelLayout(tp=2, dp=world // 2)
    names = [f"model.layers.{i}.w" for i in range(keys)]
    splits = [frozenset({"tp"}) if i % 3 else frozenset() for i in range(keys)]
    digests = value_digests([torch.full((4,), float(i)) for i in range(keys)])
    plans = []
    for rank in range(world):
        data: dict[str, Any] = {"rank": rank, "values": digests}
        if rank == 0:
            data["value_keys"] = stage_keys(names, splits)
        plans.append(SimpleNamespace(planner_data=data))
    start = time.perf_counter()
    check_replica_values(plans, plans, layout)
    return time.perf_counter() - start


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

    times: dict[bool, list[float]] = {True: [], False: []}
    dcp_s: list[float] = []
    sizes: dict[bool, int] = {}
    digest_s: list[float] = []
    flat = [t for part in sd.values() for t in part.values()]
    for _ in range(rounds):
        for verify in (True, False):
            _, seconds, size = local_planning(sd, verify)
            times[verify].append(seconds)
            sizes[verify] = size
        dcp_s.append(dcp_local_planning(sd))
        start = time.perf_counter()
        value_digests(flat)
        digest_s.append(time.perf_counter() - start)
    on, off, dcp = statistics.median(times[True]), statistics.median(times[False]), statistics.median(dcp_s)
    print(f"local planning of one rank, second save ({tensors} tensors, {rounds} rounds, medians)")
    print(f"  check on  {on * 1e3:8.2f} ms   plan {sizes[True] / 1024:7.1f} KiB")
    print(f"  check off {off * 1e3:8.2f} ms   plan {sizes[False] / 1024:7.1f} KiB")
    print(f"  added     {(on - off) * 1e3:8.2f} ms   {(sizes[True] - sizes[False]) / 1024:7.1f} KiB per rank")
    print(f"  digests alone: {statistics.median(digest_s) * 1e3:.2f} ms")
    print(f"  DCP's DefaultSavePlanner, fresh: {dcp * 1e3:.2f} ms (ours on {on / dcp:.2f}x, off {off / dcp:.2f}x)")
    coord = []
    print(f"\ncoordinator comparison ({tensors} tensors per rank)")
    for world in worlds:
        seconds = statistics.median(coordinator(world, tensors) for _ in range(3))
        coord.append({"world": world, "seconds": seconds})
        print(f"  world {world:>6}: {seconds * 1e3:8.2f} ms")
    result = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "tensors_per_rank": tensors,
        "rounds": rounds,
        "local_planning_ms": {"on": on * 1e3, "off": off * 1e3, "added": (on - off) * 1e3, "dcp_default": dcp * 1e3},
        "plan_bytes": {"on": sizes[True], "off": sizes[False]},
        "digests_ms": statistics.median(digest_s) * 1e3,
        "coordinator": coord,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

"""Planning cost at scale: per-rank local planning time, coordinator time and gathered bytes vs world size.

Runs a simulated world (one process, the same planner calls dcp.save / dcp.load make) for a
Megatron-like state (TP-sharded and replicated tensors, Adam state, DP replicas) at TP=2 and growing
DP degree, with our planners and with DCP's defaults.

* Local planning (every rank pays it, so it must not grow with the world): ``set_up_planner`` +
  ``create_local_plan`` of a fresh planner, timed for a few sampled ranks (0, the middle one, the last
  one) of each world size -- planning every rank of a 16,384-rank world would only repeat them. All
  world sizes, contenders and ranks are interleaved in each round, so the ratios (ours / DCP, and a
  world size / the smallest) are taken side by side; the tables give medians over rounds and ranks.
  Save: ``ParallelSavePlanner`` vs ``DefaultSavePlanner`` on meta tensors (planning needs shapes only);
  also ours "reused": a planner kept from a save of the same structure (its per-instance plan cache,
  ``cache_scope="global"``), and ours "kept": as the API keeps one (``cache_scope="local"``: the rank's
  own local plan memoised, sent in full; what ``save_checkpoint`` pays from its second save on).
  Load: ``ParallelLoadPlanner`` vs ``DefaultLoadPlanner`` into real CPU tensors (ours refuses meta
  destinations), against a checkpoint saved at TP=2, DP=1 by each planner -- a DP-replicated state's
  chunks and metadata do not depend on the DP degree, so the same metadata serves every world.
* Coordinator (every rank's local plan, pickled as ``gather_object`` pickles it, then the global plan):
  bytes gathered, global-plan time, the second save's gathered bytes (per-instance plan cache) and the
  metadata size -- for world sizes up to ``--coordinator-max`` (ours, default 4096) and
  ``--dcp-coordinator-max`` (DCP, default 1024): planning every rank of a larger world in one process
  takes minutes (DCP at 1024 ranks: ~2.5 min and ~90 MiB of gathered plans per save).

DCP's save planner would *lose data* on these plain same-name TP shards; it is here for its cost.

    python benchmarks/bench_planning.py [--quick] [--out benchmarks/out/planning.json] [--layers 24]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from sim import MemoryStore, MemoryWriter, reset_dcp_caches, sim_save  # noqa: E402

from smpckpt import ParallelLayout, ShardSpec  # noqa: E402
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner  # noqa: E402

SPECS = {
    "model.layers.*.qkv.weight": ShardSpec(0),
    "model.layers.*.proj.weight": ShardSpec(1),
    "model.layers.*.fc1.weight": ShardSpec(0),
    "model.layers.*.fc2.weight": ShardSpec(1),
}
WORLDS = [2, 8, 64, 512, 1024, 4096, 16384]
QUICK_WORLDS = [2, 8, 64]
WHO = ("smpckpt", "dcp")
KEPT = ("smpckpt_reused", "smpckpt_kept")  # ours, kept from a save of the same structure (see _save_case)


def state(layers: int, tp: int, device: str = "meta") -> dict:
    # Meta tensors by default: save planning needs shapes only, so large worlds fit in memory.
    def t(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape, device=device)

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


# -- coordinator: every rank's local plan, then the global plan ------------------------------------------
def plan(planners: list, sd: dict) -> tuple[int, float, int]:
    local = []
    for rank, p in enumerate(planners):
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


def coordinator_rows(worlds: list[int], caps: dict[str, int], layers: int, tp: int) -> list[dict]:
    rows = []
    print(f"\ncoordinator (every rank planned), TP={tp}")
    print(
        f"{'world':>6} {'who':>8} {'gathered KiB':>13} {'global plan s':>14} {'2nd save KiB':>13} {'metadata KiB':>13}"
    )
    sd = state(layers, tp)  # one state dict object for every rank: the planners only read it
    for world in worlds:
        layout = ParallelLayout(tp=tp, dp=world // tp)
        for who in (w for w in WHO if world <= caps[w]):
            reset_dcp_caches()
            start = time.perf_counter()
            if who == "smpckpt":
                planners: list = [ParallelSavePlanner(layout, SPECS, rank=r) for r in range(world)]
            else:
                planners = [DefaultSavePlanner(enable_plan_caching=False) for _ in range(world)]
            gathered, elapsed, md_bytes = plan(planners, sd)
            again, _, _ = plan(planners, sd)  # same structure: our per-instance cache sends almost nothing
            total = time.perf_counter() - start
            del planners
            gc.collect()
            rows.append(
                {
                    "world": world,
                    "who": who,
                    "gathered_bytes": gathered,
                    "global_plan_s": elapsed,
                    "second_save_gathered_bytes": again,
                    "metadata_bytes": md_bytes,
                    "whole_world_s": total,
                }
            )
            print(
                f"{world:>6} {who:>8} {gathered / 1024:>13.1f} {elapsed:>14.4f} {again / 1024:>13.1f} "
                f"{md_bytes / 1024:>13.1f}   ({total:.1f} s for the whole world, both saves)"
            )
    return rows


# -- coordinator with pipeline stages: the cross-stage piece check's gathered bytes --------------------------
STAGE_SPECS = {
    **SPECS,
    # ZeRO-style optimizer state: each TP shard split again over DP (the keys the cross-stage check compares)
    "optim.state.layers.*.qkv.weight.*": (ShardSpec(0), ShardSpec(0, axis="dp")),
    "optim.state.layers.*.fc1.weight.*": (ShardSpec(0), ShardSpec(0, axis="dp")),
    "optim.state.layers.*.proj.weight.*": (ShardSpec(1), ShardSpec(0, axis="dp")),
    "optim.state.layers.*.fc2.weight.*": (ShardSpec(1), ShardSpec(0, axis="dp")),
    "optim.state.layers.*.ln.*": ShardSpec(0, axis="dp"),
}


def stage_state(layers: int, tp: int, pp: int, stage: int, renumbered: bool) -> dict:
    """Stage ``stage``'s state on real CPU tensors (the value check samples values): its layers under
    stage-local names (``renumbered``, as with ``pp_layers``) or under their global names."""
    base = state(layers // pp, tp, "cpu")
    if renumbered:
        return base
    first = stage * (layers // pp)

    def rename(key: str) -> str:
        head, _, rest = key.partition("layers.")
        i, _, tail = rest.partition(".")
        return f"{head}layers.{int(i) + first}.{tail}"

    return {part: {rename(k): v for k, v in sub.items()} for part, sub in base.items()}


def stage_rows(worlds: list[int], layers: int, tp: int, pp: int) -> list[dict]:
    """Gathered bytes of a fresh save with ``pp`` pipeline stages and ZeRO-split optimizer state, with and
    without the partition recorded (``pp_layers``): without it every non-empty DP piece goes into the
    plan (12 bytes each) for the cross-stage value check; with it the renumbered layer keys are each
    stage's own and none is sent."""
    rows = []
    print(f"\ncoordinator with pipeline stages (TP={tp}, PP={pp}, ZeRO-split optimizer state, real CPU tensors)")
    print(f"{'world':>6} {'pp_layers':>9} {'gathered KiB':>13} {'stage_values KiB':>17} {'global plan s':>14}")
    for world in worlds:
        for renumbered in (True, False):
            dp = world // (tp * pp)
            layout = ParallelLayout(tp=tp, dp=dp, pp=pp, pp_layers=(layers // pp,) * pp if renumbered else None)
            sds = [stage_state(layers, tp, pp, s, renumbered) for s in range(pp)]
            reset_dcp_caches()
            planners = [ParallelSavePlanner(layout, STAGE_SPECS, rank=r) for r in range(world)]
            local = []
            for rank, p in enumerate(planners):
                p.set_up_planner(state_dict=sds[layout.coords(rank).pp], storage_meta=None, is_coordinator=rank == 0)
                local.append(p.create_local_plan())
            sent = sum(len(lp.planner_data["stage_values"] or b"") for lp in local)
            gathered = sum(len(pickle.dumps(lp)) for lp in local)
            start = time.perf_counter()
            planners[0].create_global_plan(local)
            elapsed = time.perf_counter() - start
            del planners, local
            gc.collect()
            rows.append(
                {
                    "world": world,
                    "pp": pp,
                    "pp_layers": renumbered,
                    "gathered_bytes": gathered,
                    "stage_values_bytes": sent,
                    "global_plan_s": elapsed,
                }
            )
            print(
                f"{world:>6} {'yes' if renumbered else 'no':>9} {gathered / 1024:>13.1f} {sent / 1024:>17.1f} "
                f"{elapsed:>14.4f}"
            )
    return rows


# -- local planning: sampled ranks, interleaved ------------------------------------------------------------
def saved_metadata(layers: int, tp: int) -> dict[str, Metadata]:
    """The checkpoint each load planner reads: saved at TP=tp, DP=1 by that family's own save planner."""
    layout = ParallelLayout(tp=tp)
    sds = [state(layers, tp, "cpu") for _ in range(tp)]
    out = {}
    for who in WHO:
        reset_dcp_caches()
        if who == "smpckpt":
            planners: list = [ParallelSavePlanner(layout, SPECS, rank=r) for r in range(tp)]
        else:
            planners = [DefaultSavePlanner(enable_plan_caching=False) for _ in range(tp)]
        store = MemoryStore()
        out[who] = sim_save(sds, planners, [MemoryWriter(store) for _ in range(tp)])
    return out


def sampled_ranks(world: int) -> list[int]:
    return sorted({0, world // 2, world - 1})


def _timed(setup: Callable[[], Any], run: Callable[[Any], float]) -> tuple[float, float]:
    """(set_up_planner + create_local_plan, create_local_plan alone) in seconds, for a fresh planner."""
    planner = setup()  # building the planner object is not planning; only the two calls are timed
    gc.disable()  # no collector pause inside a timer (a full collection costs ~0.1 s here: once a round)
    try:
        start = time.perf_counter()
        set_up_end = run(planner)
        end = time.perf_counter()
        return end - start, end - set_up_end
    finally:
        gc.enable()


def _save_case(who: str, layout: ParallelLayout, rank: int, sd: dict) -> tuple[Callable, Callable]:
    def setup() -> Any:
        if who == "dcp":
            return DefaultSavePlanner(enable_plan_caching=False)
        planner = ParallelSavePlanner(
            layout, SPECS, rank=rank, cache_scope="local" if who == "smpckpt_kept" else "global"
        )
        if who in KEPT:  # a planner kept from the last save: its per-instance plan cache
            planner.set_up_planner(state_dict=sd, storage_meta=None, is_coordinator=rank == 0)
            planner.finish_plan(planner.create_local_plan())
            planner.release_state()
        return planner

    def run(p: Any) -> float:
        p.set_up_planner(state_dict=sd, storage_meta=None, is_coordinator=rank == 0)
        set_up_end = time.perf_counter()
        p.create_local_plan()
        return set_up_end

    return setup, run


def _load_case(who: str, layout: ParallelLayout, rank: int, sd: dict, md: Metadata) -> tuple[Callable, Callable]:
    def setup() -> Any:
        if who == "smpckpt":
            return ParallelLoadPlanner(layout, SPECS, rank=rank)
        return DefaultLoadPlanner()

    def run(p: Any) -> float:
        p.set_up_planner(sd, md, rank == 0)
        set_up_end = time.perf_counter()
        p.create_local_plan()
        return set_up_end

    return setup, run


def local_rows(worlds: list[int], layers: int, tp: int, rounds: int, load: bool) -> list[dict]:
    save_sd = state(layers, tp)
    load_sd = state(layers, tp, "cpu")
    metadata = saved_metadata(layers, tp) if load else {}
    phases = ("save", "load") if load else ("save",)
    samples: dict[tuple[str, int, str, int], list[tuple[float, float]]] = {}
    cases = []
    for world in worlds:
        layout = ParallelLayout(tp=tp, dp=world // tp)
        for rank in sampled_ranks(world):
            for phase in phases:
                for who in (*WHO, *KEPT) if phase == "save" else WHO:
                    if phase == "save":
                        case = _save_case(who, layout, rank, save_sd)
                    else:
                        case = _load_case(who, layout, rank, load_sd, metadata[who])
                    cases.append(((phase, world, who, rank), case))
    for setup, run in (c for _, c in cases):  # warm-up: imports, regex caches, allocator
        _timed(setup, run)
    for i in range(rounds):
        gc.collect()
        # The first planning after a full collection runs slower (fresh arenas: up to ~0.3 ms here), and
        # the cases in a fixed order would hand that to one contender at the smallest world: an untimed
        # case absorbs it, and every other round runs the cases backwards so each pair swaps order.
        _timed(*cases[-1][1])
        for key, (setup, run) in cases if i % 2 == 0 else reversed(cases):
            samples.setdefault(key, []).append(_timed(setup, run))
    return _summarise(samples, worlds, phases, rounds)


def _summarise(samples: dict, worlds: list[int], phases: tuple[str, ...], rounds: int) -> list[dict]:
    rows = []
    smallest = worlds[0]
    for phase in phases:
        base = [  # ours at the smallest world, per round: the median of its sampled ranks
            statistics.median(samples[(phase, smallest, "smpckpt", r)][i][0] for r in sampled_ranks(smallest))
            for i in range(rounds)
        ]
        for world in worlds:
            ranks = sampled_ranks(world)
            ours = [t for r in ranks for t in samples[(phase, world, "smpckpt", r)]]
            dcp = [t for r in ranks for t in samples[(phase, world, "dcp", r)]]
            # ratios per round and rank, of measurements taken side by side; then their median
            vs_dcp = [o[0] / d[0] for o, d in zip(ours, dcp)]
            vs_small = [t[0] / base[i] for r in ranks for i, t in enumerate(samples[(phase, world, "smpckpt", r)])]
            rows.append(
                {
                    "phase": phase,
                    "world": world,
                    "ranks": ranks,
                    "rounds": rounds,
                    "smpckpt_ms": statistics.median(t for t, _ in ours) * 1e3,
                    "dcp_ms": statistics.median(t for t, _ in dcp) * 1e3,
                    "smpckpt_local_plan_ms": statistics.median(p for _, p in ours) * 1e3,
                    "dcp_local_plan_ms": statistics.median(p for _, p in dcp) * 1e3,
                    "smpckpt_slowest_rank_ms": max(
                        statistics.median(t for t, _ in samples[(phase, world, "smpckpt", r)]) for r in ranks
                    )
                    * 1e3,
                    "ratio_vs_dcp": statistics.median(vs_dcp),
                    **_reused(samples, phase, world, ranks),
                    "ratio_vs_smallest_world": statistics.median(vs_small),
                }
            )
    return rows


def _reused(samples: dict, phase: str, world: int, ranks: list[int]) -> dict:
    out = {}
    dcp = [t for r in ranks for t in samples[(phase, world, "dcp", r)]]
    for who in KEPT:
        if (phase, world, who, ranks[0]) not in samples:
            continue
        mine = [t for r in ranks for t in samples[(phase, world, who, r)]]
        name = who.removeprefix("smpckpt_")
        out[f"{who}_ms"] = statistics.median(t for t, _ in mine) * 1e3
        out[f"{name}_ratio_vs_dcp"] = statistics.median(o[0] / d[0] for o, d in zip(mine, dcp))
    return out


def print_local(rows: list[dict], tp: int) -> None:
    print(f"\nlocal planning per rank, TP={tp}: medians over rounds x sampled ranks (ratios: of side-by-side pairs)")
    print(
        f"{'phase':>5} {'world':>6} {'ours ms':>8} {'DCP ms':>8} {'ours/DCP':>9} "
        f"{'ours/ours@' + str(rows[0]['world']):>12} {'slowest rank':>13} {'ours plan':>10} {'DCP plan':>9} "
        f"{'reused/DCP':>11} {'kept/DCP':>9}"
    )
    for r in rows:
        print(
            f"{r['phase']:>5} {r['world']:>6} {r['smpckpt_ms']:>8.2f} {r['dcp_ms']:>8.2f} {r['ratio_vs_dcp']:>9.2f} "
            f"{r['ratio_vs_smallest_world']:>12.2f} {r['smpckpt_slowest_rank_ms']:>13.2f} "
            f"{r['smpckpt_local_plan_ms']:>10.2f} {r['dcp_local_plan_ms']:>9.2f} "
            f"{r.get('reused_ratio_vs_dcp', float('nan')):>11.2f} {r.get('kept_ratio_vs_dcp', float('nan')):>9.2f}"
        )
    print(
        "(ms = set_up_planner + create_local_plan of a fresh planner; 'plan' = create_local_plan alone; "
        "'reused' = ours kept from a save of the same structure, its plan cache hit; 'kept' = the same with "
        "cache_scope='local', as save_checkpoint keeps its planner)"
    )


def run(layers: int, tp: int, dps: list[int], log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """(``bench.py``) The coordinator rows at data-parallel degrees ``dps``, every planner."""
    worlds = [tp * dp for dp in dps]
    log(f"planning: coordinator rows at worlds {worlds}")
    return coordinator_rows(worlds, dict.fromkeys(WHO, max(worlds)), layers, tp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small worlds and model, a few seconds")
    ap.add_argument("--layers", type=int, default=None, help="transformer layers (default 24, quick 4)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--worlds", type=int, nargs="+", default=None, help=f"world sizes (default {WORLDS})")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds of local planning (default 15, quick 3)")
    ap.add_argument(
        "--coordinator-max", type=int, default=None, help="largest world planned in full, ours (default 4096, quick 64)"
    )
    ap.add_argument(
        "--dcp-coordinator-max", type=int, default=None, help="the same for DCP's planner (default 1024, quick 64)"
    )
    ap.add_argument("--no-load", action="store_true", help="skip the load planners")
    ap.add_argument("--pp", type=int, default=4, help="pipeline stages of the stage case (default 4; 0 skips it)")
    ap.add_argument(
        "--stage-max", type=int, default=None, help="largest world of the stage case (default 4096, quick 64)"
    )
    ap.add_argument("--out", default="benchmarks/out/planning.json")
    args = ap.parse_args()
    layers = args.layers if args.layers is not None else (4 if args.quick else 24)
    worlds = args.worlds or (QUICK_WORLDS if args.quick else WORLDS)
    rounds = args.rounds if args.rounds is not None else (3 if args.quick else 15)
    caps = {
        "smpckpt": args.coordinator_max if args.coordinator_max is not None else (64 if args.quick else 4096),
        "dcp": args.dcp_coordinator_max if args.dcp_coordinator_max is not None else (64 if args.quick else 1024),
    }
    for world in worlds:
        if world % args.tp:
            ap.error(f"world {world} is not a multiple of tp={args.tp}")
    started = datetime.now(timezone.utc)
    t0 = time.perf_counter()
    local = local_rows(worlds, layers, args.tp, rounds, load=not args.no_load)
    print_local(local, args.tp)
    coordinator = coordinator_rows([w for w in worlds if w <= max(caps.values())], caps, layers, args.tp)
    stage_max = args.stage_max if args.stage_max is not None else (64 if args.quick else 4096)
    staged = (
        stage_rows([w for w in worlds if w <= stage_max and w % (args.tp * args.pp) == 0], layers, args.tp, args.pp)
        if args.pp
        else []
    )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "started_utc": started.isoformat(timespec="seconds"),
                "elapsed_s": time.perf_counter() - t0,
                "command": " ".join(sys.argv),
                "machine": platform.platform(),
                "processor": platform.processor(),
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "layers": layers,
                "tp": args.tp,
                "local": local,
                "coordinator_max": caps,
                "rows": coordinator,
                "stage_rows": staged,
            },
            f,
            indent=1,
        )
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()

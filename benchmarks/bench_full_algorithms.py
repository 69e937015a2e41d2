"""Issue 44: the two full-export algorithms side by side on POSIX, same state, same run.

* ``pwrite``: every rank ``pwrite``s its own boxes in place into files the coordinator created
  (column shards with short rows swapped into row blocks first) -- the POSIX default.
* ``gather``: gather-to-owner, the object-store algorithm -- each file streamed front to back by its
  owner rank, which receives the other ranks' boxes over the process group. Forced on POSIX by this
  script alone (:func:`force_gather` patches the coordinator's planning in the rank processes; the
  package has no such option), and checked: every rank counts its ``gather_rank`` calls.

For each storage folder (``--dirs``: local disk, ``/dev/shm``), world size (``--worlds``: gloo ranks on
127.0.0.1, ``tp = world``) and sharding (``--shapes``): ``row`` = every matrix split on dim 0 (each
rank's box is one run), ``col`` = every matrix split on dim 1 (each rank's box one short run per row:
4 * 1024 / tp bytes for the ``[*, 1024]`` matrices at the default size). The ranks are spawned once per case; after one warm-up round (both algorithms, the
artifacts checked: the reference ``safetensors`` reader equals the global tensors, and the two
algorithms' ``.safetensors`` files are byte-identical), every round saves with both algorithms, the
order alternating round by round (A B, B A, ...), each to a fresh folder, timed to durable (fsync inside
the timer, barrier to barrier: the slowest rank counts). Reported per case: median seconds, GB/s, the
median (min..max) of the per-round ratio gather time / pwrite time (> 1: gather slower), the worst
rank's extra RSS (VmHWM - VmRSS around the save), and the 1-minute load average before and after the
case (the machine may be shared: trust the per-round ratios more than the times).

    python benchmarks/bench_full_algorithms.py                  # 512 MiB, worlds 1 2 4, disk + /dev/shm
    python benchmarks/bench_full_algorithms.py --quick          # 32 MiB smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import filecmp
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _model import TDef, check_safetensors, global_tensor, local_piece, model_defs
from _rss import peak, reset_peak
from bench_full import _gather, _spread, spawn_ranks  # the ranks' bootstrap, as bench_full's

from smpckpt import ShardSpec
from smpckpt.model.layout import ParallelLayout
from smpckpt.planners import ParallelSavePlanner
from smpckpt.storage import FullArtifactWriter, FullOptions
from smpckpt.storage.full import _commit, writer

warnings.filterwarnings("ignore")

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20
ALGOS = ("pwrite", "gather")


def case_defs(hidden: int, layers: int, vocab: int, shape: str) -> list[TDef]:
    """The GPT-like state of ``_model``, every matrix split on dim 0 (``row``) or dim 1 (``col``)."""
    return [d if d.kind == "repl" else dataclasses.replace(d, kind=shape) for d in model_defs(hidden, layers, vocab)]


def case_specs(defs: list[TDef], shape: str) -> dict[str, ShardSpec]:
    dim = 0 if shape == "row" else 1
    return {f"model.{d.key}": ShardSpec(dim) for d in defs if d.kind != "repl"}


_PLAN, _CREATE, _GATHER = _commit.plan_artifact, _commit.create_files, writer.gather_rank
CALLS = {"gather_rank": 0}


def force_gather(on: bool) -> None:
    """(benchmark only) Make the coordinator lay a POSIX save out for gather-to-owner (``gather=True``:
    each rank then gets the files and every box, and ``FullArtifactWriter`` streams each file by its
    owner into the staging folder) and create no files there (the owners' sinks create them, only if
    absent); ``on=False`` restores the package's own functions."""

    def plan(*args: Any, **kwargs: Any) -> Any:
        return _PLAN(*args, **{**kwargs, "gather": True})

    _commit.plan_artifact = plan if on else _PLAN  # type: ignore[assignment]
    _commit.create_files = (lambda *a, **k: None) if on else _CREATE  # type: ignore[assignment]


def _counted_gather(*args: Any, **kwargs: Any) -> Any:
    CALLS["gather_rank"] += 1
    return _GATHER(*args, **kwargs)


def _run_rank(rank: int, cfg: dict[str, Any]) -> None:
    world = cfg["world"]
    layout = ParallelLayout(tp=world, dp=1)
    defs = case_defs(cfg["hidden"], cfg["layers"], cfg["vocab"], cfg["shape"])
    specs = case_specs(defs, cfg["shape"])
    mine = {d.key: local_piece(d, global_tensor(j, d), world, rank) for j, d in enumerate(defs)}
    writer.gather_rank = _counted_gather  # type: ignore[assignment]
    # gather-to-owner swaps nothing: no swap planned for it (pwrite keeps the default)
    opts = {
        "pwrite": FullOptions(max_shard_size=cfg["max_shard_size"]),
        "gather": FullOptions(max_shard_size=cfg["max_shard_size"], row_swap_below=0),
    }
    rec: dict[str, dict[str, list[Any]]] = {a: {"s": [], "extra_rss": []} for a in ALGOS}
    checks: dict[str, Any] = {}
    for r in range(cfg["rounds"] + 1):  # round 0: warm-up, checked, not counted
        order = list(ALGOS) if r % 2 == 0 else list(reversed(ALGOS))
        paths: dict[str, str] = {}
        if rank == 0:
            for a in order:
                paths[a] = tempfile.mkdtemp(prefix=f"r{r}-{a}-", dir=cfg["base"])
                os.rmdir(paths[a])  # the writer creates it
        paths = _gather(paths)[0]
        line = []
        for a in order:
            force_gather(a == "gather")  # only the coordinator (rank 0) plans; every rank alike
            calls = CALLS["gather_rank"]
            dist.barrier()
            base = reset_peak()
            t0 = time.perf_counter()
            planner = ParallelSavePlanner(layout, specs, rank=rank, enable_plan_caching=False)
            dcp.save({"model": mine}, storage_writer=FullArtifactWriter(paths[a], full=opts[a]), planner=planner)
            hwm = peak()
            dist.barrier()
            elapsed = time.perf_counter() - t0
            if CALLS["gather_rank"] - calls != (a == "gather"):
                raise RuntimeError(f"rank {rank}: the {a} save did not run {a} (gather_rank calls: {CALLS})")
            rss = _gather(hwm - base)
            if r:
                rec[a]["s"].append(elapsed)
                rec[a]["extra_rss"].append(max(rss))
            line.append(f"{a} {elapsed:5.2f}s")
        force_gather(False)
        if rank == 0:
            if r == 0:
                checks = {a: check_safetensors(paths[a], defs) for a in ALGOS}
                names = sorted(n for n in os.listdir(paths["pwrite"]) if n.endswith(".safetensors"))
                same = names == sorted(n for n in os.listdir(paths["gather"]) if n.endswith(".safetensors"))
                same = same and all(
                    filecmp.cmp(os.path.join(paths["pwrite"], n), os.path.join(paths["gather"], n), shallow=False)
                    for n in names
                )
                checks["byte_identical"] = same
                if not same or any(not str(checks[a]).startswith(("ok", "skipped")) for a in ALGOS):
                    raise RuntimeError(f"the two algorithms' artifacts differ or are wrong: {checks}")
            for p in paths.values():
                shutil.rmtree(p, ignore_errors=True)
            print(f"    round {r}{' (warm-up)' if not r else ''}: " + ", ".join(line), flush=True)
        dist.barrier()
    if rank == 0:
        with open(cfg["result_file"], "w") as f:
            json.dump({"rec": rec, "checks": checks}, f)


def run_case(cfg: dict[str, Any]) -> dict[str, Any]:
    cfg = {**cfg, "result_file": os.path.join(cfg["base"], "result.json")}
    load_before = os.getloadavg()[0]
    spawn_ranks(_run_rank, cfg, minutes=10)
    load_after = os.getloadavg()[0]
    with open(cfg["result_file"]) as f:
        got = json.load(f)
    rec = got["rec"]
    out: dict[str, Any] = {"load_avg_1m": [load_before, load_after], "checks": got["checks"]}
    for a in ALGOS:
        out[a] = {
            "s": _spread(rec[a]["s"]),
            "GBps": statistics.median(cfg["state_bytes"] / x / 1e9 for x in rec[a]["s"]),
            "extra_rss_max": max(rec[a]["extra_rss"]),
            "raw_s": rec[a]["s"],
        }
    out["gather_over_pwrite_time"] = _spread([g / p for g, p in zip(rec["gather"]["s"], rec["pwrite"]["s"])])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--shapes", nargs="+", default=["row", "col"], choices=["row", "col"])
    ap.add_argument("--dirs", nargs="+", default=[os.path.join(HERE, "out"), "/dev/shm"])
    ap.add_argument("--rounds", type=int, default=6, help="measured rounds per case (after a warm-up)")
    ap.add_argument("--max-shard-size", default=None, help="FullOptions.max_shard_size (default: its own)")
    ap.add_argument("--quick", action="store_true", help="small smoke run (32 MiB, 2 rounds)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/full_algorithms_<ts>.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.rounds = 256, 8, 2
    for w in args.worlds:
        if w < 1 or args.hidden % w or args.vocab % w:
            ap.error(f"world {w} must divide --hidden {args.hidden} and --vocab {args.vocab}")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    defs = model_defs(args.hidden, args.layers, args.vocab)
    state_bytes = sum(4 * torch.Size(d.shape).numel() for d in defs)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or os.path.join(HERE, "results", f"full_algorithms_{stamp}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    print(
        f"{state_bytes / MiB:.0f} MiB fp32 state ({len(defs)} tensors, hidden {args.hidden}, {args.layers} layers, "
        f"vocab {args.vocab}); {args.rounds} rounds per case after a warm-up; load average now "
        f"{os.getloadavg()}",
        flush=True,
    )
    started = time.perf_counter()
    cases = []
    for d in args.dirs:
        os.makedirs(d, exist_ok=True)
        for world in args.worlds:
            for shape in args.shapes:
                base = tempfile.mkdtemp(prefix="bench-full-algos-", dir=d)
                print(f"  {d} world {world} {shape}:", flush=True)
                cfg = {
                    "world": world,
                    "shape": shape,
                    "hidden": args.hidden,
                    "layers": args.layers,
                    "vocab": args.vocab,
                    "rounds": args.rounds,
                    "max_shard_size": args.max_shard_size,
                    "state_bytes": state_bytes,
                    "base": base,
                }
                try:
                    res = run_case(cfg)
                finally:
                    shutil.rmtree(base, ignore_errors=True)
                cases.append({"dir": d, "world": world, "shape": shape} | res)
    hdr = (
        f"{'dir':>22s} {'W':>2s} {'shape':>5s} | {'pwrite s':>8s} {'GB/s':>5s} {'RSS MiB':>7s} | {'gather s':>8s} "
        f"{'GB/s':>5s} {'RSS MiB':>7s} | {'gather/pwrite time':>22s} | load 1m"
    )
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for c in cases:
        p, g, ratio = c["pwrite"], c["gather"], c["gather_over_pwrite_time"]
        print(
            f"{c['dir'][-22:]:>22s} {c['world']:2d} {c['shape']:>5s} | {p['s']['median']:8.3f} {p['GBps']:5.2f} "
            f"{p['extra_rss_max'] / MiB:7.1f} | {g['s']['median']:8.3f} {g['GBps']:5.2f} "
            f"{g['extra_rss_max'] / MiB:7.1f} | {ratio['median']:5.2f} ({ratio['min']:.2f}..{ratio['max']:.2f})     "
            f"| {c['load_avg_1m'][0]:.1f}->{c['load_avg_1m'][1]:.1f}"
        )
    print(
        "\ngather/pwrite time: median (min..max) of per-round ratios; > 1 means gather-to-owner is slower. "
        "RSS: worst rank's extra RSS over the measured rounds (default malloc: may under-report)."
    )
    results = {
        "env": {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        },
        "config": vars(args) | {"state_bytes": state_bytes},
        "cases": cases,
        "elapsed_s": time.perf_counter() - started,
    }
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {out} ({time.perf_counter() - started:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Full (consolidated safetensors) checkpoint mode against partial mode, multi-rank, same state, one run.

W ranks (torch.multiprocessing, gloo on loopback) each hold their TP/DP shards of a GPT-like state
(embedding split on the vocabulary, fused QKV ``[3h, h]`` declared ``ShardSpec(1, view=(3, -1, h))``,
out-proj and MLP down split on dim 1, MLP up split on dim 0, layernorm vectors replicated). Every round
(after one warm-up round) runs, with the two save contenders in rotated order:

* save partial: ``dcp.save`` + ``ParallelSavePlanner`` + ``FsspecStorageWriter(path)``
* save full:    the same with ``FullArtifactWriter(path, full=FullOptions(max_shard_size=...))``
* load (partial / full checkpoint) into the same layout and into another TP degree, with
  ``FsspecStorageReader`` + ``ParallelLoadPlanner``; ``reader.last_read_stats`` summed over ranks.

Saves are timed to durable: the writers fsync data, metadata, manifest and folder inside the timer.
The page cache cannot be dropped here (no root), so loads read from it. Every load is checked
bit-for-bit against the expected shards. Reported: medians over rounds, and the full/partial ratio
as the median (min..max) of per-round ratios.

Peak memory: each rank resets its peak-RSS counter (``echo 5 > /proc/self/clear_refs``, which resets
``VmHWM``) right before an operation, reads ``VmRSS`` as the baseline, and reads ``VmHWM`` after it:
extra RSS = VmHWM - baseline, exact (not sampled), in the same long-lived rank. Memory freed by an
earlier operation and kept by malloc could hide a later peak, so after the timing pass (default
malloc) a memory pass spawns fresh ranks with ``MALLOC_MMAP_THRESHOLD_=1MiB`` (blocks of 1 MiB and
more are mmapped and unmapped on free) and the memory goal is judged on it. That setting slows
allocation-heavy code (a fresh mmap + page faults per buffer), so no time is taken from that pass.

    python benchmarks/bench_full.py                 # ~512 MiB, 2 ranks (tp=2), 5 rounds, local disk
    python benchmarks/bench_full.py --quick         # ~33 MiB smoke run (< 60 s)
    python benchmarks/bench_full.py --world 4       # tp=2 x dp=2 (loads into tp=4); --tp 4 for tp=4
    python benchmarks/bench_full.py --dir /dev/shm  # tmpfs instead of disk
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from _model import check_safetensors, global_tensor, local_piece, model_defs, model_specs
from _rss import peak, reset_peak

from smpckpt.model.layout import ParallelLayout
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter, FullArtifactWriter, FullOptions

warnings.filterwarnings("ignore")

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20
SAVES = ("save partial", "save full")
LOADS = ("load partial same", "load full same", "load partial other", "load full other")
OPS = SAVES + LOADS


def nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


# -- memory --------------------------------------------------------------------------------------


# -- the ranks (bench_full_algorithms spawns its ranks with these too) -----------------------------
def spawn_ranks(run_rank: Callable[[int, dict[str, Any]], None], cfg: dict[str, Any], minutes: int) -> None:
    """``cfg["world"]`` gloo ranks on a free loopback port, each running ``run_rank(rank, cfg)`` with its
    share of the cores; ``minutes``: the process group's timeout."""
    cfg = {**cfg, "port": _free_port()}
    mp.spawn(worker, args=(run_rank, cfg, minutes), nprocs=cfg["world"], join=True)


def worker(rank: int, run_rank: Callable[[int, dict[str, Any]], None], cfg: dict[str, Any], minutes: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(cfg["port"])
    world = cfg["world"]
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=minutes))
    try:
        run_rank(rank, cfg)
    finally:
        dist.destroy_process_group()


def _gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _run_rank(rank: int, cfg: dict[str, Any]) -> None:
    world, h = cfg["world"], cfg["hidden"]
    save_layout = ParallelLayout(tp=cfg["tp"], dp=world // cfg["tp"])
    load_layout = ParallelLayout(tp=cfg["load_tp"], dp=world // cfg["load_tp"])
    specs = model_specs(h)
    defs = model_defs(h, cfg["layers"], cfg["vocab"])
    s_tp, l_tp = save_layout.coords(rank).tp, load_layout.coords(rank).tp
    mine: dict[str, torch.Tensor] = {}
    other: dict[str, torch.Tensor] = {}
    for j, d in enumerate(defs):
        g = global_tensor(j, d)
        mine[d.key] = local_piece(d, g, save_layout.tp, s_tp)
        other[d.key] = local_piece(d, g, load_layout.tp, l_tp)
        del g
    dest_same = {k: torch.empty_like(v) for k, v in mine.items()}
    dest_other = {k: torch.empty_like(v) for k, v in other.items()}
    expect = {"same": mine, "other": other}
    dests = {"same": dest_same, "other": dest_other}
    swap = {} if cfg["row_swap_below"] is None else {"row_swap_below": cfg["row_swap_below"]}
    full_opts = FullOptions(max_shard_size=cfg["max_shard_size"], **swap)
    base = cfg["base"]
    paths = {"partial": "", "full": ""}

    def save(mode: str) -> Callable[[], Any]:
        def run() -> None:
            writer = (
                FullArtifactWriter(paths[mode], full=full_opts) if mode == "full" else FsspecStorageWriter(paths[mode])
            )
            planner = ParallelSavePlanner(save_layout, specs, rank=rank, enable_plan_caching=False)
            dcp.save({"model": mine}, storage_writer=writer, planner=planner)

        return run

    def load(mode: str, which: str) -> Callable[[], Any]:
        def run() -> Any:
            layout = save_layout if which == "same" else load_layout
            reader = FsspecStorageReader(paths[mode])
            planner = ParallelLoadPlanner(layout, specs, rank=rank)
            dcp.load({"model": dests[which]}, storage_reader=reader, planner=planner)
            return reader.last_read_stats

        return run

    ops: dict[str, Callable[[], Any]] = {
        "save partial": save("partial"),
        "save full": save("full"),
        "load partial same": load("partial", "same"),
        "load full same": load("full", "same"),
        "load partial other": load("partial", "other"),
        "load full other": load("full", "other"),
    }
    rec: dict[str, Any] = {op: {"s": [], "extra_rss": [], "read": []} for op in OPS}
    info: dict[str, Any] = {}
    local_bytes = {"same": nbytes(mine), "other": nbytes(other)}
    info["local_bytes"] = _gather(local_bytes)
    info["largest_local_tensor"] = _gather(max(t.numel() * t.element_size() for t in mine.values()))

    for r in range(cfg["rounds"] + 1):  # round 0 is the warm-up
        if rank == 0:
            for mode in paths:
                paths[mode] = tempfile.mkdtemp(prefix=f"r{r}-{mode}-", dir=base)
                os.rmdir(paths[mode])  # the writers create it
        shared = _gather(paths if rank == 0 else None)[0]
        paths.update(shared)
        saves = list(SAVES) if r % 2 == 0 else list(reversed(SAVES))  # no contender always goes first
        loads = list(LOADS) if r % 2 == 0 else [LOADS[1], LOADS[0], LOADS[3], LOADS[2]]
        line = []
        for op in saves + loads:
            which = op.rsplit(" ", 1)[-1]
            if op.startswith("load"):
                for t in dests[which].values():
                    t.fill_(-7.0)
            dist.barrier()
            baseline = reset_peak()
            t0 = time.perf_counter()
            stats = ops[op]()
            hwm = peak()
            dist.barrier()  # the op is done when the slowest rank is done
            elapsed = time.perf_counter() - t0
            if op.startswith("load"):
                bad = [k for k, v in expect[which].items() if not torch.equal(dests[which][k], v)]
                if bad:
                    raise RuntimeError(f"rank {rank}, {op}: loaded values differ for {bad[:3]}")
            per_rank = _gather(
                {
                    "extra_rss": hwm - baseline,
                    "read": (stats.bytes_needed, stats.bytes_read, stats.requests) if stats is not None else None,
                }
            )
            if r:
                rec[op]["s"].append(elapsed)
                rec[op]["extra_rss"].append([p["extra_rss"] for p in per_rank])
                rec[op]["read"].append([p["read"] for p in per_rank])
            line.append(f"{op} {elapsed:5.2f}s")
        if rank == 0:
            if r == 0 and cfg["pass"] == "time":
                info["files"] = {m: _describe(p) for m, p in paths.items()}
                info["safetensors_check"] = check_safetensors(paths["full"], defs)
            for p in paths.values():
                shutil.rmtree(p, ignore_errors=True)
            print(f"  {cfg['pass']} pass, round {r}{' (warm-up)' if not r else ''}: " + ", ".join(line), flush=True)
        dist.barrier()
    if rank == 0:
        with open(cfg["result_file"], "w") as f:
            json.dump({"rec": rec, "info": info}, f)


def _describe(path: str) -> dict[str, Any]:
    files = []
    for root, _dirs, names in os.walk(path):
        for n in names:
            files.append((os.path.relpath(os.path.join(root, n), path), os.path.getsize(os.path.join(root, n))))
    return {"files": len(files), "bytes": sum(s for _, s in files), "largest": sorted(files, key=lambda x: -x[1])[:3]}


# -- driver --------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cmd(args: list[str]) -> str:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarize(rec: dict[str, Any], mem: dict[str, Any] | None, info: dict[str, Any], total: int) -> dict[str, Any]:
    """Times, throughput and read stats from the timing pass; extra RSS from both passes."""
    out: dict[str, Any] = {}
    for op in OPS:
        which = op.rsplit(" ", 1)[-1]
        # bytes delivered: a save writes the global state once; a load fills every rank's tensors
        moved = total if op in SAVES else sum(lb[which] for lb in info["local_bytes"])
        s = rec[op]["s"]
        row: dict[str, Any] = {"s": _spread(s), "GBps": statistics.median(moved / x / 1e9 for x in s), "bytes": moved}
        # per round: the worst rank's extra RSS
        row["extra_rss_time_pass"] = _spread([float(max(x)) for x in rec[op]["extra_rss"]])
        if mem is not None:
            row["extra_rss_memory_pass"] = _spread([float(max(x)) for x in mem[op]["extra_rss"]])
        reads = rec[op]["read"]
        if reads and reads[0][0] is not None:
            needed = [sum(p[0] for p in rnd) for rnd in reads]
            got = [sum(p[1] for p in rnd) for rnd in reads]
            row["read"] = {
                "bytes_needed": needed[-1],
                "bytes_read": got[-1],
                "requests": sum(p[2] for p in reads[-1]),
                "amplification": _spread([g / n if n else 1.0 for g, n in zip(got, needed)]),
                "same_every_round": len(set(needed)) == 1 and len(set(got)) == 1,
            }
        out[op] = row
    pairs = {
        "save": ("save full", "save partial"),
        "load same": ("load full same", "load partial same"),
        "load other": ("load full other", "load partial other"),
    }
    # full/partial throughput = partial time / full time, per round
    out["_ratios"] = {
        name: _spread([p / f for f, p in zip(rec[fo]["s"], rec[po]["s"])]) for name, (fo, po) in pairs.items()
    }
    return out


def _rss(row: dict[str, Any]) -> float:
    """Worst extra RSS of an op: the memory pass when it ran, else the timing pass."""
    return float(row.get("extra_rss_memory_pass", row["extra_rss_time_pass"])["max"])


def print_table(summary: dict[str, Any], largest_local: int, largest_global: int) -> None:
    hdr = (
        f"{'operation':18s} {'median s':>8s} {'min..max s':>13s} {'GB/s':>6s} | {'RSS mem pass':>12s} "
        f"{'RSS time pass':>13s} | {'read MiB':>8s} {'needed MiB':>10s} {'ampl.':>6s}"
    )
    print("\n" + hdr)
    print("-" * len(hdr))
    for op in OPS:
        row = summary[op]
        mem = row.get("extra_rss_memory_pass")
        rd = row.get("read")
        reads = (
            f"{rd['bytes_read'] / MiB:8.1f} {rd['bytes_needed'] / MiB:10.1f} {rd['amplification']['median']:6.3f}"
            if rd
            else f"{'-':>8s} {'-':>10s} {'-':>6s}"
        )
        mem_s = f"{mem['max'] / MiB:.1f}" if mem else "-"
        print(
            f"{op:18s} {row['s']['median']:8.3f} {row['s']['min']:6.3f}..{row['s']['max']:<5.3f} {row['GBps']:6.2f} | "
            f"{mem_s:>12s} {row['extra_rss_time_pass']['max'] / MiB:13.1f} | {reads}"
        )
    print(
        f"\nlargest tensor: {largest_local / MiB:.1f} MiB local shard (in a rank's state dict), "
        f"{largest_global / MiB:.1f} MiB global"
    )
    print("full/partial throughput, median of per-round ratios (min..max):")
    for name, r in summary["_ratios"].items():
        print(f"  {name:10s} {r['median']:5.2f}  ({r['min']:.2f}..{r['max']:.2f})")


def goals(summary: dict[str, Any], largest_local: int, largest_global: int) -> dict[str, Any]:
    ratio = summary["_ratios"]["save"]
    worst_rss = _rss(summary["save full"])
    amp = summary["load full same"]["read"]
    g = {
        "full_vs_partial_save_throughput": {
            "value": ratio["median"],
            "min": ratio["min"],
            "max": ratio["max"],
            "target": ">= 0.7",
            "met": ratio["median"] >= 0.7,
        },
        "full_save_extra_rss": {
            "worst_bytes": worst_rss,
            "x_largest_local_tensor": worst_rss / largest_local,
            "x_largest_global_tensor": worst_rss / largest_global,
            "target": "<= 2x largest tensor",
            "met_vs_local": worst_rss <= 2 * largest_local,
            "met_vs_global": worst_rss <= 2 * largest_global,
        },
        "full_load_same_layout_reads_exactly_needed": {
            "bytes_needed": amp["bytes_needed"],
            "bytes_read": amp["bytes_read"],
            "target": "bytes_read == bytes_needed",
            "met": amp["bytes_read"] == amp["bytes_needed"] and amp["same_every_round"],
        },
    }
    print("\ngoals:")
    print(
        f"  save throughput full/partial: median {ratio['median']:.2f} (min {ratio['min']:.2f}, max "
        f"{ratio['max']:.2f}), target >= 0.7: {'met' if g['full_vs_partial_save_throughput']['met'] else 'MISSED'}"
    )
    r = g["full_save_extra_rss"]
    print(
        f"  full save extra RSS (worst rank, worst round): {worst_rss / MiB:.1f} MiB = "
        f"{r['x_largest_local_tensor']:.2f}x largest local tensor ({largest_local / MiB:.1f} MiB), "
        f"{r['x_largest_global_tensor']:.2f}x largest global tensor ({largest_global / MiB:.1f} MiB); target <= 2x: "
        f"{'met' if r['met_vs_local'] else ('met vs global only' if r['met_vs_global'] else 'MISSED')}"
    )
    print(
        f"  full load, same layout: read {amp['bytes_read']} B for {amp['bytes_needed']} B needed, target "
        f"equal: {'met' if g['full_load_same_layout_reads_exactly_needed']['met'] else 'MISSED'}"
    )
    return g


def run_pass(cfg: dict[str, Any], name: str, rounds: int, mmap_threshold: bool) -> dict[str, Any]:
    """Spawn the ranks for one pass; rank 0's record. ``mmap_threshold``: blocks of 1 MiB and more are
    mmapped and unmapped on free, so a block freed by an earlier op and kept by malloc cannot hide a
    later op's peak (read by glibc at process start, hence a pass of its own)."""
    cfg = {**cfg, "pass": name, "rounds": rounds}
    cfg["result_file"] = os.path.join(cfg["base"], f"result-{name}.json")
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if mmap_threshold:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MiB)
    try:
        spawn_ranks(_run_rank, cfg, minutes=5)
    finally:
        if saved is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    with open(cfg["result_file"]) as f:
        return dict(json.load(f))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--world", type=int, default=2, help="ranks (2 or 4)")
    ap.add_argument("--tp", type=int, default=None, help="save TP degree (default: 2); dp = world / tp")
    ap.add_argument("--load-tp", type=int, default=None, help="TP degree of the 'other' loads (default: derived)")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds of the timing pass (after a warm-up)")
    ap.add_argument("--mem-rounds", type=int, default=1, help="measured rounds of the memory pass (0: skip it)")
    ap.add_argument("--dir", default=os.path.join(HERE, "out"), help="parent of the temp dir (/dev/shm: tmpfs)")
    ap.add_argument(
        "--max-shard-size", default=None, help="FullOptions.max_shard_size (default: its own default, auto)"
    )
    ap.add_argument(
        "--row-swap-below",
        type=int,
        default=None,
        help="FullOptions.row_swap_below in bytes (default: its own default, 256 KiB; 0: write column shards row by row)",
    )
    ap.add_argument("--quick", action="store_true", help="small smoke run (~33 MiB, 2 rounds)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/full_<timestamp>.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.rounds = 256, 8, 2
    tp = args.tp if args.tp is not None else min(2, args.world)
    if tp < 1 or args.world % tp:
        ap.error(f"--tp {tp} must divide --world {args.world}")
    load_tp = args.load_tp
    if load_tp is None:
        load_tp = tp * 2 if args.world % (tp * 2) == 0 else max(1, tp // 2)
    if args.world % load_tp or load_tp == tp:
        ap.error(f"--load-tp {load_tp} must divide --world {args.world} and differ from --tp {tp}")
    for n, what in ((args.hidden, "--hidden"), (args.vocab, "--vocab")):
        if n % max(tp, load_tp):
            ap.error(f"{what} {n} must be divisible by the TP degrees {tp} and {load_tp}")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")

    defs = model_defs(args.hidden, args.layers, args.vocab)
    total = sum(4 * torch.Size(d.shape).numel() for d in defs)
    largest_global = max(4 * torch.Size(d.shape).numel() for d in defs)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or os.path.join(HERE, "results", f"full_{stamp}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    os.makedirs(args.dir, exist_ok=True)
    base = tempfile.mkdtemp(prefix="bench-full-", dir=args.dir)
    cfg = {
        "world": args.world,
        "tp": tp,
        "load_tp": load_tp,
        "hidden": args.hidden,
        "layers": args.layers,
        "vocab": args.vocab,
        "max_shard_size": args.max_shard_size,
        "row_swap_below": args.row_swap_below,
        "base": base,
    }
    env = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "nproc": _cmd(["nproc"]),
        "free_g": _cmd(["free", "-g"]),
        "dir": args.dir,
        "df": _cmd(["df", "-h", args.dir]),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    }
    print(
        f"{total / MiB:.0f} MiB fp32 state ({len(defs)} tensors, hidden {args.hidden}, {args.layers} layers, vocab "
        f"{args.vocab}); {args.world} ranks, save layout tp={tp} dp={args.world // tp}, other loads tp={load_tp} "
        f"dp={args.world // load_tp}; under {base}",
        flush=True,
    )
    print(
        f"timing pass: {args.rounds} rounds after 1 warm-up, default malloc; memory pass: {args.mem_rounds} round(s) "
        "after 1 warm-up, MALLOC_MMAP_THRESHOLD_=1MiB.\nSaves fsync inside the timer; loads read from the page "
        "cache (it cannot be dropped here).",
        flush=True,
    )
    started = time.perf_counter()
    try:
        timing = run_pass(cfg, "time", args.rounds, mmap_threshold=False)
        memory = run_pass(cfg, "memory", args.mem_rounds, mmap_threshold=True) if args.mem_rounds > 0 else None
    finally:
        shutil.rmtree(base, ignore_errors=True)
    info = timing["info"]
    largest_local = max(info["largest_local_tensor"])
    summary = summarize(timing["rec"], memory["rec"] if memory else None, info, total)
    print(f"\nfiles written (warm-up round): {json.dumps(info['files'])}")
    print(f"reference safetensors reader on the full artifact: {info['safetensors_check']}")
    print(
        "\nTimes, GB/s and reads: timing pass. GB/s: saves = global state bytes / wall time to durable (slowest "
        "rank); loads = bytes landed in all ranks' tensors / wall time.\nread/needed: reader.last_read_stats summed "
        "over ranks. RSS (MiB): extra RSS = VmHWM - VmRSS around the op (peak reset via /proc/self/clear_refs), the "
        "worst rank in the worst round;\n'mem pass' runs with MALLOC_MMAP_THRESHOLD_=1MiB (freed buffers return to "
        "the OS, so no reuse hides a peak), 'time pass' with default malloc (may under-report)."
    )
    print_table(summary, largest_local, largest_global)
    g = goals(summary, largest_local, largest_global)
    results = {
        "env": env,
        "config": {k: v for k, v in cfg.items() if k != "base"}
        | {"rounds": args.rounds, "mem_rounds": args.mem_rounds},
        "state_bytes": total,
        "largest_tensor_bytes": {"local": largest_local, "global": largest_global},
        "rss_method": "per op and rank: reset VmHWM (echo 5 > /proc/self/clear_refs), baseline = VmRSS, extra = "
        "VmHWM after the op - baseline; memory pass with MALLOC_MMAP_THRESHOLD_=1MiB, timing pass default malloc",
        "info": info,
        "summary": summary,
        "goals": g,
        "raw": {"time": timing["rec"], "memory": memory["rec"] if memory else None},
        "elapsed_s": time.perf_counter() - started,
    }
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {out} ({time.perf_counter() - started:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

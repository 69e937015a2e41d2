"""How long ``save_checkpoint(..., async_save=True)`` blocks the caller, against a durable synchronous save.

One process, no process group. The model is ``nn.Linear(h, h)`` layers (fp32), by default 16 x 64 MiB
= 1 GiB of parameters (``--quick``: 4 layers = 256 MiB, fewer rounds, < 60 s). No optimizer state
unless ``--optimizer sgd|adam`` (which adds 1x / 2x the parameter bytes). Every round (after one
warm-up round) saves the same state twice to fresh tags, in alternating order:

* sync:  ``save_checkpoint(root, tag, model=m)`` -- returns when data, manifest and ``newest`` are durable
  (``sync_files=True``, the default).
* async: ``save_checkpoint(root, tag, model=m, async_save=True)`` -- *blocking* = call to return (the
  state is staged into reused host buffers); *total* = call until ``future.result()`` returns (durable;
  the caller waits right away, nothing else runs).

The tag folders are deleted after every save, so disk use stays at one checkpoint. The first async save
of the process allocates the staging buffers (page faults over the whole state): it falls in the warm-up
round and is reported on its own; the ratio blocking / sync is taken per measured round (median, min..max).

Memory: before each save, VmHWM is reset (``echo 5 > /proc/self/clear_refs``) and VmRSS read as the
baseline; VmHWM after the save (after ``future.result()`` for async) gives the extra RSS of that save.
"Over model" is VmHWM minus the RSS measured once before any save (model only, no staging buffers), so
for async saves it includes the staging buffers. Default malloc: memory freed by an earlier save and kept
by malloc can hide part of a later peak (large tensors are mmapped, so this concerns small allocations).

With ``torch.cuda.is_available()`` the same is done with the model on the GPU (CUDA tensors staged into
pinned host buffers); otherwise a line says no GPU was available.

Targets: CPU tensors, state >= 256 MiB: async blocking <= 30% of the durable synchronous save;
CUDA tensors: <= 10% (only measured where a GPU exists).

    python benchmarks/bench_async.py                 # 1 GiB, 1 warm-up + 7 rounds, local disk
    python benchmarks/bench_async.py --quick         # 256 MiB, 1 warm-up + 3 rounds (< 60 s)
    python benchmarks/bench_async.py --dir /dev/shm  # tmpfs instead of disk
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
from _rss import peak, reset_peak
from torch import nn

import smpckpt

warnings.filterwarnings("ignore")
logging.getLogger("smpckpt").setLevel(logging.WARNING)

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20
GiB = 1 << 30
TARGETS = {"cpu": 0.30, "cuda": 0.10}


# -- memory ----------------------------------------------------------------------------------------


def _cmd(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"({exc})"


# -- state -----------------------------------------------------------------------------------------
def make_model(size_mb: int, hidden: int, device: str) -> nn.Module:
    per_layer = hidden * hidden * 4
    n = max(1, round(size_mb * MiB / per_layer))
    model = nn.Sequential(*(nn.Linear(hidden, hidden, device=device) for _ in range(n)))
    return model


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer | None:
    if kind == "none":
        return None
    if kind == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # materialise the state (momentum / exp_avg, exp_avg_sq)
    opt.zero_grad(set_to_none=True)
    return opt


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer | None) -> int:
    n = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    if opt is not None:
        for st in opt.state.values():
            n += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
    return n


# -- one save --------------------------------------------------------------------------------------
def save_sync(ckpt: smpckpt.Checkpointer, tag: str, model: nn.Module, opt: Any, rss_model: int) -> dict[str, float]:
    rss0 = reset_peak()
    t0 = time.perf_counter()
    ckpt.save(tag, model, opt)
    t1 = time.perf_counter()
    hwm = peak()
    return {"time_s": t1 - t0, "extra_rss": hwm - rss0, "over_model_rss": hwm - rss_model}


def save_async(ckpt: smpckpt.Checkpointer, tag: str, model: nn.Module, opt: Any, rss_model: int) -> dict[str, float]:
    rss0 = reset_peak()
    t0 = time.perf_counter()
    fut = ckpt.save(tag, model, opt, options=smpckpt.SaveOptions(async_save=True))
    t1 = time.perf_counter()
    hwm_blocking = peak()
    if opt is not None:  # a step right after the save (no gradients: it changes nothing) waits for staging
        opt.step()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    t_step = time.perf_counter()
    assert fut is not None
    fut.result()
    t2 = time.perf_counter()
    hwm = peak()
    return {
        "blocking_s": t1 - t0,
        "step_stall_s": t_step - t1,
        "total_s": t2 - t0,
        "extra_rss_blocking": hwm_blocking - rss0,
        "extra_rss": hwm - rss0,
        "over_model_rss": hwm - rss_model,
        "staging_bytes": ckpt.staging_bytes(),
    }


def remove_tag(root: str, tag: str) -> None:
    shutil.rmtree(os.path.join(root, f"{tag}_partial"), ignore_errors=True)


# -- one case (cpu or cuda) ------------------------------------------------------------------------
def run_case(device: str, args: argparse.Namespace, base: str) -> dict[str, Any]:
    model = make_model(args.size_mb, args.hidden, device)
    opt = make_optimizer(model, args.optimizer)
    size = state_bytes(model, opt)
    root = tempfile.mkdtemp(prefix=f"bench-async-{device}-", dir=base)
    # the first async save of this case allocates its own buffers (its Checkpointer's)
    ckpt = smpckpt.Checkpointer(root, async_options=smpckpt.AsyncOptions(overlap_staging=not args.no_overlap))
    print(
        f"\n[{device}] {size / MiB:.0f} MiB state ({len(model)} x Linear({args.hidden}, {args.hidden}), optimizer "
        f"{args.optimizer}); under {root}",
        flush=True,
    )
    rss_model = reset_peak()
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds + 1):  # round 0 is the warm-up (holds the first async save)
        order = ["sync", "async"] if r % 2 == 0 else ["async", "sync"]
        rec: dict[str, Any] = {"round": r, "order": order}
        for kind in order:
            tag = f"r{r}-{kind}"
            fn = save_sync if kind == "sync" else save_async
            rec[kind] = fn(ckpt, tag, model, opt, rss_model)
            remove_tag(root, tag)
        rec["ratio"] = rec["async"]["blocking_s"] / rec["sync"]["time_s"]
        s, a = rec["sync"], rec["async"]
        print(
            f"  round {r}{' (warm-up)' if not r else '          '} {'->'.join(order):10s} sync {s['time_s']:6.2f}s | "
            f"async blocking {a['blocking_s']:6.3f}s total {a['total_s']:6.2f}s | blocking/sync {rec['ratio']:6.1%}",
            flush=True,
        )
        rounds.append(rec)
    shutil.rmtree(root, ignore_errors=True)
    staged = ckpt.staging_bytes()
    ckpt.close()
    del model, opt, ckpt
    return {"device": device, "state_bytes": size, "staging_bytes": staged, "rss_model": rss_model, "rounds": rounds}


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def summarize(case: dict[str, Any]) -> dict[str, Any]:
    warm, meas = case["rounds"][0], case["rounds"][1:]
    size = case["state_bytes"]
    ratios = [r["ratio"] for r in meas]
    sync = [r["sync"]["time_s"] for r in meas]
    block = [r["async"]["blocking_s"] for r in meas]
    stall = [r["async"]["step_stall_s"] for r in meas]
    total = [r["async"]["total_s"] for r in meas]
    target = TARGETS["cuda" if case["device"].startswith("cuda") else "cpu"]
    ratio = _med(ratios)
    return {
        "device": case["device"],
        "state_bytes": size,
        "staging_bytes": case["staging_bytes"],
        "sync_s": _med(sync),
        "sync_GBps": size / _med(sync) / 1e9,
        "blocking_s": _med(block),
        "blocking_min_max_s": [min(block), max(block)],
        "step_stall_s": _med(stall),
        "staging_GBps": size / _med(block) / 1e9,
        "total_s": _med(total),
        "total_over_sync": _med([t / s for t, s in zip(total, sync)]),
        "ratio_median": ratio,
        "ratio_min_max": [min(ratios), max(ratios)],
        "first_blocking_s": warm["async"]["blocking_s"],
        "first_ratio": warm["ratio"],
        "first_extra_rss": warm["async"]["extra_rss"],
        "steady_async_extra_rss": max(r["async"]["extra_rss"] for r in meas),
        "steady_async_over_model_rss": max(r["async"]["over_model_rss"] for r in meas),
        "sync_extra_rss": max(r["sync"]["extra_rss"] for r in case["rounds"]),
        "target_ratio": target,
        "met": ratio <= target if size >= 256 * MiB else None,
    }


def print_table(s: dict[str, Any]) -> None:
    size = s["state_bytes"]
    lo, hi = s["ratio_min_max"]
    blo, bhi = s["blocking_min_max_s"]
    rows = [
        (
            "state / staging buffers",
            f"{size / MiB:.0f} MiB / {s['staging_bytes'] / MiB:.0f} MiB ({s['staging_bytes'] / size:.3f}x)",
        ),
        ("sync save, durable", f"{s['sync_s']:.2f} s ({s['sync_GBps']:.2f} GB/s)"),
        ("async blocking (steady)", f"{s['blocking_s']:.3f} s ({blo:.3f}..{bhi:.3f}; {s['staging_GBps']:.2f} GB/s)"),
        ("optimizer step right after (stall)", f"{s['step_stall_s']:.3f} s (waits for staging still unfinished)"),
        ("async blocking (first save)", f"{s['first_blocking_s']:.3f} s ({s['first_ratio']:.1%} of its sync save)"),
        ("async total (to durable)", f"{s['total_s']:.2f} s ({s['total_over_sync']:.2f}x sync)"),
        ("blocking / sync", f"{s['ratio_median']:.1%} median ({lo:.1%}..{hi:.1%}); target <= {s['target_ratio']:.0%}"),
        ("extra RSS, sync save", f"{s['sync_extra_rss'] / MiB:.0f} MiB ({s['sync_extra_rss'] / size:.2f}x state)"),
        ("extra RSS, first async save", f"{s['first_extra_rss'] / MiB:.0f} MiB ({s['first_extra_rss'] / size:.2f}x)"),
        (
            "extra RSS, later async saves",
            f"{s['steady_async_extra_rss'] / MiB:.0f} MiB ({s['steady_async_extra_rss'] / size:.2f}x)",
        ),
        (
            "peak RSS over model, async",
            f"{s['steady_async_over_model_rss'] / MiB:.0f} MiB "
            f"({s['steady_async_over_model_rss'] / size:.2f}x state; staging included)",
        ),
    ]
    print(f"\n{s['device'].upper()} tensors")
    for name, val in rows:
        print(f"  {name:30s} {val}")


def verdict(s: dict[str, Any]) -> str:
    if s["met"] is None:
        return "not judged (state < 256 MiB)"
    return "MET" if s["met"] else "NOT MET"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=1024, help="parameter bytes (MiB) of the model")
    ap.add_argument("--hidden", type=int, default=4096, help="Linear(h, h) layers: h*h*4 bytes each (64 MiB)")
    ap.add_argument("--optimizer", choices=["none", "sgd", "adam"], default="none")
    ap.add_argument("--rounds", type=int, default=7, help="measured rounds (after one warm-up round)")
    ap.add_argument("--dir", default=os.path.join(HERE, "out"), help="parent of the temp dir (/dev/shm: tmpfs)")
    ap.add_argument("--no-cuda", action="store_true", help="skip the CUDA case even when a GPU exists")
    ap.add_argument(
        "--no-overlap", action="store_true", help="AsyncOptions(overlap_staging=False): stage all before returning"
    )
    ap.add_argument("--quick", action="store_true", help="256 MiB, 3 rounds (< 60 s)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/async_<timestamp>.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.size_mb, args.rounds = 256, 3
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or os.path.join(HERE, "results", f"async_{stamp}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    os.makedirs(args.dir, exist_ok=True)
    base = tempfile.mkdtemp(prefix="bench-async-", dir=args.dir)
    env = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "nproc": _cmd(["nproc"]),
        "free_g": _cmd(["free", "-g"]),
        "dir": args.dir,
        "overlap_staging": not args.no_overlap,
        "df": _cmd(["df", "-h", args.dir]),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    }
    print(
        f"1 process, {args.rounds} rounds after 1 warm-up, sync/async order alternating; saves durable "
        f"(sync_files=True); under {base}",
        flush=True,
    )
    started = time.perf_counter()
    cases: list[dict[str, Any]] = []
    try:
        cases.append(run_case("cpu", args, base))
        if torch.cuda.is_available() and not args.no_cuda:
            cases.append(run_case("cuda", args, base))
    finally:
        smpckpt.wait_for_saves(raise_errors=False)
        shutil.rmtree(base, ignore_errors=True)
    summaries = [summarize(c) for c in cases]
    for s in summaries:
        print_table(s)
    print("\nGoals")
    for s in summaries:
        name = "CPU tensors" if s["device"] == "cpu" else "CUDA tensors (pinned staging)"
        print(
            f"  {name}: async blocking <= {s['target_ratio']:.0%} of the durable sync save: "
            f"{s['ratio_median']:.1%} median ({s['ratio_min_max'][0]:.1%}..{s['ratio_min_max'][1]:.1%}) -> "
            f"{verdict(s)}"
        )
    if not torch.cuda.is_available():
        print("  CUDA tensors: no GPU available (torch.cuda.is_available() is False) -> not measured")
    results = {
        "env": env,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "rss_method": "per save: reset VmHWM (echo 5 > /proc/self/clear_refs), baseline = VmRSS, extra = VmHWM "
        "after the save (async: after future.result()) - baseline; over_model = VmHWM - VmRSS before any save",
        "summary": summaries,
        "raw": cases,
        "elapsed_s": time.perf_counter() - started,
    }
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {out} ({time.perf_counter() - started:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

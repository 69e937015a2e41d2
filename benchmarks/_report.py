"""Summary, goals, printed tables, JSON and plots of the benchmark driver (``bench.py``; rank 0 only)."""

from __future__ import annotations

import gc
import json
import os
import statistics
from collections.abc import Callable
from typing import Any

from bench_full import _spread
from contenders import OURS, OURS_FULL

__all__ = ["summarize", "goals", "planning", "finish"]

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20
RAW = "raw write+fsync / read"
FS = "DCP FileSystemWriter defaults"
FS_TUNED = "DCP FileSystemWriter thread_count=4"
S3TC = "s3torchconnector"
LABEL = {"save": "save", "load_cold": "cold load", "load_warm": "warm load"}


def _op_summary(rounds: list[list[dict[str, Any]]], per_rank: list[int]) -> dict[str, Any]:
    """One op of one contender: ``rounds[r][rank]`` records -> medians and spreads."""
    total = sum(per_rank)
    walls = [rnd[0]["s"] for rnd in rounds]  # after the closing barrier: the same on every rank
    row: dict[str, Any] = {
        "s": _spread(walls),
        "agg_GBps": statistics.median(total / s / 1e9 for s in walls),
        "per_rank_GBps": [
            statistics.median(per_rank[k] / rnd[k]["rank_s"] / 1e9 for rnd in rounds) for k in range(len(per_rank))
        ],
        "cpu_s": statistics.median(sum(g["cpu_s"] for g in rnd) for rnd in rounds),
        "extra_rss_per_rank": [max(rnd[k]["extra_rss"] for rnd in rounds) for k in range(len(per_rank))],
        "device_read_frac": statistics.median(sum(g["device_read"] for g in rnd) / total for rnd in rounds),
    }
    srv = [rnd[0]["server_cpu_s"] for rnd in rounds if rnd[0]["server_cpu_s"] is not None]
    if srv:
        row["server_cpu_s"] = statistics.median(srv)
    if "read" in rounds[-1][0]:
        needed = sum(g["read"][0] for g in rounds[-1])
        row["read_ampl"] = sum(g["read"][1] for g in rounds[-1]) / needed if needed else 1.0
    return row


def summarize(storage: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, ops in storage["records"].items():
        out[name] = {op: _op_summary(rounds, storage["bytes_per_rank"]) for op, rounds in ops.items() if rounds}
    return out


def _ratio(storage: dict[str, Any], op: str, num: str, den: str, field: str = "s") -> dict[str, float] | None:
    """Median (min..max) over rounds of ``num``'s figure / ``den``'s (field s: den faster when > 1)."""
    recs = storage.get("records", {})
    if num not in recs or den not in recs or not recs[num][op] or not recs[den][op]:
        return None
    total = (lambda rnd: sum(g[field] for g in rnd)) if field == "cpu_s" else (lambda rnd: rnd[0][field])
    return _spread([total(a) / total(b) for a, b in zip(recs[num][op], recs[den][op])])


def _goal(goal: str, target: float, r: dict[str, float] | None, why: str, *, below: bool = False) -> dict[str, Any]:
    cmp = "<=" if below else ">="
    if r is None:
        return {"goal": goal, "cmp": cmp, "target": target, "met": None, "note": why}
    met = r["median"] <= target if below else r["median"] >= target
    return {"goal": goal, "cmp": cmp, "target": target, **r, "met": met, "note": ""}


def goals(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Every goal, held against the figures of this run (None: not measured, with the reason)."""
    st = res["storages"]
    gone = "not run here (storage or contender not selected, or skipped: see above)"
    # (goal, target, storage, op, numerator, denominator): time ratios = speed of ours (or of the full
    # save) relative to the other, > 1 when faster
    speed = [
        ("disk cold load, same layout, vs raw sequential read of the same bytes", 0.9, "disk", "load_cold", RAW, OURS),
        ("disk warm load (page cache) vs raw read of the same bytes", 0.9, "disk", "load_warm", RAW, OURS),
        ("/dev/shm warm load vs raw read of the same bytes", 0.9, "shm", "load_warm", RAW, OURS),
        ("disk cold load vs DCP FileSystemReader (defaults' checkpoint)", 1.0, "disk", "load_cold", FS, OURS),
        ("disk cold load vs DCP FileSystemReader (thread_count=4 ckpt)", 1.0, "disk", "load_cold", FS_TUNED, OURS),
        ("/dev/shm save vs DCP FileSystemWriter defaults", 2.0, "shm", "save", FS, OURS),
        # disk saves: no slower than before issue 47's pipeline (1.1x raw, 2.5x DCP on the 2-vCPU VM)
        ("disk save vs raw write+fsync of the same bytes (was 1.1)", 1.1, "disk", "save", RAW, OURS),
        ("disk save vs DCP FileSystemWriter defaults (was 2.5)", 2.5, "disk", "save", FS, OURS),
        ("disk save, full vs partial", 0.7, "disk", "save", OURS, OURS_FULL),
        ("/dev/shm save, full vs partial", 0.7, "shm", "save", OURS, OURS_FULL),
        ("S3 save vs s3torchconnector", 1.0, "s3", "save", S3TC, OURS),
        ("S3 load vs s3torchconnector", 1.0, "s3", "load_warm", S3TC, OURS),
    ]
    g = [_goal(goal, t, _ratio(st.get(where, {}), op, a, b), gone) for goal, t, where, op, a, b in speed]
    # issue 47: /dev/shm saves at least 2x DCP's in every round, not only in the median one
    shm = _ratio(st.get("shm", {}), "save", FS, OURS)
    worst = None if shm is None else {"median": shm["min"], "min": shm["min"], "max": shm["min"]}
    g.append(_goal("/dev/shm save vs DCP FileSystemWriter defaults, slowest round", 2.0, worst, gone))
    for op, what in (("save", "save"), ("load_warm", "load")):
        cpu = _ratio(st.get("s3", {}), op, OURS, S3TC, field="cpu_s")
        g.append(_goal(f"S3 {what}: client CPU / s3torchconnector's", 1.0, cpu, gone, below=True))
    # CPU seconds of a warm load (every thread) over the raw read's: at most 2 lets two cores reach the raw
    # read's time; a guide for reading the figures above, not one of the targets
    for where in ("disk", "shm"):
        cpu = _ratio(st.get(where, {}), "load_warm", OURS, RAW, field="cpu_s")
        g.append(_goal(f"{where} warm load: CPU s / raw read's (guide)", 2.0, cpu, gone, below=True))
    for case, row in res.get("reshard_speed", {}).items():
        for temp in ("cold", "warm"):
            g.append(_goal(f"reshard {case}, one rank, {temp}: DCP time / ours", 1.0, row["dcp_over_ours"][temp], ""))
        # a verified column slice reads whole tiles: bf16 rows of 8 KiB have 4 KiB tiles for 2 KiB needed,
        # so read a request per row it reads 2x; the reader's cost model streams such rows whole (a request
        # per row costs more than the 4 KiB gap beside it), reading what DCP reads: 4x
        streamed = "bf16 rows of 8 KiB" in case
        for who, floor, label in (
            ("smpckpt", 4.0 if streamed else 1.0, " (streamed: whole rows, as DCP)" if streamed else ""),
            ("smpckpt, a request per row", 2.0 if streamed else 1.0, ", a request per row"),
        ):
            if who not in row["readers"]:
                continue
            dev = row["readers"][who]["cold"]["device_ampl"]
            one = {"median": dev, "min": dev, "max": dev}
            g.append(_goal(f"reshard {case}, cold: device bytes / needed{label}", 1.05 * floor, one, "", below=True))
    for case, rows in res.get("reshard", {}).items():
        ours = rows.get("smpckpt", {})
        a = ours.get("stats_ampl")
        spread = None if a is None else {"median": a, "min": a, "max": a}
        g.append(_goal(f"reshard {case}: bytes read / needed", 1.05, spread, "not measured", below=True))
    return g


def planning(quick: bool, log: Callable[[str], None]) -> dict[str, Any]:
    """bench_planning's rows: from benchmarks/out/planning.json when present, else a small run now."""
    path = os.path.join(HERE, "out", "planning.json")
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
        log(f"planning cost: read {path}")
        return {"source": path, "rows": data["rows"], "layers": data.get("layers"), "tp": data.get("tp")}
    import bench_planning

    layers, dps = (4, [1, 4, 16]) if quick else (24, [1, 4, 16, 64])
    log(f"planning cost: {path} absent, running bench_planning ({layers} layers, tp=2, dp {dps})")
    # --quick (the CI smoke): the untimed gc.collect() after each row walked every object the run had made
    # and imported (moto, matplotlib, the storages' rounds): ~0.4 s a row, most of the smoke's planning time.
    # Frozen, it walks only the rows' own planners; the full run keeps the plain collector (its numbers).
    frozen = quick and gc.get_freeze_count() == 0
    if frozen:
        gc.collect()
        gc.freeze()
    try:
        rows = bench_planning.run(layers, 2, dps, log)
    finally:
        if frozen:
            gc.unfreeze()
    return {"source": "bench_planning.run", "rows": rows, "layers": layers, "tp": 2}


def _fmt_ratio(r: dict[str, Any]) -> str:
    return f"{r['median']:.2f} ({r['min']:.2f}..{r['max']:.2f})" if "median" in r else "-"


def print_tables(res: dict[str, Any], log: Callable[[str], None]) -> None:
    for storage, summ in res["summary"].items():
        data = res["storages"][storage]
        log(
            f"\n{storage.upper()}: {sum(data['bytes_per_rank']) / MiB:.1f} MiB over {len(data['bytes_per_rank'])} "
            f"rank(s); GB/s aggregate [per rank]; CPU s (all ranks); extra RSS MiB (worst rank); ours x = its time / "
            f"{OURS}'s (median of per-round ratios)"
        )
        hdr = f"{'contender':36s} {'op':9s} {'GB/s':>6s} {'per rank':>14s} {'ours x':>17s} {'CPU s':>6s} {'RSS':>6s} {'dev':>5s}"
        log(hdr + "\n" + "-" * len(hdr))
        for name, ops in summ.items():
            for op, row in ops.items():
                r = _ratio(data, op, name, OURS)
                pr = ",".join(f"{x:.2f}" for x in row["per_rank_GBps"])
                dev = f"{row['device_read_frac']:.2f}" if op == "load_cold" else ""
                log(
                    f"{name:36s} {LABEL[op]:9s} {row['agg_GBps']:6.2f} {pr:>14s} {_fmt_ratio(r or {}):>17s} "
                    f"{row['cpu_s']:6.2f} {max(row['extra_rss_per_rank']) / MiB:6.1f} {dev:>5s}"
                )
        for name, why in data["skipped"].items():
            log(f"{name:36s} skipped: {why}")
    if res.get("reshard"):
        log("\nRESHARD READS (bytes read / bytes needed; rchar of read_data, smpckpt also its own stats)")
        for case, rows in res["reshard"].items():
            parts = [f"{who} {row['rchar_ampl']:.3f}" for who, row in rows.items()]
            own = rows.get("smpckpt", {}).get("stats_ampl")
            log(f"  {case:34s} " + "  ".join(parts) + (f"  (smpckpt stats {own:.3f})" if own is not None else ""))
    if res.get("reshard_speed"):
        log("\nRESHARD SPEED (one TP=4 rank of a TP=1 save; time median s; CPU s; device bytes / needed)")
        for case, row in res["reshard_speed"].items():
            for temp in ("cold", "warm"):
                parts = [
                    f"{who} {r[temp]['s']['median']:.3f}s cpu {r[temp]['cpu_s']:.3f} dev {r[temp]['device_ampl']:.2f}"
                    for who, r in row["readers"].items()
                ]
                log(f"  {case:44s} {temp}: " + "; ".join(parts))
    log("\nGOALS (median of per-round ratios, min..max)")
    hdr = f"{'goal':72s} {'measured':>20s} {'target':>8s}  met"
    log(hdr + "\n" + "-" * len(hdr))
    for g in res["goals"]:
        tgt = f"{g['cmp']} {g['target']:g}"
        met = "n/a: " + g["note"] if g["met"] is None else ("met" if g["met"] else "MISSED")
        log(f"{g['goal']:72s} {_fmt_ratio(g):>20s} {tgt:>8s}  {met}")


def finish(res: dict[str, Any], out_dir: str, log: Callable[[str], None]) -> None:
    """Summaries, goals, tables, then bench.json and the PNGs under ``out_dir``."""
    import plots

    res["summary"] = {s: summarize(d) for s, d in res["storages"].items()}
    res["goals"] = goals(res)
    print_tables(res, log)
    os.makedirs(out_dir, exist_ok=True)
    res["figures"] = {
        "throughput": plots.throughput(res, os.path.join(out_dir, "throughput.png")),
        "amplification": plots.amplification(res.get("reshard", {}), os.path.join(out_dir, "amplification.png")),
        "planning": plots.planning(res["planning"], os.path.join(out_dir, "planning.png")),
    }
    path = os.path.join(out_dir, "bench.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    log(
        f"\nwrote {path} and {', '.join(os.path.basename(p) for p in res['figures'].values() if p)} ({res['elapsed_s']:.0f}s)"
    )

"""Where a warm load's CPU goes: smpckpt's load (verified and not) beside a raw ``readinto`` of the same
bytes, in CPU seconds per GiB (``getrusage``: every thread, kernel copies included), with the reader's
worker time split into reading and verifying.

CPU seconds are far steadier than wall time on a shared machine, and the wall-time goal follows from
them: a load whose CPU is at most ~2x the raw read's can reach the raw read's time on two cores.

    python benchmarks/profile_load.py                               # 512 MiB GPT-like state, /dev/shm and disk
    python benchmarks/profile_load.py --model llama7b --dirs /dev/shm  # Llama-7B layer shapes (bf16, all tiled)
    python benchmarks/profile_load.py --tree /path/to/staged/old/tree  # the same, with an older smpckpt
    python benchmarks/profile_load.py --dirs benchmarks/out --size-mib 1024 --phases --rounds 11

``--phases``: the wall time of each smpckpt load split into its phases (metadata, planning, the read's
set-up, the workers' I/O from the first request's start to the last one's end, the tail), beside the raw
read's time: a raw ``readinto`` has no metadata or plan, so a load's fixed cost (about 10 ms on the
loaded 2-vCPU VM for the 512 MiB GPT-like state's 83 items: no single hot spot) weighs twice as much
against a 512 MiB raw read as against the 1 GiB the issue's warm-load target names.

Fair comparison: the raw read and every load here fill the same preallocated destinations (touched by
the previous round: no page faults for either), from files in the page cache. How a file got into the
page cache matters: pages read in with ``POSIX_FADV_RANDOM`` (read-ahead off: a reshard's scattered
reads) are cached as small folios, and a warm read of them measured 1.5x the CPU of one of pages cached
by a write or a sequential read (ext4, kernel 6.18); this script's files are all cached by their writes.

``--floor``: the floor of any verified read on this machine, in the same rounds: the raw file read in
256 KiB requests, each hashed (xxh3-64) at once, by one thread and by two, beside the raw read by two
threads. Measured on the 2-vCPU VM (loaded, one process, 1 GiB from the ext4 page cache): xxh3 hashes
46 GB/s from the CPU's cache but 10 GB/s from memory, and the bytes a 64-256 KiB ``preadv`` has just
copied hash at nearly the memory's rate (the kernel's copy does not leave them in the cache), so a
verified read moves the bytes through memory once more than the raw read does.

``--tree`` puts a folder on ``sys.path`` first (a copy of another commit's ``smpckpt`` whose
``planners``/``storage`` link to that commit's folders), to measure two trees side by side; for native
profiles run it under ``perf record -g`` or ``py-spy record --native`` (``--rounds 30``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import shutil
import statistics
import sys
import threading
import time
import warnings
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
warnings.filterwarnings("ignore")


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _floor(path: str, flat: memoryview, threads: int, request: int, *, hashed: bool) -> Any:
    """A read of ``path`` into ``flat`` with nothing but the work a verified read cannot skip: ``threads``
    threads each read a contiguous share in ``request``-byte ``preadv`` calls, each hashed (xxh3-64, as
    our checksums) right after it returns when ``hashed``. What smpckpt's verified warm read adds on top
    of this is its own overhead; what this adds to the raw read is the price of the check itself."""
    import xxhash

    def share(fd: int, lo: int, hi: int) -> None:
        while lo < hi:
            got = os.preadv(fd, [flat[lo : min(hi, lo + request)]], lo)
            if got <= 0:
                raise OSError(f"{path}: short read at {lo}")
            if hashed:
                xxhash.xxh3_64_intdigest(flat[lo : lo + got])
            lo += got

    def read() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            cut = [len(flat) * k // threads for k in range(threads + 1)]
            workers = [threading.Thread(target=share, args=(fd, cut[k], cut[k + 1])) for k in range(threads)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        finally:
            os.close(fd)

    return read


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=512, help="GPT-like state size (default 512)")
    ap.add_argument("--model", choices=("gpt", "llama7b"), default="gpt", help="llama7b: one decoder layer")
    ap.add_argument("--dirs", default=f"/dev/shm,{os.path.join(HERE, 'out')}", help="comma list of parent folders")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tree", default=None, help="a staged smpckpt tree to import instead of the installed one")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--threads", type=int, default=None, help="the reader's thread_count (default: its own)")
    ap.add_argument(
        "--no-split",
        action="store_true",
        help="no per-call timers in the workers (they cost a lock and two clock reads per verified chunk)",
    )
    ap.add_argument(
        "--fuse-bytes",
        default="",
        help="comma list of byte counts: also the verified load with _fetch.FUSE_BYTES set to each, in the same rounds",
    )
    ap.add_argument("--phases", action="store_true", help="wall time of each load's phases (module docstring)")
    ap.add_argument(
        "--floor",
        action="store_true",
        help="also the floor of a verified read, in the same rounds (module docstring): the raw file read in "
        "256 KiB requests each hashed at once, by 1 and 2 threads, and the raw read by 2 threads",
    )
    args = ap.parse_args(argv)
    if args.tree:
        sys.path.insert(0, args.tree)
    import torch
    import torch.distributed.checkpoint as dcp
    from _model import global_tensor, llama7b_defs, llama7b_specs, local_piece, model_defs, model_specs
    from bench import model_dims

    from smpckpt import gc_frozen
    from smpckpt.model.layout import ParallelLayout
    from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner
    from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter
    from smpckpt.storage.read import _fetch

    torch.set_num_threads(1)
    if args.model == "llama7b":
        defs = [d for d in llama7b_defs(1) if "embed" not in d.key and "lm_head" not in d.key]
        specs = llama7b_specs()
    else:
        h, layers, vocab = model_dims(args.size_mib)
        defs, specs = model_defs(h, layers, vocab), model_specs(h)
    layout = ParallelLayout()
    state = {d.key: local_piece(d, global_tensor(j, d), 1, 0) for j, d in enumerate(defs)}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    gib = nbytes / (1 << 30)
    split: dict[str, float] = {}
    lock = threading.Lock()

    def timed(name: str, fn: Any, key: str | None = None) -> Any:
        key = key or name

        def wrapper(*a: Any, **k: Any) -> Any:
            c0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                with lock:
                    split[key] = split.get(key, 0.0) + time.thread_time() - c0

        return wrapper

    # the worker threads' CPU: verification, and the whole local read (which includes it where fused);
    # a fused chunk is verified by `_verify_chunk` (trees before it: `verify_blocks`), which calls
    # `verify_blocks` only to report a mismatch, so the two never overlap in a clean load
    for name in () if args.no_split else ("verify_blocks", "_verify_chunk", "_read_local"):
        if hasattr(_fetch, name):
            key = "_read_local" if name == "_read_local" else "verify_blocks"
            setattr(_fetch, name, timed(name, getattr(_fetch, name), key))
    phase: dict[str, float] = {}
    if args.phases:
        from smpckpt.storage.format import _reading
        from smpckpt.storage.read import _run

        def stamped(owner: Any, name: str, key: str) -> None:
            fn = getattr(owner, name)

            def wrapper(*a: Any, **k: Any) -> Any:
                now = time.perf_counter()
                with lock:
                    phase.setdefault(key + "0", now)
                try:
                    return fn(*a, **k)
                finally:
                    now = time.perf_counter()
                    with lock:
                        phase[key + "1"] = max(phase.get(key + "1", now), now)

            setattr(owner, name, wrapper)

        # the readers' base class, folded into its one subclass since 2026-11-30 (``--tree`` may be older)
        base = getattr(_reading, "ReaderBase", None) or importlib.import_module("smpckpt.storage").FsspecStorageReader
        stamped(base, "read_metadata", "md")
        stamped(base, "read_data", "rd")
        stamped(_run.ReadRun, "run", "run")
        stamped(_run.ReadRun, "_execute", "io")

    def phases_of(t0: float, t1: float) -> dict[str, float]:
        """The phases of the load that ran from ``t0`` to ``t1`` (seconds)."""
        p = phase
        if not all(k in p for k in ("md0", "md1", "rd0", "rd1", "run0", "run1", "io0", "io1")):
            return {}
        return {
            "metadata": p["md1"] - t0,
            "planning": p["rd0"] - p["md1"],
            "read set-up": p["io0"] - p["rd0"],
            "I/O": p["io1"] - p["io0"],
            "tail": t1 - p["io1"],
        }

    results: dict[str, Any] = {"code": _fetch.__file__, "model": args.model, "bytes": nbytes, "dirs": {}}
    print(f"smpckpt from {os.path.dirname(_fetch.__file__)}; {len(state)} tensors, {nbytes / (1 << 20):.0f} MiB")
    for parent in [d for d in args.dirs.split(",") if d]:
        os.makedirs(parent, exist_ok=True)
        ck, raw = os.path.join(parent, "profile-load-ck"), os.path.join(parent, "profile-load-raw")
        shutil.rmtree(ck, ignore_errors=True)
        planner = ParallelSavePlanner(layout, specs, rank=0, enable_plan_caching=False)
        dcp.save({"model": state}, storage_writer=FsspecStorageWriter(ck), planner=planner)
        with open(raw, "wb") as f:
            for t in state.values():
                f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        dest = {k: torch.empty_like(v) for k, v in state.items()}

        def raw_load(raw: str = raw, dest: dict[str, Any] = dest) -> None:
            with open(raw, "rb", buffering=0) as f:
                for t in dest.values():
                    mv = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                    while mv:
                        mv = mv[f.readinto(mv) :]

        def ours(verify: bool, ck: str = ck, dest: dict[str, Any] = dest, fuse: int | None = None) -> Any:
            def load() -> None:
                default = getattr(_fetch, "FUSE_BYTES", None)
                if fuse is not None:
                    _fetch.FUSE_BYTES = fuse
                try:
                    _load()
                finally:
                    if fuse is not None:
                        _fetch.FUSE_BYTES = default

            def _load() -> None:
                extra = {} if args.threads is None else {"thread_count": args.threads}
                reader = FsspecStorageReader(ck, verify_checksums=verify, **extra)
                with gc_frozen():
                    dcp.load({"model": dest}, storage_reader=reader, planner=ParallelLoadPlanner(layout, specs, rank=0))

            return load

        cases = {"raw readinto": raw_load, "smpckpt": ours(True), "smpckpt unverified": ours(False)}
        if args.floor:
            flat = memoryview(bytearray(nbytes))  # touched: no page faults, as the destinations
            cases["floor raw, 2 threads"] = _floor(raw, flat, 2, 16 << 20, hashed=False)
            cases["floor 256 KiB+xxh3"] = _floor(raw, flat, 1, 256 << 10, hashed=True)
            cases["floor 256 KiB+xxh3, 2 thr"] = _floor(raw, flat, 2, 256 << 10, hashed=True)
        for n in [int(x) for x in args.fuse_bytes.split(",") if x]:
            cases[f"smpckpt fuse {n >> 10} KiB"] = ours(True, fuse=n)
        recs: dict[str, list[dict[str, float]]] = {c: [] for c in cases}
        try:
            for r in range(args.rounds + 1):
                for name, fn in list(cases.items())[r % len(cases) :] + list(cases.items())[: r % len(cases)]:
                    split.clear()
                    phase.clear()
                    c0, t0 = _cpu_s(), time.perf_counter()
                    fn()
                    t1 = time.perf_counter()
                    if r:
                        parts = {f"phase {k}": v for k, v in phases_of(t0, t1).items()}
                        recs[name].append({"s": t1 - t0, "cpu_s": _cpu_s() - c0, **split, **parts})
                    if name != "raw readinto" and not name.startswith("floor"):
                        bad = [k for k, v in state.items() if not torch.equal(dest[k], v)]
                        if bad:
                            raise RuntimeError(f"{name}: loaded values differ for {bad[:3]}")
        finally:
            shutil.rmtree(ck, ignore_errors=True)
            os.remove(raw)
        rows = {}
        raw_cpu = statistics.median(g["cpu_s"] for g in recs["raw readinto"])
        print(f"\n{parent} (warm): CPU s per GiB, median of {args.rounds} (min..max); x raw; worker split")
        for name, gs in recs.items():
            cpu = [g["cpu_s"] / gib for g in gs]
            row = {
                "cpu_s_per_gib": statistics.median(cpu),
                "min": min(cpu),
                "max": max(cpu),
                "x_raw_cpu": statistics.median(g["cpu_s"] for g in gs) / raw_cpu,
                "wall_s": statistics.median(g["s"] for g in gs),
                **{k: statistics.median(g.get(k, 0.0) for g in gs) / gib for k in ("_read_local", "verify_blocks")},
            }
            rows[name] = row
            extra = (
                f"  read+verify {row['_read_local']:.3f}, of which verify {row['verify_blocks']:.3f}"
                if row["_read_local"]
                else ""
            )
            print(
                f"  {name:26s} {row['cpu_s_per_gib']:.3f} ({row['min']:.3f}..{row['max']:.3f})  "
                f"x{row['x_raw_cpu']:.2f}{extra}"
            )
        if args.floor:
            # wall time against the raw read in the same round: whether any verified read can reach the
            # warm-load target (>= 0.9x raw) on this machine at all
            for name in [c for c in recs if c.startswith("floor") or c.startswith("smpckpt")]:
                x = [r["s"] / g["s"] for g, r in zip(recs[name], recs["raw readinto"])]
                rows[name]["x_raw_wall"] = statistics.median(x)
                print(f"  {name:26s} wall x{statistics.median(x):.2f} raw's speed ({min(x):.2f}..{max(x):.2f}), paired")
        if args.phases:
            raw_s = statistics.median(g["s"] for g in recs["raw readinto"])
            print(f"  wall, ms (median): raw readinto {raw_s * 1e3:.1f}")
            for name, gs in recs.items():
                keys = [k for k in gs[0] if k.startswith("phase ")]
                if keys:
                    med = {k: statistics.median(g.get(k, 0.0) for g in gs) for k in keys}
                    rows[name]["phases_s"] = {k[6:]: v for k, v in med.items()}
                    print(
                        f"  {name:26s} {rows[name]['wall_s'] * 1e3:.1f}: "
                        + ", ".join(f"{k[6:]} {v * 1e3:.1f}" for k, v in med.items())
                    )
        for name in [c for c in recs if c.startswith("smpckpt fuse")]:
            # paired: each round's CPU against the default's in the same round (the host's load drifts less
            # within a round than across the run)
            ratios = [g["cpu_s"] / d["cpu_s"] for g, d in zip(recs[name], recs["smpckpt"])]
            rows[name]["paired_x_default"] = statistics.median(ratios)
            lower = sum(x < 1 for x in ratios)
            print(
                f"  {name}: x{statistics.median(ratios):.3f} the default's CPU, paired ({lower}/{len(ratios)} rounds lower)"
            )
        results["dirs"][parent] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    raise SystemExit(main())

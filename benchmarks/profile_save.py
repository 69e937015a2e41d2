"""Where a save's CPU goes: smpckpt's one-process save beside its floors -- a raw ``memcpy`` of the same
bytes, a raw ``write`` of them (+ ``fsync`` on disk), our hash (xxh3-64 in 1 MiB blocks) alone -- and
stock DCP's defaults, in CPU seconds per GiB (``getrusage``: every thread, kernel copies included), with
the save's CPU split by phase (``time.thread_time`` around the functions of each phase, on whichever
thread runs them):

* ``plan``      the planner's local plan (value digests included), global plan and finish plan, and the
                writer's global plan (the folder probe);
* ``digests``   of which the replica value digests (``planners._value_digests.value_digests``);
* ``stage``     copies into staging buffers (the host stage's copier thread; none for a contiguous CPU
                state, written in place);
* ``hash``      the block hasher (the file threads' hash threads, and small records hashed inline);
* ``write``     the sinks' ``write`` calls (the syscalls, the kernel's copy into the page cache);
* ``fsync``     the sinks' commits (``fsync`` + ``close``) and the folders' ``fsync``;
* ``commit``    the coordinator's ``finish`` (metadata pickled and written, manifest, commit);
* ``other``     the rest: DCP's and our Python between those (resolve_data, results, threads' hand-offs).

CPU seconds are steadier than wall time on a shared machine; the wall time and ``cpu / wall`` (how many
cores the save kept busy) are printed beside them. ``idle`` is the wall time the main thread spent
waiting while no phase ran on it (the file threads' work, or nothing).

    python benchmarks/profile_save.py                              # 1 GiB GPT-like state, /dev/shm and disk
    python benchmarks/profile_save.py --size-mib 256 --rounds 5    # a smaller, quicker one
    python benchmarks/profile_save.py --tree /tmp/stage-old        # the same with an older smpckpt
    python benchmarks/profile_save.py --hash-beside on,off         # in-place hashing forced each way, paired

``--tree`` works as in ``profile_load.py``: alternate runs of two trees to compare them. For native
profiles run it under ``perf record -g`` (``--rounds 20 --cases smpckpt``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
import warnings
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
warnings.filterwarnings("ignore")

PHASES = ("plan", "digests", "stage", "hash", "write", "fsync", "commit")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024, help="GPT-like state size (default 1024)")
    ap.add_argument("--dirs", default=f"/dev/shm,{os.path.join(HERE, 'out')}", help="comma list of parent folders")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tree", default=None, help="a staged smpckpt tree to import instead of the installed one")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--threads", type=int, default=None, help="the writer's thread_count (default: its own)")
    ap.add_argument(
        "--cases",
        default="",
        help="comma list of case names to run (default all: raw memcpy, raw write, hash alone, smpckpt, DCP defaults)",
    )
    ap.add_argument("--no-split", action="store_true", help="no per-phase timers (they cost a lock per call)")
    ap.add_argument(
        "--hash-beside",
        default="",
        help="comma list of on/off: also smpckpt with in-place records hashed beside their writes on hash "
        "threads (on) or inline just before each write (off), whatever the writer would choose "
        "(FsspecStorageWriter(hash_beside=True/False)), in the same rounds, paired against the writer's choice",
    )
    args = ap.parse_args(argv)
    if args.tree:
        sys.path.insert(0, args.tree)
    import torch
    import torch.distributed.checkpoint as dcp
    import xxhash
    from _model import global_tensor, local_piece, model_defs, model_specs
    from bench import model_dims
    from bench_storage import raw_save
    from profile_load import _cpu_s
    from torch.distributed.checkpoint import FileSystemWriter

    from smpckpt import gc_frozen
    from smpckpt.model.layout import ParallelLayout
    from smpckpt.planners import ParallelSavePlanner
    from smpckpt.storage import FsspecStorageWriter

    torch.set_num_threads(1)
    h, layers, vocab = model_dims(args.size_mib)
    defs, specs = model_defs(h, layers, vocab), model_specs(h)
    layout = ParallelLayout()
    state = {d.key: local_piece(d, global_tensor(j, d), 1, 0) for j, d in enumerate(defs)}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    gib = nbytes / (1 << 30)
    split: dict[str, float] = {}
    lock = threading.Lock()
    patched: list[tuple[Any, str, Any]] = []

    def timed(owner: Any, name: str, key: str) -> None:
        fn = getattr(owner, name, None)
        if fn is None:
            return  # an older tree without it

        def wrapper(*a: Any, **k: Any) -> Any:
            c0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                with lock:
                    split[key] = split.get(key, 0.0) + time.thread_time() - c0

        patched.append((owner, name, fn))
        setattr(owner, name, wrapper)

    if not args.no_split:
        import smpckpt.planners._replica_values as replica_mod
        from smpckpt.storage.backends import _folder, _sinks
        from smpckpt.storage.format import _checksum, _staging
        from smpckpt.storage.write import writer as writer_mod

        for name in ("create_local_plan", "create_global_plan", "finish_plan"):
            timed(ParallelSavePlanner, name, "plan")
        timed(FsspecStorageWriter, "prepare_global_plan", "plan")
        # the replica module's own binding of it (imported by name), so the wrapper is what it calls
        timed(replica_mod, "value_digests", "digests")
        timed(_checksum.BlockHasher, "update", "hash")
        timed(_staging.HostStage, "_run", "stage")
        timed(_sinks.LocalSink, "write", "write")
        timed(_sinks.LocalSink, "commit", "fsync")
        timed(_folder.Folder, "fsync_dirs", "fsync")
        timed(writer_mod.FsspecStorageWriter, "finish", "commit")

    def ours(ck: str, **forced: Any) -> None:
        extra = {} if args.threads is None else {"thread_count": args.threads}
        planner = ParallelSavePlanner(layout, specs, rank=0, enable_plan_caching=False)
        with gc_frozen():  # as save_checkpoint and the benchmark driver run it
            writer = FsspecStorageWriter(ck, **extra, **forced)
            dcp.save({"model": state}, storage_writer=writer, planner=planner)

    def forced(beside: bool) -> Any:
        import inspect

        if "hash_beside" not in inspect.signature(FsspecStorageWriter.__init__).parameters:
            raise SystemExit("--hash-beside: this tree's FsspecStorageWriter takes no hash_beside")
        return lambda ck: ours(ck, hash_beside=beside)

    def dcp_defaults(ck: str) -> None:
        planner = ParallelSavePlanner(layout, specs, rank=0, enable_plan_caching=False)
        dcp.save({"model": state}, storage_writer=FileSystemWriter(ck), planner=planner)

    dests = {k: torch.empty_like(v) for k, v in state.items()}

    def raw_memcpy(_ck: str) -> None:
        for k, v in state.items():
            dests[k].copy_(v)

    def hash_alone(_ck: str) -> None:
        for v in state.values():
            mv = memoryview(v.reshape(-1).view(torch.uint8).numpy())
            for i in range(0, mv.nbytes, 1 << 20):
                xxhash.xxh3_64_intdigest(mv[i : i + (1 << 20)])

    cases = {
        "raw memcpy": raw_memcpy,
        "hash alone": hash_alone,
        "raw write": lambda ck: raw_save(state, ck),
        "smpckpt": ours,
        "DCP defaults": dcp_defaults,
    }
    for mode in [x.strip() for x in args.hash_beside.split(",") if x.strip()]:
        if mode not in ("on", "off"):
            raise SystemExit(f"--hash-beside takes on and off, got {mode!r}")
        cases[f"smpckpt beside {mode}"] = forced(mode == "on")
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    if wanted:
        unknown = sorted(set(wanted) - set(cases))
        if unknown:
            raise SystemExit(f"unknown case(s) {unknown}; known: {sorted(cases)}")
        cases = {k: v for k, v in cases.items() if k in wanted or k.startswith("smpckpt beside")}
    import smpckpt.storage

    results: dict[str, Any] = {"code": smpckpt.storage.__file__, "bytes": nbytes, "tensors": len(state), "dirs": {}}
    from smpckpt.storage.backends import _fs

    cpus = _fs.rank_cpus() if hasattr(_fs, "rank_cpus") else None
    print(
        f"smpckpt from {os.path.dirname(smpckpt.storage.__file__)}; {len(state)} tensors, "
        f"{nbytes / (1 << 20):.0f} MiB; rank CPUs {cpus} (in-place records hashed inline where the writer "
        "has at least that many files in flight, beside the writes otherwise)"
    )
    try:
        for parent in [d for d in args.dirs.split(",") if d]:
            os.makedirs(parent, exist_ok=True)
            ck = os.path.join(parent, "profile-save-ck")
            recs: dict[str, list[dict[str, float]]] = {c: [] for c in cases}
            try:
                for r in range(args.rounds + 1):  # round 0 warms up (page cache, pools, imports)
                    order = list(cases.items())
                    for name, fn in order[r % len(order) :] + order[: r % len(order)]:
                        shutil.rmtree(ck, ignore_errors=True)
                        split.clear()
                        c0, t0 = _cpu_s(), time.perf_counter()
                        fn(ck)
                        wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
                        if r:
                            recs[name].append({"s": wall, "cpu_s": cpu, **split})
            finally:
                shutil.rmtree(ck, ignore_errors=True)
            results["dirs"][parent] = _report(parent, recs, gib, args.rounds)
    finally:
        for owner, name, fn in reversed(patched):
            setattr(owner, name, fn)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _report(parent: str, recs: dict[str, list[dict[str, float]]], gib: float, rounds: int) -> dict[str, Any]:
    med = statistics.median
    rows: dict[str, Any] = {}
    print(f"\n{parent}: CPU s per GiB, median of {rounds} (min..max); wall s; cores busy (cpu/wall)")
    for name, gs in recs.items():
        cpu = [g["cpu_s"] / gib for g in gs]
        row: dict[str, Any] = {
            "cpu_s_per_gib": med(cpu),
            "min": min(cpu),
            "max": max(cpu),
            "wall_s": med(g["s"] for g in gs),
            "cores": med(g["cpu_s"] / g["s"] for g in gs),
        }
        phases = {p: med(g.get(p, 0.0) for g in gs) / gib for p in PHASES}
        if any(phases.values()):
            # digests run inside the local plan: not added twice
            phases["other"] = row["cpu_s_per_gib"] - sum(v for p, v in phases.items() if p != "digests")
            row["phases"] = phases
        rows[name] = row
        print(
            f"  {name:14s} {row['cpu_s_per_gib']:.3f} ({row['min']:.3f}..{row['max']:.3f})  "
            f"wall {row['wall_s']:.3f}  x{row['cores']:.2f}"
        )
        if "phases" in row:
            print("      " + "  ".join(f"{p} {v:.3f}" for p, v in row["phases"].items()))
    for name in [c for c in recs if c.startswith("smpckpt beside") and "smpckpt" in recs]:
        # paired: each round against the default's in the same round (the host's load drifts less within
        # a round than across the run)
        for what in ("cpu_s", "s"):
            ratios = [g[what] / d[what] for g, d in zip(recs["smpckpt"], recs[name])]
            rows[name][f"default_over_this_{what}"] = med(ratios)
            lower = sum(x < 1 for x in ratios)
            print(
                f"  default / {name}, {'CPU' if what == 'cpu_s' else 'wall'}: x{med(ratios):.3f} paired "
                f"(default lower in {lower}/{len(ratios)} rounds)"
            )
    return rows


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    raise SystemExit(main())

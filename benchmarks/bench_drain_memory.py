"""The drain's host memory (``FastTier.drain_memory``): one rank's tiered save of ``--size-mib`` drained to a
local ``path`` (a disk folder) and to S3 (moto in a child process, its memory not the rank's): peak RSS above
the baseline while it drains (``VmHWM`` reset as the save returns, read when ``wait_for_saves`` did) and the
drain's wall time. Trees side by side, A B A B: each measurement a fresh process, a tree's import path put
first (``--tree NAME=PATH[:CAP_MIB]``; PATH ``-``: the installed package; CAP_MIB: its ``drain_memory``).

    python benchmarks/bench_drain_memory.py --tree main=/tmp/old --tree new=- --tree new512=-:512 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def one(target: str, size_mib: int, cap_mib: int, endpoint: str, bucket: str, run: str) -> dict[str, float]:
    """(a fresh process) One save drained to ``target``; peak RSS above the baseline, drain seconds."""
    import torch
    from _rss import peak, reset_peak
    from torch import nn

    from smpckpt import FastTier, Location, save_checkpoint, wait_for_saves

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4096, 4096, bias=False) for _ in range(size_mib // 64)))
    tmp = tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR"))
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"} if target == "s3" else None
    url = f"s3://{bucket}/{run}" if target == "s3" else os.path.join(tmp, "durable")
    extra = {"drain_memory": cap_mib << 20} if cap_mib else {}
    fast = FastTier(local_path=os.path.join("/dev/shm", os.path.basename(tmp)), replicas=1, **extra)
    try:
        save_checkpoint(Location(url, storage_options=options), "s1", model=model, options=fast)
        base, t0 = reset_peak(), time.perf_counter()
        wait_for_saves()
        drain_s = time.perf_counter() - t0
        return {"rss_mib": (peak() - base) / 2**20, "drain_s": drain_s}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(fast.local_path, ignore_errors=True)
        if options is not None:
            import s3fs

            s3fs.S3FileSystem(**options).rm(f"{bucket}/{run}", recursive=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", action="append", default=[], help="NAME=PATH[:CAP_MIB] (PATH '-': installed)")
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--targets", default="local,s3")
    ap.add_argument("--one", nargs=5, metavar=("TARGET", "CAP_MIB", "ENDPOINT", "BUCKET", "RUN"))
    args = ap.parse_args()
    if args.one:
        target, cap, endpoint, bucket, run = args.one
        print(json.dumps(one(target, args.size_mib, int(cap), endpoint, bucket, run)))
        return
    sys.path.insert(0, HERE)
    from _s3server import start_moto

    ep = start_moto("drainmem")
    rows: dict[tuple[str, str], list[dict[str, float]]] = {}
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}", flush=True)
    try:
        for r in range(args.rounds):
            for spec in args.tree:
                name, _, where = spec.partition("=")
                path, _, cap = where.partition(":")
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (path if path != "-" else "", HERE) if p))
                for target in args.targets.split(","):
                    cmd = [sys.executable, __file__, "--size-mib", str(args.size_mib), "--one", target, cap or "0"]
                    cmd += [ep.url, ep.bucket, f"{name}-{target}-{r}"]
                    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                    got = json.loads(out.stdout.strip().splitlines()[-1])
                    rows.setdefault((name, target), []).append(got)
                    print(
                        f"round {r} {name:10s} {target:5s} +{got['rss_mib']:7.0f} MiB  drain {got['drain_s']:6.2f} s",
                        flush=True,
                    )
    finally:
        ep.stop()
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print(f"\n{args.size_mib} MiB per rank, medians (min..max) of {args.rounds} rounds")
    for (name, target), got in rows.items():
        rss, secs = [g["rss_mib"] for g in got], [g["drain_s"] for g in got]
        print(
            f"{name:10s} {target:5s} peak RSS +{statistics.median(rss):5.0f} MiB ({min(rss):.0f}..{max(rss):.0f})  "
            f"drain {statistics.median(secs):5.2f} s ({min(secs):.2f}..{max(secs):.2f})"
        )


if __name__ == "__main__":
    main()

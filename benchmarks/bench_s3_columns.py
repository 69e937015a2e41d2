"""A TP rank's column slice of one large fp32 matrix on S3 (moto in a child process): time, requests,
bytes requested and peak RSS above the destination, code trees side by side (A B A B ...).

The matrix (``--mib`` MiB, rows of 64 KiB) is saved once at TP=1 (``--full``: as a full artifact,
``FullArtifactWriter``, the export a job loads by column; else a partial checkpoint); each measurement is a fresh process
(``--child``) that loads TP=``--tp`` rank ``--rank``'s columns (dim 1) into a touched destination and
checks them bit-exact. ``--tree NAME=DIR`` runs that side with ``PYTHONPATH=DIR`` (a folder holding an
``smpckpt`` package, e.g. another commit's ``smpckpt/`` with ``planners/`` and ``storage/`` copied
inside it); ``NAME=`` is the installed package. Peak RSS: ``VmHWM`` after ``/proc/self/clear_refs``
reset it, less the RSS before the load. moto reads a whole object for every ranged GET (its cost, not
S3's; its CPU is shown): compare requests and client CPU, and time with that in mind.

    python benchmarks/bench_s3_columns.py --tree old=/tmp/base_pkg --tree new= --rounds 2
    python benchmarks/bench_s3_columns.py --full --mib 64 --row-kib 2048 --rounds 1   # a full artifact
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MiB = 1 << 20
COLS = 16384  # rows of 64 KiB (--row-kib: other widths)


def child(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from _s3server import connect

    from smpckpt import ParallelLayout, ShardSpec
    from smpckpt.planners import ParallelLoadPlanner
    from smpckpt.storage import FsspecStorageReader

    cols = args.row_kib * 256
    ep = connect(args.endpoint, "bench")
    rows = args.mib * MiB // (4 * cols)
    width = cols // args.tp
    dest = torch.zeros(rows, width)
    dest.view(-1)[::1024] = 1  # touched: its pages count in the RSS before the load
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status("VmRSS")
    opts = {"max_request_bytes": args.max_request_mb * MiB} if args.max_request_mb else {}
    reader = FsspecStorageReader(f"s3://bench/{args.key}", storage_options=ep.options, **opts)
    planner = ParallelLoadPlanner(ParallelLayout(tp=args.tp), {"w": ShardSpec(dim=1)}, rank=args.rank)
    t, cpu = time.perf_counter(), time.process_time()
    dcp.load({"w": dest}, storage_reader=reader, planner=planner, no_dist=True)
    t, cpu = time.perf_counter() - t, time.process_time() - cpu
    peak = _status("VmHWM") - before
    c0 = args.rank * width
    want = (
        torch.arange(rows, dtype=torch.int32)[:, None] * cols + torch.arange(c0, c0 + width, dtype=torch.int32)
    ).view(torch.float32)
    st = reader.last_read_stats
    print(
        json.dumps(
            {
                "s": t,
                "cpu_s": cpu,
                "requests": st.requests,
                "requested_mib": st.bytes_requested / MiB,
                "peak_rss_mib": peak / MiB,
                "exact": bool(torch.equal(dest.view(torch.int32), want.view(torch.int32))),
            }
        )
    )


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(f.read().split(f"{field}:")[1].split()[0]) * 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--row-kib", type=int, default=COLS // 256, help="row width in KiB (64: rows of 64 KiB)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-request-mb", type=int, default=0, help="reader's max_request_bytes (0: its default)")
    p.add_argument(
        "--full", action="store_true", help="save a full artifact (FullArtifactWriter), not a partial checkpoint"
    )
    p.add_argument("--tree", action="append", default=[], help="NAME=DIR (PYTHONPATH of that side; empty: installed)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    p.add_argument("--key", default="cols", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    import torch
    import torch.distributed.checkpoint as dcp
    from _s3server import server_cpu_s, start_moto

    from smpckpt import ParallelLayout
    from smpckpt.planners import ParallelSavePlanner
    from smpckpt.storage import FsspecStorageWriter, FullArtifactWriter

    trees = [t.split("=", 1) for t in args.tree] or [["installed", ""]]
    ep = start_moto("bench")
    try:
        cols = args.row_kib * 256
        rows = args.mib * MiB // (4 * cols)
        w = torch.arange(rows * cols, dtype=torch.int32).view(torch.float32).view(rows, cols)
        kind = FullArtifactWriter if args.full else FsspecStorageWriter
        writer = kind(f"s3://bench/{args.key}", storage_options=ep.options)
        dcp.save({"w": w}, storage_writer=writer, planner=ParallelSavePlanner(ParallelLayout(), rank=0), no_dist=True)
        del w
        print(
            f"{args.mib} MiB fp32 [{rows}, {cols}] ({'full artifact' if args.full else 'partial checkpoint'}), "
            f"TP={args.tp} rank {args.rank}'s columns ({args.mib // args.tp} MiB)"
        )
        for r in range(args.rounds):
            for name, tree in trees:
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (tree, os.path.dirname(__file__)) if x))
                cmd = [
                    sys.executable,
                    __file__,
                    "--child",
                    "--endpoint",
                    ep.url,
                    "--key",
                    args.key,
                    "--mib",
                    str(args.mib),
                    "--tp",
                    str(args.tp),
                    "--rank",
                    str(args.rank),
                    "--row-kib",
                    str(args.row_kib),
                    "--max-request-mb",
                    str(args.max_request_mb),
                ]
                server = server_cpu_s(ep) or 0.0
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
                server = (server_cpu_s(ep) or 0.0) - server
                res = json.loads(out.strip().splitlines()[-1])
                print(
                    f"round {r} {name:>8}: {res['s']:6.2f} s, client CPU {res['cpu_s']:5.2f} s, "
                    f"moto CPU {server:5.2f} s, {res['requests']:4d} requests, {res['requested_mib']:7.0f} MiB requested, "
                    f"peak RSS +{res['peak_rss_mib']:6.0f} MiB, bit-exact {res['exact']}",
                    flush=True,
                )
    finally:
        ep.stop()


if __name__ == "__main__":
    main()

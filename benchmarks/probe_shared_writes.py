"""Probe: N processes writing disjoint ranges of one shared file against one file each.

A full (consolidated) save has every rank write its boxes into the artifact's few shared files, while a
partial save gives each rank files of its own. Linux serialises buffered writes to one inode, so this
probe measures the ceiling that puts on full saves: aggregate GB/s for ``--procs`` writers, each writing
``--mib`` MiB in ``--chunk-mib`` pieces with ``pwrite`` or through a shared mapping, into its own file or
into its own range of one shared file (best of ``--rounds``; page cache only, no fsync).

    python benchmarks/probe_shared_writes.py --dir /dev/shm/probe --procs 4
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import shutil
import time
from typing import Any

MiB = 1 << 20


def _writer(i: int, args: argparse.Namespace, shared: bool, mapped: bool, barrier: Any, out: Any) -> None:
    per, chunk = args.mib * MiB, args.chunk_mib * MiB
    buf = os.urandom(chunk)
    path = os.path.join(args.dir, "shared.bin" if shared else f"own{i}.bin")
    base = i * per if shared else 0
    fd = os.open(path, os.O_RDWR)
    try:
        barrier.wait()
        start = time.perf_counter()
        if mapped:
            with mmap.mmap(fd, base + per) as mm:
                for o in range(0, per, chunk):
                    mm[base + o : base + o + chunk] = buf
        else:
            for o in range(0, per, chunk):
                os.pwrite(fd, buf, base + o)
        out.put(time.perf_counter() - start)
    finally:
        os.close(fd)


def _files(args: argparse.Namespace, shared: bool) -> None:
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    sizes = (
        {"shared.bin": args.procs * args.mib * MiB}
        if shared
        else {f"own{i}.bin": args.mib * MiB for i in range(args.procs)}
    )
    for name, size in sizes.items():
        fd = os.open(os.path.join(args.dir, name), os.O_CREAT | os.O_RDWR, 0o644)
        os.ftruncate(fd, size)
        os.close(fd)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    total = args.procs * args.mib * MiB
    for shared in (False, True):
        for mapped in (False, True):
            rates = []
            for _ in range(args.rounds):
                _files(args, shared)
                barrier, out = mp.Barrier(args.procs), mp.Queue()
                procs = [
                    mp.Process(target=_writer, args=(i, args, shared, mapped, barrier, out)) for i in range(args.procs)
                ]
                for p in procs:
                    p.start()
                times = [out.get(timeout=600) for _ in procs]
                for p in procs:
                    p.join()
                rates.append(total / max(times) / 1e9)
            rows.append(
                {"file": "one shared" if shared else "one each", "how": "mmap" if mapped else "pwrite", "gbps": rates}
            )
    shutil.rmtree(args.dir, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="scratch folder (removed afterwards)")
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--mib", type=int, default=128, help="MiB per process")
    ap.add_argument("--chunk-mib", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"{args.procs} processes x {args.mib} MiB, {args.chunk_mib} MiB writes, {args.dir} ({os.cpu_count()} CPUs)")
    for row in run(args):
        print(
            f"  {row['file']:<11} {row['how']:<7} best {max(row['gbps']):6.2f} GB/s  all {[round(r, 2) for r in row['gbps']]}"
        )


if __name__ == "__main__":
    main()

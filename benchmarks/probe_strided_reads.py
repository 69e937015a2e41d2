"""Probe: can a cold column reshard read fewer bytes than a whole-file read and still finish sooner?

One TP=4 rank loading a column slice of bf16 rows of 8 KiB needs 2 KiB of each row. A page (4 KiB) is the
least the kernel reads, so the fewest device bytes are one page per row: half the file. Stock DCP reads the
whole file in one request. This probe times, on a cold page cache (``POSIX_FADV_DONTNEED`` before each
read), the whole file in one ``preadv`` against one page per row read by 1..64 threads (``POSIX_FADV_RANDOM``,
so no read-ahead brings the skipped pages in), interleaved per round; medians. No checksums, no copies:
the raw device's bound for each pattern.

    python benchmarks/probe_strided_reads.py --dir /var/tmp --mib 128 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

PAGE = 4096


def _drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _whole(path: str, size: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [bytearray(size)], 0)
    finally:
        os.close(fd)


def _page_per_row(path: str, size: int, row: int, threads: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    rows = size // row
    out = memoryview(bytearray(rows * PAGE))

    def read(t: int) -> None:
        for r in range(t, rows, threads):
            os.preadv(fd, [out[r * PAGE : (r + 1) * PAGE]], r * row)

    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, range(threads)))
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/var/tmp", help="a folder on the device to measure (not tmpfs)")
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--row-bytes", type=int, default=8192, help="bytes per row (bf16 x 4096 columns: 8192)")
    parser.add_argument("--threads", default="1,8,32,64")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default="probe_strided_reads.json")
    args = parser.parse_args()
    if args.row_bytes < 2 * PAGE or args.row_bytes % PAGE:
        raise SystemExit(f"--row-bytes must be a multiple of {PAGE} and at least {2 * PAGE}")
    size = args.mib << 20
    path = os.path.join(args.dir, f"probe_strided_{os.getpid()}.bin")
    with open(path, "wb") as f:
        for _ in range(args.mib):
            f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())
    cases: dict[str, Callable[[], None]] = {"whole file, one preadv": lambda: _whole(path, size)}
    for n in map(int, args.threads.split(",")):
        cases[f"a page per row, {n} threads"] = lambda n=n: _page_per_row(path, size, args.row_bytes, n)
    times: dict[str, list[float]] = {k: [] for k in cases}
    try:
        for _ in range(args.rounds):
            for name, run in cases.items():
                _drop(path)
                time.sleep(0.2)
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
    finally:
        os.unlink(path)
    whole = statistics.median(times["whole file, one preadv"])
    device_bytes = {k: size if k.startswith("whole") else size // args.row_bytes * PAGE for k in cases}
    print(f"{'pattern':<28} {'median s':>9} {'min..max':>14} {'device MiB':>11} {'whole/this':>10}")
    for name, ts in times.items():
        med = statistics.median(ts)
        span = f"{min(ts):.3f}..{max(ts):.3f}"
        print(f"{name:<28} {med:9.3f} {span:>14} {device_bytes[name] >> 20:11d} {whole / med:10.2f}")
    result = {
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "load": os.getloadavg(),
        "mib": args.mib,
        "row_bytes": args.row_bytes,
        "times": times,
        "device_bytes": device_bytes,
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

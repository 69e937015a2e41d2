"""``verify_checkpoint`` against a raw read of the same files, on local disk and on S3 (moto on loopback).

A verify reads every byte of a committed checkpoint and checks each block's checksum. What it should cost
is a download of the same files; what it cost before ``d7f1a40`` was one ranged request per check unit
(16 KiB units for 1-D tensors: 64 requests per MiB, a round trip each on S3). Contenders, interleaved
and rotated per round, medians of the rounds:

* ``verify``: ``verify_checkpoint`` as shipped (adjacent check units read together, up to 16 MiB a request);
* ``verify, a request per unit``: the same with the batching limit set to 0 (the old behaviour);
* ``raw read``: every file of the checkpoint read whole through the same fsspec filesystem (``cat_file``).

Ranged GETs are counted on the client (``s3fs.core.S3File._fetch_range`` wrapped). moto runs in a child
process (``_s3server``), so its CPU is not the client's; on real S3 each request is a network round trip,
so the request counts matter more than moto's times.

    python benchmarks/bench_verify.py               # 40 MiB of 1 MiB 1-D tensors + 2-D ones, 3 rounds
    python benchmarks/bench_verify.py --quick       # 8 MiB, 1 round, disk and S3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _s3server import S3Endpoint, start_moto  # noqa: E402

import smpckpt.storage.tools as storage_tools  # noqa: E402
from smpckpt import ParallelLayout  # noqa: E402
from smpckpt.planners import ParallelSavePlanner  # noqa: E402
from smpckpt.storage import FsspecStorageWriter, open_fs, verify_checkpoint  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20


def state(total_mib: int) -> dict[str, torch.Tensor]:
    """Half the bytes as 1-D tensors of 1 MiB (16 KiB check units), half as 2-D ones (tiles)."""
    g = torch.Generator().manual_seed(0)
    n = max(1, total_mib // 2)
    sd = {f"v{i}": torch.randn(MiB // 4, generator=g) for i in range(n)}
    sd.update({f"m{i}": torch.randn(512, 512, generator=g) for i in range(n)})
    return sd


class GetCounter:
    """Counts the ranged GETs s3fs makes (every read of an open S3 file goes through ``_fetch_range``)."""

    def __init__(self) -> None:
        import s3fs

        self.count = 0
        self._file = s3fs.core.S3File
        self._orig = self._file._fetch_range
        counter = self

        def counting(f: Any, start: int, end: int) -> bytes:
            counter.count += 1
            return counter._orig(f, start, end)

        self._file._fetch_range = counting

    def close(self) -> None:
        self._file._fetch_range = self._orig


def raw_read(url: str, options: dict[str, Any] | None) -> int:
    fs, path = open_fs(url, options)
    total = 0
    for name in fs.find(path):
        total += len(fs.cat_file(name))
    return total


def verify(url: str, options: dict[str, Any] | None, per_unit: bool) -> int:
    saved = storage_tools._READ_CHUNK
    storage_tools._READ_CHUNK = 0 if per_unit else saved  # 0: every unit alone (each is larger than 0)
    try:
        report = verify_checkpoint(url, options)
    finally:
        storage_tools._READ_CHUNK = saved
    if not report.ok:
        raise SystemExit(f"verify found problems in a fresh checkpoint: {report.problems}")
    return report.bytes_checked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--storage", default="disk,s3", help="comma list of disk, s3")
    ap.add_argument("--quick", action="store_true", help="8 MiB, 1 round")
    ap.add_argument("--json", default=os.path.join(HERE, "out", "verify.json"))
    args = ap.parse_args()
    if args.quick:
        args.size_mib, args.rounds = 8, 1
    sd = state(args.size_mib)
    nbytes = sum(t.nbytes for t in sd.values())
    endpoint: S3Endpoint | None = None
    results: dict[str, Any] = {}
    counter = GetCounter()
    try:
        with tempfile.TemporaryDirectory(prefix="bench_verify_") as tmp:
            for where in args.storage.split(","):
                if where == "disk":
                    url, options = os.path.join(tmp, "ckpt"), None
                elif where == "s3":
                    endpoint = endpoint or start_moto("bench-verify")
                    url, options = f"s3://{endpoint.bucket}/ckpt", endpoint.options
                else:
                    raise SystemExit(f"--storage: unknown {where!r} (disk, s3)")
                dcp.save(
                    sd,
                    storage_writer=FsspecStorageWriter(url, storage_options=options),
                    planner=ParallelSavePlanner(ParallelLayout()),
                )
                cases: dict[str, Callable[[], Any]] = {
                    "verify": lambda u=url, o=options: verify(u, o, per_unit=False),
                    "verify, a request per unit": lambda u=url, o=options: verify(u, o, per_unit=True),
                    "raw read": lambda u=url, o=options: raw_read(u, o),
                }
                times: dict[str, list[float]] = {k: [] for k in cases}
                gets: dict[str, int] = {}
                names = list(cases)
                for rnd in range(args.rounds + 1):  # round 0 warms up (page cache, connections)
                    order = names[rnd % len(names) :] + names[: rnd % len(names)]
                    for name in order:
                        before = counter.count
                        start = time.perf_counter()
                        cases[name]()
                        seconds = time.perf_counter() - start
                        if rnd:
                            times[name].append(seconds)
                            gets[name] = counter.count - before
                results[where] = {
                    name: {
                        "s_median": statistics.median(ts),
                        "s": ts,
                        "ranged_gets": gets[name] if where == "s3" else None,
                    }
                    for name, ts in times.items()
                }
    finally:
        counter.close()
        if endpoint is not None:
            endpoint.stop()
    print(f"\nverify_checkpoint of {nbytes / MiB:.0f} MiB ({len(sd)} tensors), {args.rounds} rounds, medians")
    print(f"{'storage':8s} {'case':28s} {'s':>8s} {'x raw':>7s} {'ranged GETs':>12s}")
    for where, rows in results.items():
        raw = rows["raw read"]["s_median"]
        for name, row in rows.items():
            gets_col = "" if row["ranged_gets"] is None else str(row["ranged_gets"])
            print(f"{where:8s} {name:28s} {row['s_median']:8.3f} {row['s_median'] / raw:7.2f} {gets_col:>12s}")
    out = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "bytes": nbytes,
        "rounds": args.rounds,
        "results": results,
    }
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()

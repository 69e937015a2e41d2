"""Save/load throughput of smpckpt's FsspecStorageWriter/Reader against DCP, torch.save and raw I/O.

One run, same state for every contender, interleaved rounds after a warm-up; reports medians of
per-round times and of per-round ratios (design notes 4b):

* disk (``--disk-dir``): time until durable -- fsync inside every timer. Target: ours >= 0.9x raw
  write+fsync of the same bytes.
* tmpfs (``/dev/shm``): nothing caps the CPU. Target: ours >= 2x DCP FileSystemWriter defaults.
* S3 on a loopback moto server started here (smaller state, ``--s3-size-mb``): ours vs DCP FsspecWriter.

Loads read from the page cache (it cannot be dropped here) into preallocated tensors.

    python benchmarks/bench_storage.py                 # ~1 GiB, 3 rounds
    python benchmarks/bench_storage.py --quick         # small smoke run
    python benchmarks/bench_storage.py --out results.json
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
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter

warnings.filterwarnings("ignore")

State = dict[str, torch.Tensor]


def make_state(size_mb: int) -> State:
    n = max(1, size_mb // 64) if size_mb >= 64 else 1
    per = size_mb * (1 << 20) // n // 4
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(n)}


def nbytes(sd: State) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def fsync_tree(path: str, *, drop_cache: bool = False) -> None:
    """fsync every file under ``path`` and the folder (for contenders that do not sync themselves).
    ``drop_cache``: then evict each file from the page cache (cold loads; dirty pages cannot be dropped,
    hence after the fsync)."""
    for root, _dirs, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                if drop_cache:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# -- contenders: (save(sd, path), load(dest, path)) ------------------------------------------------
def raw_save(sd: State, path: str) -> None:
    os.makedirs(path, exist_ok=True)
    fd = os.open(os.path.join(path, "blob"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in sd.values():
            mv = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            while mv:
                mv = mv[os.write(fd, mv) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def raw_load(dest: State, path: str) -> None:
    with open(os.path.join(path, "blob"), "rb", buffering=0) as f:
        for t in dest.values():
            mv = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            while mv:
                mv = mv[f.readinto(mv) :]


def torch_save(sd: State, path: str) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "sd.pt"), "wb") as f:
        torch.save(sd, f)
        f.flush()
        os.fsync(f.fileno())


def torch_load(dest: State, path: str) -> None:
    loaded = torch.load(os.path.join(path, "sd.pt"), weights_only=True)
    for k, t in dest.items():
        t.copy_(loaded[k])


def dcp_fs_save(threads: int) -> Callable[[State, str], None]:
    return lambda sd, path: dcp.save(sd, storage_writer=FileSystemWriter(path, thread_count=threads))


def dcp_fs_load(dest: State, path: str) -> None:
    dcp.load(dest, storage_reader=FileSystemReader(path))


def dcp_fsspec_save(sd: State, path: str) -> None:
    dcp.save(sd, storage_writer=FsspecWriter(path))


def dcp_fsspec_load(dest: State, path: str) -> None:
    dcp.load(dest, storage_reader=FsspecReader(path))


def ours_save(sd: State, path: str) -> None:
    dcp.save(sd, storage_writer=FsspecStorageWriter(path, overwrite=True))


def ours_load(dest: State, path: str) -> None:
    dcp.load(dest, storage_reader=FsspecStorageReader(path))


LOCAL: dict[str, tuple[Callable[[State, str], None], Callable[[State, str], None]]] = {
    "raw write+fsync / read": (raw_save, raw_load),
    "smpckpt FsspecStorageWriter": (ours_save, ours_load),
    "DCP FileSystemWriter defaults": (dcp_fs_save(1), dcp_fs_load),
    "DCP FileSystemWriter thread_count=4": (dcp_fs_save(4), dcp_fs_load),
    "DCP FsspecWriter defaults": (dcp_fsspec_save, dcp_fsspec_load),
    "torch.save+fsync / torch.load": (torch_save, torch_load),
}


def bench_local(sd: State, base: str, rounds: int, log: Callable[[str], None]) -> dict[str, Any]:
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    names = list(LOCAL)
    times: dict[str, dict[str, list[float]]] = {n: {"save": [], "load": []} for n in names}
    for r in range(rounds + 1):  # round 0 is the warm-up
        order = names[r % len(names) :] + names[: r % len(names)]  # rotate so no contender always goes first
        for name in order:
            save, load = LOCAL[name]
            path = tempfile.mkdtemp(prefix="bench-", dir=base)
            shutil.rmtree(path)
            t0 = time.perf_counter()
            save(sd, path)
            t1 = time.perf_counter()
            for t in dest.values():
                t.zero_()
            t2 = time.perf_counter()
            load(dest, path)
            t3 = time.perf_counter()
            if not all(torch.equal(dest[k], sd[k]) for k in sd):
                raise RuntimeError(f"{name}: loaded state differs")
            shutil.rmtree(path)
            if r:
                times[name]["save"].append(t1 - t0)
                times[name]["load"].append(t3 - t2)
            log(f"  round {r}{' (warm-up)' if not r else ''} {name:38s} save {t1 - t0:6.2f}s load {t3 - t2:6.2f}s")
    return {"times": times}


def summarize(times: dict[str, dict[str, list[float]]], size: int, ref: str) -> dict[str, Any]:
    ours = "smpckpt FsspecStorageWriter"
    out: dict[str, Any] = {}
    for name, t in times.items():
        row: dict[str, Any] = {}
        for op in ("save", "load"):
            med = statistics.median(t[op])
            row[f"{op}_s"] = med
            row[f"{op}_GBps"] = size / med / 1e9
            # ours' speed relative to this contender, median over rounds of per-round ratios
            row[f"ours_speedup_{op}"] = statistics.median(a / b for a, b in zip(t[op], times[ours][op]))
        out[name] = row
    out["_ref"] = ref
    return out


def print_table(title: str, summary: dict[str, Any]) -> None:
    print(f"\n{title}")
    print(f"{'contender':40s} {'save s':>8s} {'GB/s':>6s} {'ours x':>7s} | {'load s':>8s} {'GB/s':>6s} {'ours x':>7s}")
    for name, row in summary.items():
        if name.startswith("_"):
            continue
        print(
            f"{name:40s} {row['save_s']:8.2f} {row['save_GBps']:6.2f} {row['ours_speedup_save']:7.2f} | "
            f"{row['load_s']:8.2f} {row['load_GBps']:6.2f} {row['ours_speedup_load']:7.2f}"
        )


# -- S3 on loopback moto -------------------------------------------------------------------------
def bench_s3(sd: State, rounds: int, log: Callable[[str], None]) -> dict[str, Any]:
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    os.environ["AWS_ENDPOINT_URL"] = "http://127.0.0.1:9"  # a lost endpoint fails locally
    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        ).create_bucket(Bucket="bench")
        opts = {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        }
        dest = {k: torch.zeros_like(v) for k, v in sd.items()}
        contenders = {
            "smpckpt FsspecStorageWriter": (
                lambda p: dcp.save(sd, storage_writer=FsspecStorageWriter(p, storage_options=opts, overwrite=True)),
                lambda p: dcp.load(dest, storage_reader=FsspecStorageReader(p, storage_options=opts)),
            ),
            "DCP FsspecWriter sync_files=False": (
                lambda p: dcp.save(sd, storage_writer=FsspecWriter(p, sync_files=False, **opts)),
                lambda p: dcp.load(dest, storage_reader=FsspecReader(p, **opts)),
            ),
        }
        times: dict[str, dict[str, list[float]]] = {n: {"save": [], "load": []} for n in contenders}
        names = list(contenders)
        for r in range(rounds + 1):
            for name in names[r % 2 :] + names[: r % 2]:
                path = f"s3://bench/r{r}-{names.index(name)}"
                save, load = contenders[name]
                t0 = time.perf_counter()
                save(path)
                t1 = time.perf_counter()
                for t in dest.values():
                    t.zero_()
                t2 = time.perf_counter()
                load(path)
                t3 = time.perf_counter()
                if not all(torch.equal(dest[k], sd[k]) for k in sd):
                    raise RuntimeError(f"{name}: S3 loaded state differs")
                if r:
                    times[name]["save"].append(t1 - t0)
                    times[name]["load"].append(t3 - t2)
                log(f"  s3 round {r} {name:38s} save {t1 - t0:6.2f}s load {t3 - t2:6.2f}s")
        return {"times": times}
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--s3-size-mb", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--disk-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    ap.add_argument("--shm-dir", default="/dev/shm")
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument("--quick", action="store_true", help="small smoke run (64 MiB, 1 round, 32 MiB on S3)")
    ap.add_argument("--out", default=None, help="write results as JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        args.size_mb, args.s3_size_mb, args.rounds = 64, 32, 1
    log = lambda s: print(s, flush=True)  # noqa: E731
    sd = make_state(args.size_mb)
    size = nbytes(sd)
    env = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "bytes": size,
        "rounds": args.rounds,
    }
    results: dict[str, Any] = {"env": env}
    os.makedirs(args.disk_dir, exist_ok=True)
    log(f"disk ({args.disk_dir}), {size / 2**20:.0f} MiB, fsync inside every timer")
    results["disk"] = summarize(
        bench_local(sd, args.disk_dir, args.rounds, log)["times"], size, "raw write+fsync / read"
    )
    if os.path.isdir(args.shm_dir):
        log(f"tmpfs ({args.shm_dir})")
        results["shm"] = summarize(
            bench_local(sd, args.shm_dir, args.rounds, log)["times"], size, "DCP FileSystemWriter defaults"
        )
    if not args.no_s3:
        s3_sd = make_state(args.s3_size_mb)
        log(f"S3 on loopback moto, {nbytes(s3_sd) / 2**20:.0f} MiB")
        results["s3"] = summarize(
            bench_s3(s3_sd, max(1, args.rounds - 1), log)["times"], nbytes(s3_sd), "DCP FsspecWriter"
        )
    print_table("DISK (ours x = contender time / ours time, median of per-round ratios)", results["disk"])
    if "shm" in results:
        print_table("TMPFS /dev/shm", results["shm"])
    if "s3" in results:
        print_table("S3 (moto on loopback; moto is the bottleneck)", results["s3"])
    d = results["disk"]
    print(
        f"\ndisk save: ours speed relative to raw write+fsync = "
        f"{d['raw write+fsync / read']['ours_speedup_save']:.2f} (target >= 0.9)"
    )
    if "shm" in results:
        print(
            f"tmpfs save: ours speedup over DCP FileSystemWriter defaults = "
            f"{results['shm']['DCP FileSystemWriter defaults']['ours_speedup_save']:.2f} (target >= 2)"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""DCP save/load to S3 (moto on loopback): smpckpt vs s3torchconnector vs DCP's FsspecWriter/Reader.

A moto server runs as a *separate process* (``moto_server`` on 127.0.0.1, a free port), so its CPU --
the bottleneck on this box -- is not counted as client CPU; its access log gives request counts. Every
contender saves the same state into a fresh prefix and loads it back into zeroed tensors (checked
bit-exact outside the timers); the objects are deleted after each round. Rounds are interleaved and
rotated after a warm-up; the report quotes medians of per-round ratios against s3torchconnector
(design notes 4b):

* speed = s3torchconnector's time / the contender's time (> 1: faster);
* client CPU = this process's CPU time (``time.process_time``: every thread, CRT's included) over
  s3torchconnector's.

Contenders:

* ``smpckpt``: ``FsspecStorageWriter``/``FsspecStorageReader`` (s3fs underneath) with
  ``ParallelSavePlanner``/``ParallelLoadPlanner``;
* ``s3tc``: s3torchconnector's ``S3StorageWriter``/``S3StorageReader`` (defaults; CRT client pointed
  at the server with ``endpoint=``);
* ``fsspec``: DCP's ``FsspecWriter(sync_files=False)``/``FsspecReader`` over s3fs (defaults otherwise).

    python benchmarks/bench_s3.py                        # 512 MiB (121 tensors), 3 rounds
    python benchmarks/bench_s3.py --quick                # ~32 MiB, 1 round
    python benchmarks/bench_s3.py --profile out/prof     # + cProfile of one smpckpt save and load
    python benchmarks/bench_s3.py --part-mb 16 --save-only --only smpckpt   # a part size, saves only
    python benchmarks/bench_s3.py --object-file-mb 0 --only smpckpt        # thread_count files per rank
    torchrun --nproc-per-node 2 benchmarks/bench_s3.py   # gloo; each rank saves its own share
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import os
import platform
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from bench_storage import nbytes

from smpckpt.model.layout import ParallelLayout
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter

warnings.filterwarnings("ignore")

State = dict[str, torch.Tensor]
BUCKET = "bench"
REGION = "us-east-1"
REF = "s3tc"


def make_state(size_mb: int, prefix: str = "") -> State:
    """A GPT-like state of ~``size_mb`` MiB: 24 layers x (qkv, proj, fc1, fc2, ln) + an embedding."""
    target = size_mb << 20
    h = max(32, int((target * 0.9 / (24 * 12 * 4)) ** 0.5) // 32 * 32)
    g = torch.Generator().manual_seed(0)
    sd: State = {}
    for i in range(24):
        p = f"{prefix}layers.{i}."
        sd[p + "qkv.weight"] = torch.randn(3 * h, h, generator=g)
        sd[p + "proj.weight"] = torch.randn(h, h, generator=g)
        sd[p + "fc1.weight"] = torch.randn(4 * h, h, generator=g)
        sd[p + "fc2.weight"] = torch.randn(h, 4 * h, generator=g)
        sd[p + "ln.weight"] = torch.randn(h, generator=g)
    rest = max(h, (target - nbytes(sd)) // 4 // h * h)
    sd[prefix + "embed.weight"] = torch.randn(rest // h, h, generator=g)
    return sd


# -- the server --------------------------------------------------------------------------------------
class Moto:
    """``moto_server`` in a child process; its werkzeug access log is the request count."""

    def __init__(self, workdir: str) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(workdir, "moto.log")
        env = dict(os.environ, TMPDIR=workdir, MOTO_S3_DEFAULT_KEY_BUFFER_SIZE=str(4 << 30))
        exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [exe, "-H", "127.0.0.1", "-p", str(self.port)], stdout=self._log, stderr=subprocess.STDOUT, env=env
        )
        import requests

        for _ in range(200):
            try:
                requests.get(f"{self.endpoint}/moto-api/", timeout=1)
                break
            except requests.ConnectionError:
                time.sleep(0.1)
        else:
            raise RuntimeError("moto_server did not start")
        self.client().create_bucket(Bucket=BUCKET)

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def cpu(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def log_offset(self) -> int:
        self._log.flush()
        return os.path.getsize(self.log_path)

    def requests_since(self, offset: int) -> dict[str, int]:
        time.sleep(0.05)  # the log line is written as the response goes out
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            # werkzeug colours the lines of non-200 replies: drop the ANSI escapes
            text = re.sub(r"\x1b\[[0-9;]*m", "", f.read().decode("utf-8", "replace"))
        counts: dict[str, int] = {}
        for m in re.finditer(r'"(GET|PUT|POST|HEAD|DELETE) (\S+) HTTP', text):
            kind = classify(m.group(1), m.group(2))
            counts[kind] = counts.get(kind, 0) + 1
        return counts

    def empty(self, prefix: str) -> None:
        c = self.client()
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                c.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})
        for up in c.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", []):
            c.abort_multipart_upload(Bucket=BUCKET, Key=up["Key"], UploadId=up["UploadId"])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


def classify(method: str, target: str) -> str:
    query = target.partition("?")[2]
    if method == "PUT":
        return "UploadPart" if "partNumber=" in query else "PUT"
    if method == "POST":
        if "uploadId=" in query:
            return "CompleteMPU"
        return "CreateMPU" if "uploads" in query else ("DeleteObjects" if "delete" in query else "POST")
    if method == "GET":
        return "LIST" if ("list-type" in query or "prefix=" in query or "uploads" in query) else "GET"
    if method == "DELETE":
        return "AbortMPU" if "uploadId=" in query else "DELETE"
    return method


# -- contenders: (save(path), load(path)) ------------------------------------------------------------
Ops = tuple[Callable[[str], None], Callable[[str], None]]


def contenders(sd: State, dest: State, endpoint: str, ours: dict[str, Any] | None = None) -> dict[str, Ops]:
    """``ours``: FsspecStorageWriter options (its defaults when empty)."""
    opts = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}
    layout = ParallelLayout()
    kwargs = ours or {}

    def ours_save(path: str) -> None:
        writer = FsspecStorageWriter(path, storage_options=opts, **kwargs)
        dcp.save(sd, storage_writer=writer, planner=ParallelSavePlanner(layout))

    def ours_load(path: str) -> None:
        dcp.load(
            dest, storage_reader=FsspecStorageReader(path, storage_options=opts), planner=ParallelLoadPlanner(layout)
        )

    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
    from s3torchconnector.dcp.s3_file_system import S3FileSystem

    cfg = S3ClientConfig(force_path_style=True)

    def s3tc_fs(reader_constructor: Any = None) -> Any:
        # the DCP classes take no endpoint: give them a client that has one
        client = S3Client(REGION, endpoint=endpoint, s3client_config=cfg)
        return S3FileSystem(REGION, s3_client=client, reader_constructor=reader_constructor)

    def s3tc_save(path: str) -> None:
        w = S3StorageWriter(REGION, path, s3client_config=cfg)
        w.fs = s3tc_fs()
        dcp.save(sd, storage_writer=w)

    def s3tc_load(path: str) -> None:
        r = S3StorageReader(REGION, path, s3client_config=cfg)
        r.fs = s3tc_fs(r._reader_constructor)
        dcp.load(dest, storage_reader=r)

    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    def fsspec_save(path: str) -> None:
        dcp.save(sd, storage_writer=FsspecWriter(path, sync_files=False, **opts))

    def fsspec_load(path: str) -> None:
        dcp.load(dest, storage_reader=FsspecReader(path, **opts))

    return {"smpckpt": (ours_save, ours_load), REF: (s3tc_save, s3tc_load), "fsspec": (fsspec_save, fsspec_load)}


# -- measurement ---------------------------------------------------------------------------------------
def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _max(x: float) -> float:
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _sum(x: float) -> float:
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


def measure(fn: Callable[[str], None], path: str, moto: Moto | None) -> dict[str, Any]:
    """Wall time (slowest rank), client CPU (all ranks), moto CPU and requests of one operation."""
    _barrier()
    off, mcpu = (moto.log_offset(), moto.cpu()) if moto else (0, 0.0)
    c0, t0 = time.process_time(), time.perf_counter()
    fn(path)
    t1, c1 = time.perf_counter(), time.process_time()
    _barrier()
    out: dict[str, Any] = {"s": _max(t1 - t0), "cpu": _sum(c1 - c0)}
    if moto:
        out["moto_cpu"] = moto.cpu() - mcpu
        out["requests"] = moto.requests_since(off)
    return out


def run_rounds(
    ops: dict[str, Ops],
    sd: State,
    dest: State,
    moto: Moto | None,
    rounds: int,
    log: Callable[[str], None],
    save_only: bool = False,
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    names = list(ops)
    rec: dict[str, dict[str, list[dict[str, Any]]]] = {n: {"save": [], "load": []} for n in names}
    for r in range(rounds + 1):  # round 0 is the warm-up
        for name in names[r % len(names) :] + names[: r % len(names)]:
            prefix = f"r{r}-{name}"
            path = f"s3://{BUCKET}/{prefix}"
            save, load = ops[name]
            s = measure(save, path, moto)
            for t in dest.values():
                t.zero_()
            ld = measure((lambda p: None) if save_only else load, path, moto)
            if not save_only and not all(torch.equal(dest[k], sd[k]) for k in sd):
                raise RuntimeError(f"{name}: loaded state differs from the saved one")
            _barrier()
            if moto:
                moto.empty(prefix + "/")
            _barrier()
            if r:
                rec[name]["save"].append(s)
                rec[name]["load"].append(ld)
            req = lambda m: sum(m.get("requests", {}).values())  # noqa: E731
            log(
                f"  round {r}{' (warm-up)' if not r else '          '} {name:8s} save {s['s']:6.2f}s cpu "
                f"{s['cpu']:5.2f} req {req(s):4d} | load {ld['s']:6.2f}s cpu {ld['cpu']:5.2f} req {req(ld):4d}"
            )
    return rec


def summarize(rec: dict[str, dict[str, list[dict[str, Any]]]], size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, ops in rec.items():
        row: dict[str, Any] = {}
        for op, runs in ops.items():
            ref = rec[REF][op]
            speed = [b["s"] / max(a["s"], 1e-9) for a, b in zip(runs, ref)]
            cpu = [a["cpu"] / max(b["cpu"], 1e-9) for a, b in zip(runs, ref)]
            med_s = statistics.median(m["s"] for m in runs)
            row[op] = {
                "s": med_s,
                "MBps": size / med_s / 1e6,
                "cpu_s": statistics.median(m["cpu"] for m in runs),
                "moto_cpu_s": statistics.median(m.get("moto_cpu", 0.0) for m in runs),
                "speed_vs_s3tc": statistics.median(speed),
                "speed_vs_s3tc_range": [min(speed), max(speed)],
                "cpu_vs_s3tc": statistics.median(cpu),
                "cpu_vs_s3tc_range": [min(cpu), max(cpu)],
                "requests": runs[-1].get("requests", {}),
                "rounds": runs,
            }
        out[name] = row
    return out


def print_table(summary: dict[str, Any]) -> None:
    head = f"{'contender':9s} {'op':4s} {'s':>7s} {'MB/s':>6s} {'speed x s3tc':>18s} {'CPU s':>6s} {'CPU x s3tc':>18s}"
    print(f"\n{head} {'moto CPU':>8s}  requests")
    for name, row in summary.items():
        for op in ("save", "load"):
            m = row[op]
            sp, cp = m["speed_vs_s3tc_range"], m["cpu_vs_s3tc_range"]
            reqs = ", ".join(f"{k} {v}" for k, v in sorted(m["requests"].items()))
            print(
                f"{name:9s} {op:4s} {m['s']:7.2f} {m['MBps']:6.1f} {m['speed_vs_s3tc']:6.2f} ({sp[0]:.2f}-{sp[1]:.2f})"
                f" {m['cpu_s']:6.2f} {m['cpu_vs_s3tc']:6.2f} ({cp[0]:.2f}-{cp[1]:.2f}) {m['moto_cpu_s']:8.2f}  {reqs}"
            )


def profile(ops: Ops, dest: State, out_dir: str, log: Callable[[str], None]) -> None:
    """cProfile one save and one load (cumulative top 40 to ``out_dir``/{save,load}.txt and .pstats)."""
    os.makedirs(out_dir, exist_ok=True)
    path = f"s3://{BUCKET}/profile-{int(time.time())}"
    for op, fn in zip(("save", "load"), ops):
        if op == "load":
            for t in dest.values():
                t.zero_()
        prof = cProfile.Profile()
        prof.enable()
        fn(path)
        prof.disable()
        prof.dump_stats(os.path.join(out_dir, f"{op}.pstats"))
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(40)
        with open(os.path.join(out_dir, f"{op}.txt"), "w") as f:
            f.write(buf.getvalue())
        log(f"profile of smpckpt {op}: {out_dir}/{op}.txt")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=512, help="state size per rank")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="~32 MiB, 1 round (smoke run)")
    ap.add_argument("--only", default="", help="comma-separated subset of smpckpt,s3tc,fsspec (s3tc always runs)")
    ap.add_argument("--part-mb", type=int, default=0, help="smpckpt part_size in MiB (0: the writer's default)")
    ap.add_argument("--threads", type=int, default=0, help="smpckpt thread_count (0: the writer's default)")
    ap.add_argument(
        "--object-file-mb",
        type=int,
        default=-1,
        help="smpckpt object_file_size in MiB (-1: default; 0: thread_count files)",
    )
    ap.add_argument("--save-only", action="store_true", help="time saves only (no loads, no bit-exact check)")
    ap.add_argument("--profile", default="", help="folder: also cProfile one smpckpt save and load")
    ap.add_argument("--out", default=None, help="write results as JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        args.size_mb, args.rounds = 32, 1
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = _rank()
    log = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)  # noqa: E731
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    workdir = tempfile.mkdtemp(prefix="bench-s3-")
    moto = Moto(workdir) if rank == 0 else None
    box = [moto.endpoint if moto else ""]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    endpoint = box[0]
    try:
        sd = make_state(args.size_mb, prefix=f"rank{rank}." if dist.is_initialized() else "")
        dest = {k: torch.zeros_like(v) for k, v in sd.items()}
        size = int(_sum(nbytes(sd)))
        ours: dict[str, Any] = {"part_size": args.part_mb << 20} if args.part_mb else {}
        if args.threads:
            ours["thread_count"] = args.threads
        if args.object_file_mb >= 0:
            ours["object_file_size"] = args.object_file_mb << 20
        all_ops = contenders(sd, dest, endpoint, ours)
        keep = {n for n in args.only.split(",") if n} | {REF}
        ops = {n: o for n, o in all_ops.items() if not args.only or n in keep}
        log(
            f"S3 on loopback moto ({endpoint}), {size / 2**20:.0f} MiB in {len(sd)} tensors per rank, {args.rounds} rounds"
        )
        rec = run_rounds(ops, sd, dest, moto, args.rounds, log, args.save_only)
        summary = summarize(rec, size)
        if rank == 0:
            print_table(summary)
        if args.profile and rank == 0 and not dist.is_initialized():
            profile(all_ops["smpckpt"], dest, args.profile, log)
        if args.out and rank == 0:
            env = {
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "python": sys.version.split()[0],
                "torch": torch.__version__,
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "bytes": size,
                "tensors_per_rank": len(sd),
                "rounds": args.rounds,
                "argv": sys.argv,
            }
            with open(args.out, "w") as f:
                json.dump({"env": env, "results": summary}, f, indent=1)
    finally:
        if moto:
            moto.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

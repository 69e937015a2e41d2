"""Tiered checkpoints (issue 36): the fast-tier save (with and without replication) against a direct save
to the durable root, the background drain, and resume from either tier.

4 gloo ranks on this machine simulate 2 nodes x 2 ranks (``LOCAL_WORLD_SIZE=2``: ranks 0, 1 on node 0,
ranks 2, 3 on node 1); each node's fast tier is its own folder ``<shm>/.../node<n>`` (``/dev/shm`` by
default). Every rank holds distinct data: ``--size-mib`` of fp32 ``Linear(hidden, hidden)`` weights in
total, TP-sharded on dim 0 over the 4 ranks (``ParallelLayout(tp=4)``, spec ``ShardSpec(0)``), so each
rank writes its own quarter. The durable root is a folder on disk (``--disk-dir``, not tmpfs) standing in
for a shared filesystem, or ``s3://`` on a moto server in a child process on loopback.

Three phases, each 1 warm-up round + ``--rounds`` measured rounds, contenders in an order rotated per
round; barriers before and after every timer, wall time = rank 0's (the slowest rank's end):

* save: (a) ``save_checkpoint(..., local_path=node folder, replicas=2)``, timed until it returns (every
  node's fast tier committed, each rank's files also sent over gloo to the other node), with
  ``durable_every`` so large that it never drains; (b) the same with ``replicas=1`` (no replication);
  (c) a plain (untiered) save to a folder under ``--shm-dir``: the goal is (a) <= 1.2x (c), replication
  included; (d) a direct save to the disk folder (fsynced: durable); (e) a direct save to S3. Each copy is
  removed outside the timer (``num_kept_local=None``, so no retention runs inside it). Every row also
  shows its time over (c)'s, per round.
* drain: a tiered save (replicas=2) with ``durable_every=1`` to the disk folder and to S3; *blocking* =
  the save call, *drain* = from its return until ``wait_for_saves()`` returned on every rank (nothing
  else runs meanwhile; in training the drain overlaps the steps), with the CPU seconds all ranks' threads
  used meanwhile (the drain reads each fast-tier file once, checking its blocks as it copies them). The
  drained copy is checked committed.
* resume (one checkpoint of each kind saved first): from the fast tier with both nodes' folders intact;
  after node 1's folder was deleted (its ranks' parts fetched from node 0 over gloo: ``from_peers``);
  from the durable disk folder with its files dropped from the page cache (``posix_fadvise(DONTNEED)``
  after an fsync; the ranks' ``read_bytes`` from ``/proc/self/io`` prove it) and in the page cache; from
  S3. Every resume is checked bit-exact against the saved tensors, and ``last_resume_info().tier``.
  (A resume after the loss heals node 1's folder with the parts its ranks read, so the next "intact"
  resume reads the same local files as before; node 0's replicas are not restored there.)

Pauses: every timed operation starts ``--settle`` seconds (default 2) after the previous one and its
clean-up, so that each starts from the same state, as saves minutes apart in training would. Back to
back, an operation here can reuse memory its predecessor just freed: a drain to the disk folder took
0.3-0.4 s right after another one and 0.8-1.0 s after a 2 or 5 s pause (2-vCPU Firecracker VM, whose
balloon device reports freed guest memory to the host, ``VIRTIO_BALLOON_F_REPORTING``: probably the
cause; touching 2 GiB of fresh memory took 0.45-0.55 s back to back, 0.57-0.81 s after 3-6 s pauses).

Noise: per phase, the CPU seconds the ranks, the moto server and every other process of the machine
used (``/proc/stat``; kernel threads such as writeback included) are recorded and printed: on a shared
machine, read them next to the times.

Ratios are medians of per-round ratios (min..max), measured in the same run.

    python benchmarks/bench_tiers.py            # 512 MiB over 4 ranks, 1 warm-up + 5 rounds (~4 min, 2 vCPU)
    python benchmarks/bench_tiers.py --quick    # 4 MiB, 1 warm-up + 1 round, no pauses (smoke test)
    python benchmarks/bench_tiers.py --no-s3    # the disk folder only
    python benchmarks/bench_tiers.py --phases drain --no-s3   # the drain alone (before/after a change to it)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import fsspec
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_storage import fsync_tree  # the one page-cache dropper of the benchmarks
from torch import nn

import smpckpt
from smpckpt import ParallelLayout, ShardSpec, last_resume_info, resume_from_checkpoint, save_checkpoint
from smpckpt.api._tiers import durable_key, job_folder
from smpckpt.storage import probe_checkpoint

warnings.filterwarnings("ignore")

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20
WORLD, LWS = 4, 2
LAYOUT = ParallelLayout(tp=WORLD, dp=1)
SPECS = {"model.layers.*.weight": ShardSpec(0)}
NEVER = 10**9  # durable_every that never drains within the run
SAVES = {
    "tier_r2": "fast tier, replicas=2",
    "tier_r1": "fast tier, replicas=1",
    "shm": "direct to a --shm-dir folder",
    "disk": "direct to disk folder",
    "s3": "direct to S3 (moto)",
}
DRAINS = {"drain_disk": "drain to disk folder", "drain_s3": "drain to S3 (moto)"}
RESUMES = {
    "fast": "fast tier, nodes intact",
    "fast_peer": "fast tier, node 1 lost",
    "disk_cold": "disk folder, cold cache",
    "disk_warm": "disk folder, page cache",
    "s3": "S3 (moto)",
}


# -- the state -------------------------------------------------------------------------------------
class Shards(nn.Module):
    """``layers`` bias-free ``Linear(hidden, hidden)``: this rank's ``rows`` (= hidden / WORLD) of each weight,
    its own random values (every rank holds different bytes)."""

    def __init__(self, layers: int, rows: int, hidden: int, rank: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1000 + rank)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            lin = nn.Linear(hidden, rows, bias=False, device="meta")
            lin.weight = nn.Parameter(torch.randn(rows, hidden, generator=g))
            self.layers.append(lin)


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def _pid_cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` (the moto server); 0 without one."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _host_cpu_s() -> tuple[float, float, float]:
    """CPU seconds the machine has spent so far: in processes (user, nice, system), in interrupts (irq,
    softirq: loopback TCP lands there too), and stolen by the hypervisor (/proc/stat)."""
    with open("/proc/stat") as f:
        t = [int(x) for x in f.readline().split()[1:9]]
    hz = os.sysconf("SC_CLK_TCK")
    return (t[0] + t[1] + t[2]) / hz, (t[5] + t[6]) / hz, t[7] / hz


# -- one rank --------------------------------------------------------------------------------------
def worker(rank: int, cfg: dict[str, Any]) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = str(LWS)
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=cfg["op_timeout_s"])
    init = f"file://{cfg['init_file']}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD, timeout=timeout)
    try:
        rec = Rank(rank, cfg).run()
        smpckpt.wait_for_saves()
        if rank == 0:
            with open(cfg["result_file"], "w") as f:
                json.dump(rec, f)
        dist.barrier()
        dist.destroy_process_group()
        gc.collect()
    except BaseException:  # noqa: BLE001 - printed; the parent sees the exit status and stops the rest
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    # no interpreter shutdown: gloo worker threads of the library's background groups could abort it
    # after the work succeeded (tests/dist_harness.py explains)
    os._exit(0)


class _PhaseLog(logging.Handler):
    """Keeps the step times of the last tiered save from its log line (``...; phases: plan 0.012s, ...``)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.last: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "to the fast tier" in text and "; phases: " in text:
            steps = text.rsplit("; phases: ", 1)[1].split(", ")
            self.last = {step.split()[0]: float(step.split()[1].rstrip("s")) for step in steps}


class Rank:
    def __init__(self, rank: int, cfg: dict[str, Any]) -> None:
        self.rank, self.cfg = rank, cfg
        self.node = rank // LWS
        self.leader = rank % LWS == 0
        self.model = Shards(cfg["layers"], cfg["rows"], cfg["hidden"], rank)
        self.expected = [p.detach().clone() for p in self.model.parameters()]
        self.nbytes = sum(p.numel() * p.element_size() for p in self.expected)
        self.s3 = cfg["s3"]  # {"root": "s3://bucket/prefix", "options": {...}} or None
        self.moto_pid: int | None = cfg["moto_pid"]
        self.log: Callable[[str], None] = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
        self.phases = _PhaseLog()  # the steps of each tiered save, as the library logs them
        logging.getLogger("smpckpt.api").addHandler(self.phases)
        logging.getLogger("smpckpt.api").setLevel(logging.INFO)

    # paths
    def local(self, kind: str) -> str:
        return os.path.join(self.cfg["shm"], kind, f"node{self.node}")

    def disk(self, name: str) -> str:
        return os.path.join(self.cfg["disk"], name)

    def root(self, where: str, name: str) -> tuple[str, dict[str, Any] | None]:
        if where == "s3":
            assert self.s3 is not None
            return f"{self.s3['root']}/{name}", self.s3["options"]
        if where == "shm":
            return os.path.join(self.cfg["shm"], "plain", name), None
        return self.disk(name), None

    def job(self, tier: str, where: str, name: str) -> str:
        """This node's folder of the job saving to ``where``/``name`` in the fast tier ``tier``."""
        root, opts = self.root(where, name)
        return job_folder(self.local(tier), durable_key(root, opts))

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * WORLD
        dist.all_gather_object(out, obj)
        return out

    # operations
    def save(self, where: str, name: str, tag: str, tier: str | None = None, **kw: Any) -> dict[str, float]:
        """The save; for a tiered one, this rank's seconds per step of it (``plan``, ``write`` -- its files
        written and, meanwhile, sent to the replica ranks --, ``replicas`` -- what it still received
        after --, ``agree``, ``commit``, ``retain``)."""
        root, opts = self.root(where, name)
        if tier is not None:
            kw.update(local_path=self.local(tier), num_kept_local=None)
        self.phases.last = {}
        save_checkpoint(root, tag, model=self.model, layout=LAYOUT, specs=SPECS, storage_options=opts, **kw)
        return self.phases.last

    def resume(self, where: str, name: str, tier: str | None = None) -> tuple[str, int, int]:
        """The tier it loaded from, and the files and bytes fetched from peers (all ranks' fetches)."""
        root, opts = self.root(where, name)
        kw = {"local_path": self.local(tier)} if tier is not None else {}
        resume_from_checkpoint(root, model=self.model, layout=LAYOUT, specs=SPECS, storage_options=opts, **kw)
        info = last_resume_info()
        assert info is not None
        if not info.from_peers:
            return info.tier, 0, 0
        assert tier is not None  # a fetched file is in its receiver's folder, and in its sender's: in every one
        folder = os.path.join(self.job(tier, where, name), f"{info.tag}_partial")
        return (
            info.tier,
            len(info.from_peers),
            sum(os.path.getsize(os.path.join(folder, f)) for f, _, _ in info.from_peers),
        )

    def remove(self, where: str | None, name: str, tag: str, tier: str | None = None) -> None:
        """(outside the timers) This tag's fast-tier folders (node leaders) and durable copy (rank 0)."""
        if tier is not None and self.leader:
            shutil.rmtree(os.path.join(self.job(tier, where or "disk", name), f"{tag}_partial"))
        if where is not None and self.rank == 0:
            root, opts = self.root(where, name)
            path = f"{root}/{tag}_partial"
            if where == "s3":
                fs, p = fsspec.core.url_to_fs(path, **(opts or {}))
                fs.rm(p, recursive=True)
            else:
                shutil.rmtree(path)
        dist.barrier()

    def timed(self, fn: Callable[[], Any], wait_drain: bool = False) -> dict[str, Any]:
        """After ``--settle`` seconds, ``fn`` between barriers: wall ``s`` (rank 0's), each rank's call
        time and device reads, the moto server's CPU. ``wait_drain``: then ``wait_for_saves()`` and a
        barrier; ``drain_s`` = from rank 0's return from ``fn`` to the end of that barrier (every rank's
        drain done)."""
        time.sleep(self.cfg["settle_s"])
        dist.barrier()
        io0, srv0 = _read_bytes(), _pid_cpu_s(self.moto_pid) if self.rank == 0 else 0.0
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        dist.barrier()
        wall = time.perf_counter() - t0
        rec: dict[str, Any] = {"s": wall}
        cpu1 = time.process_time()  # every thread of this rank: the drain's copy threads too
        if wait_drain:
            smpckpt.wait_for_saves()
            dist.barrier()
            rec["drain_s"] = time.perf_counter() - t1
            rec["drain_cpu_s"] = sum(self.gather(time.process_time() - cpu1))
        if self.moto_pid is not None and self.rank == 0:
            rec["server_cpu_s"] = _pid_cpu_s(self.moto_pid) - srv0
        per_rank = self.gather({"call_s": t1 - t0, "read_bytes": _read_bytes() - io0, "out": out})
        return rec | {k: [p[k] for p in per_rank] for k in ("call_s", "read_bytes", "out")}

    def rounds(self, phase: str, keys: list[str], one: Callable[[int, str], dict[str, Any]]) -> dict[str, Any]:
        """Warm-up + measured rounds of ``phase``, order rotated per round; with the CPU the machine's other
        processes used meanwhile (kernel threads included): the noise this run saw."""
        rec: dict[str, Any] = {k: [] for k in keys}
        dist.barrier()
        t0, host0, cpu0 = time.perf_counter(), _host_cpu_s(), time.process_time()
        srv0 = _pid_cpu_s(self.moto_pid) if self.rank == 0 else 0.0
        for r in range(self.cfg["rounds"] + 1):
            order = keys[r % len(keys) :] + keys[: r % len(keys)]
            line = []
            for key in order:
                got = one(r, key)
                got["order"] = order.index(key)
                if r:
                    rec[key].append(got)
                line.append(f"{key} {got['s']:.2f}s" + (f" (+drain {got['drain_s']:.2f}s)" if "drain_s" in got else ""))
            self.log(f"  {phase} round {r}{' (warm-up)' if not r else ''}: " + ", ".join(line))
        ours = sum(self.gather(time.process_time() - cpu0))
        dist.barrier()
        wall = time.perf_counter() - t0
        procs, irq, steal = (b - a for a, b in zip(host0, _host_cpu_s()))
        if self.rank == 0:
            srv = _pid_cpu_s(self.moto_pid) - srv0
            others = max(0.0, procs - ours - srv)
            rec["_cpu"] = {"wall_s": wall, "ranks_s": ours, "server_s": srv, "others_s": others, "irq_s": irq}
            rec["_cpu"]["steal_s"] = steal
            self.log(
                f"  {phase}: {wall:.0f} s; CPU-s ranks {ours:.1f}, moto {srv:.1f}, other processes {others:.1f}, "
                f"irq {irq:.1f}, stolen {steal:.1f}"
            )
        return rec

    # phases
    def save_phase(self) -> dict[str, Any]:
        plans = {
            "tier_r2": ("disk", "tier-r2", "r2", 2),
            "tier_r1": ("disk", "tier-r1", "r1", 1),
            "shm": ("shm", "direct", None, 0),
            "disk": ("disk", "direct", None, 0),
            "s3": ("s3", "direct", None, 0),
        }

        def one(r: int, key: str) -> dict[str, Any]:
            where, name, tier, replicas = plans[key]
            tag = f"r{r}-{key}"
            kw = {"replicas": replicas, "durable_every": NEVER} if tier else {}
            got = self.timed(lambda: self.save(where, name, tag, tier, **kw))
            self.remove(None if tier else where, name, tag, tier)
            return got

        return self.rounds("save", [k for k in SAVES if k != "s3" or self.s3], one)

    def drain_phase(self) -> dict[str, Any]:
        def one(r: int, key: str) -> dict[str, Any]:
            where = key.split("_")[1]
            tier, tag = f"drain-{where}", f"r{r}-{key}"
            got = self.timed(lambda: self.save(where, "drain", tag, tier, replicas=2, durable_every=1), True)
            if self.rank == 0:
                root, opts = self.root(where, "drain")
                state = probe_checkpoint(f"{root}/{tag}_partial", opts).state
                if state != "committed":
                    raise RuntimeError(f"the drain of {tag} left {root} {state!r}, not committed")
            self.remove(where, "drain", tag, tier)
            return got

        return self.rounds("drain", [k for k in DRAINS if k != "drain_s3" or self.s3], one)

    def resume_phase(self) -> dict[str, Any]:
        self.save("disk", "tier-resume", "resume", "resume", replicas=2, durable_every=NEVER)
        self.save("disk", "resume", "resume")
        if self.s3:
            self.save("s3", "resume", "resume")
        plans: dict[str, tuple[str, str, str | None, str]] = {
            "fast": ("disk", "tier-resume", "resume", "fast"),
            "fast_peer": ("disk", "tier-resume", "resume", "fast"),
            "disk_cold": ("disk", "resume", None, "durable"),
            "disk_warm": ("disk", "resume", None, "durable"),
            "s3": ("s3", "resume", None, "durable"),
        }

        def one(r: int, key: str) -> dict[str, Any]:
            where, name, tier, want = plans[key]
            with torch.no_grad():
                for p in self.model.parameters():
                    p.fill_(-7.0)
            if key == "fast_peer" and self.rank == LWS:  # node 1's leader: its node's fast tier is lost
                shutil.rmtree(self.local("resume"))
            if key == "disk_cold" and self.rank == 0:
                fsync_tree(self.disk(name), drop_cache=True)
            got = self.timed(lambda: self.resume(where, name, tier))
            exact = all(torch.equal(p, e) for p, e in zip(self.model.parameters(), self.expected))
            ok = self.gather(exact)
            tiers, peers = {o[0] for o in got["out"]}, got["out"][0][1]
            if not all(ok) or tiers != {want} or (key == "fast_peer") != (peers > 0):
                raise RuntimeError(f"resume {key}: exact {ok}, tier {tiers} (want {want}), {peers} file(s) from peers")
            got["from_peers"], got["from_peers_bytes"] = peers, got["out"][0][2]
            return got

        return self.rounds("resume", [k for k in RESUMES if k != "s3" or self.s3], one)

    def run(self) -> dict[str, Any]:
        per_rank = self.gather(self.nbytes)
        self.log(f"state: {sum(per_rank) / MiB:.1f} MiB over {WORLD} ranks ({per_rank[0] / MiB:.1f} MiB each)")
        t0 = time.perf_counter()
        out: dict[str, Any] = {"bytes_per_rank": per_rank}
        for phase, run in (("save", self.save_phase), ("drain", self.drain_phase), ("resume", self.resume_phase)):
            if phase in self.cfg["phases"]:
                out[phase] = run()
        out["phases_s"] = time.perf_counter() - t0
        return out


# -- driver ----------------------------------------------------------------------------------------
def _cmd(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"({exc})"


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    total = sum(res["bytes_per_rank"])
    out: dict[str, Any] = {}
    for phase, ref in (("save", "tier_r2"), ("drain", None), ("resume", "fast")):
        if phase not in res:
            continue
        rows: dict[str, Any] = {"_cpu": res[phase]["_cpu"]}
        for key, recs in res[phase].items():
            if key.startswith("_"):
                continue
            times = [x["s"] for x in recs]
            row: dict[str, Any] = {"s": _spread(times), "GBps": total / statistics.median(times) / 1e9}
            if ref is not None:
                row["x_ref"] = _spread([x["s"] / y["s"] for x, y in zip(recs, res[phase][ref])])
            if phase == "save":  # the goal: a replicated fast-tier save <= 1.2x a plain /dev/shm save
                row["x_shm"] = _spread([x["s"] / y["s"] for x, y in zip(recs, res[phase]["shm"])])
                steps = [x["out"][0] for x in recs if x["out"][0]]  # rank 0's steps of a tiered save
                if steps:
                    row["steps_s"] = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
            if "server_cpu_s" in recs[0] and (key.endswith("s3")):
                row["server_cpu_s"] = statistics.median(x["server_cpu_s"] for x in recs)
            if phase == "drain":
                drains = [x["drain_s"] for x in recs]
                row["drain_s"] = _spread(drains)
                row["drain_GBps"] = total / statistics.median(drains) / 1e9
                if "drain_cpu_s" in recs[0]:
                    row["drain_cpu_s"] = _spread([x["drain_cpu_s"] for x in recs])
            if phase == "resume":
                row["device_read_frac"] = statistics.median(sum(x["read_bytes"]) / total for x in recs)
                row["from_peers_files"] = max(x.get("from_peers", 0) for x in recs)
                row["from_peers_bytes"] = max(x.get("from_peers_bytes", 0) for x in recs)
            rows[key] = row
        out[phase] = rows
    return out


def _fmt(s: dict[str, float], p: int = 2) -> str:
    return f"{s['median']:.{p}f} ({s['min']:.{p}f}..{s['max']:.{p}f})"


def _noise(rows: dict[str, Any]) -> str:
    c = rows["_cpu"]
    return (
        f"  [{c['wall_s']:.0f} s; CPU-s ranks {c['ranks_s']:.1f}, moto {c['server_s']:.1f}, irq {c['irq_s']:.1f}, "
        f"other processes {c['others_s']:.1f} ({c['others_s'] / c['wall_s']:.2f} cores), stolen {c['steal_s']:.1f}]"
    )


def print_tables(summ: dict[str, Any], total: int, rounds: int) -> None:
    print(f"\n{total / MiB:.0f} MiB over {WORLD} ranks (2 nodes x 2); medians of {rounds} rounds (min..max)")
    srv = lambda row: f"{row['server_cpu_s']:8.1f}" if "server_cpu_s" in row else f"{'':8s}"  # noqa: E731
    head = f"\n{'save':28s} {'s':>19s} {'GB/s':>5s} {'time / fast r=2':>18s} {'time / plain shm':>18s} {'moto CPU':>8s}"
    if "save" in summ:
        print(head + _noise(summ["save"]))
    for key, row in summ.get("save", {}).items():
        if not key.startswith("_"):
            print(
                f"{SAVES[key]:28s} {_fmt(row['s']):>19s} {row['GBps']:5.2f} {_fmt(row['x_ref']):>18s} "
                f"{_fmt(row['x_shm']):>18s} {srv(row)}"
            )
    for key, row in summ.get("save", {}).items():
        if "steps_s" in row:
            steps = ", ".join(f"{k} {v:.3f}" for k, v in row["steps_s"].items())
            print(f"  {SAVES[key]}: where rank 0's time goes (s, medians): {steps}")
    hdr = (
        f"\n{'tiered save + drain':28s} {'blocking s':>19s} {'drain s (background)':>20s} {'GB/s':>5s} {'moto CPU':>8s}"
        f" {'ranks CPU-s in the drain':>24s}"
    )
    if "drain" in summ:
        print(hdr + _noise(summ["drain"]))
    for key, row in summ.get("drain", {}).items():
        if not key.startswith("_"):
            cpu = _fmt(row["drain_cpu_s"]) if "drain_cpu_s" in row else ""
            print(
                f"{DRAINS[key]:28s} {_fmt(row['s']):>19s} {_fmt(row['drain_s']):>20s} {row['drain_GBps']:5.2f} "
                f"{srv(row)} {cpu:>24s}"
            )
    hdr = f"\n{'resume':28s} {'s':>19s} {'GB/s':>5s} {'time / fast intact':>18s} {'moto CPU':>8s} {'dev read':>8s}"
    if "resume" in summ:
        print(hdr + _noise(summ["resume"]))
    for key, row in summ.get("resume", {}).items():
        if not key.startswith("_"):
            print(
                f"{RESUMES[key]:28s} {_fmt(row['s']):>19s} {row['GBps']:5.2f} {_fmt(row['x_ref']):>18s} {srv(row)} "
                f"{row['device_read_frac']:8.2f}"
            )
    peer = summ.get("resume", {}).get("fast_peer")
    if peer:
        print(
            f"node 1 lost: {peer['from_peers_files']} file(s), {peer['from_peers_bytes'] / MiB:.0f} MiB fetched from "
            "node 0 per resume; 'dev read' = bytes the ranks read from the block device / state bytes"
        )


def run_ranks(cfg: dict[str, Any], deadline_s: float) -> dict[str, Any]:
    ctx = mp.spawn(worker, args=(cfg,), nprocs=WORLD, join=False)
    deadline = time.monotonic() + deadline_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()  # our own ranks
            raise TimeoutError(f"the ranks did not finish within {deadline_s:.0f} s")
    with open(cfg["result_file"]) as f:
        return dict(json.load(f))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=512, help="fp32 state over all 4 ranks (MiB)")
    ap.add_argument("--hidden", type=int, default=2048, help="Linear(h, h) layers, h*h*4 bytes each")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds per phase (after a warm-up)")
    ap.add_argument("--shm-dir", default="/dev/shm", help="parent of the fast tiers (node-local storage)")
    ap.add_argument("--disk-dir", default=os.path.join(HERE, "out"), help="parent of the durable folder")
    ap.add_argument("--no-s3", action="store_true", help="skip the S3 (moto) contenders")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds of pause before every timed operation")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds for the whole run of the ranks")
    ap.add_argument("--quick", action="store_true", help="4 MiB, hidden 512, 1 round, no pauses (smoke test)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/tiers_<timestamp>.json)")
    ap.add_argument(
        "--phases", default="save,drain,resume", help="which phases, comma-separated (e.g. drain: the drain alone)"
    )
    args = ap.parse_args(argv)
    phases = [p for p in args.phases.split(",") if p]
    if not phases or set(phases) - {"save", "drain", "resume"}:
        ap.error(f"--phases takes save, drain, resume; got {args.phases!r}")
    if args.quick:
        # 4 layers (was 16): every case, tier and path as before, a quarter of the tensors to plan and move
        args.size_mib, args.hidden, args.rounds, args.settle = 4, 512, 1, 0.0
    if args.hidden % WORLD or args.rounds < 1:
        ap.error(f"--hidden must be a multiple of {WORLD}; --rounds at least 1")
    layers = max(1, round(args.size_mib * MiB / (args.hidden * args.hidden * 4)))
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or os.path.join(HERE, "results", f"tiers_{stamp}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    for d in (args.shm_dir, args.disk_dir):
        os.makedirs(d, exist_ok=True)
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "smpckpt": os.path.dirname(os.path.abspath(smpckpt.__file__)),
        "smpckpt_head": _cmd(["git", "-C", os.path.dirname(smpckpt.__file__), "rev-parse", "--short", "HEAD"]),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "nproc": _cmd(["nproc"]),
        "free_g": _cmd(["free", "-g"]),
        "df": {"shm": _cmd(["df", "-h", args.shm_dir]), "disk": _cmd(["df", "-h", args.disk_dir])},
        "loadavg_start": _cmd(["cat", "/proc/loadavg"]),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    }
    started = time.perf_counter()
    shm = tempfile.mkdtemp(prefix="bench-tiers-", dir=args.shm_dir)
    disk = tempfile.mkdtemp(prefix="bench-tiers-", dir=args.disk_dir)
    ep = None
    try:
        s3 = None
        if not args.no_s3:
            from _s3server import start_moto

            ep = start_moto()
            s3 = {"root": f"s3://{ep.bucket}/tiers-{stamp}", "options": ep.options}
        cfg = {
            "layers": layers,
            "rows": args.hidden // WORLD,
            "hidden": args.hidden,
            "rounds": args.rounds,
            "shm": shm,
            "disk": disk,
            "s3": s3,
            "moto_pid": ep.proc.pid if ep is not None and ep.proc is not None else None,
            "init_file": os.path.join(disk, "rendezvous"),
            "result_file": os.path.join(disk, "result.json"),
            "op_timeout_s": 300,
            "settle_s": args.settle,
            "phases": phases,
        }
        print(
            f"{WORLD} gloo ranks = 2 nodes x {LWS} (LOCAL_WORLD_SIZE={LWS}); {layers} x Linear({args.hidden}, "
            f"{args.hidden}) fp32 sharded on dim 0; fast tiers under {shm}, durable folder under {disk}"
            f"{', S3 ' + s3['root'] + ' at ' + ep.url if s3 and ep else ', no S3'}; 1 warm-up + {args.rounds} rounds",
            flush=True,
        )
        res = run_ranks(cfg, args.timeout)
    finally:
        if ep is not None:
            ep.stop()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    env["loadavg_end"] = _cmd(["cat", "/proc/loadavg"])
    total = sum(res["bytes_per_rank"])
    summary = summarize(res)
    print_tables(summary, total, args.rounds)
    results = {
        "env": env,
        "config": {k: v for k, v in vars(args).items() if k != "out"} | {"layers": layers, "world": WORLD, "lws": LWS},
        "state_bytes": total,
        "summary": summary,
        "raw": res,
        "elapsed_s": time.perf_counter() - started,
    }
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {out} ({results['elapsed_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

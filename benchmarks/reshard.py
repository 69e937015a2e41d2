"""Reshard read amplification (bytes read / bytes the destinations need) for the benchmark driver.

Each case saves a checkpoint from one layout and loads it into another, all ranks simulated in one
process with the calls ``dcp.save``/``dcp.load`` make (``tests/sim.py``), once through smpckpt's
writer/reader and once through DCP's ``FileSystemWriter``/``FileSystemReader`` (both with our planners,
which do the resharding; DCP's default planner cannot reshard plain TP shards). Bytes read:

* ``rchar``: the ``rchar`` delta of ``/proc/self/io`` around every ``read_data`` (every byte the reader
  pulled through read syscalls, whatever it then kept; page-cache hits count too), for both readers;
* ``stats``: smpckpt's own ``reader.last_read_stats`` (bytes fetched after checksum-block widening and
  coalescing), summed over the loading ranks.

Cases: TP 1->4 row split (dim 0) of many 1 MiB tensors, TP 1->4 column split (dim 1) of one large
matrix, TP 4->1 (row and column shards), PP 2->1 (stage-local layer names renamed to global ones).
Every load is checked bit-exact against the expected shards.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from sim import reset_dcp_caches, sim_load, sim_save  # noqa: E402

from smpckpt.model.layout import ParallelLayout  # noqa: E402
from smpckpt.model.specs import ShardSpec  # noqa: E402
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner  # noqa: E402
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter  # noqa: E402

__all__ = ["Case", "cases", "run_cases"]

MiB = 1 << 20
State = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    glob: State  #: the global tensors, by key under "model"
    dims: dict[str, int | None]  #: key -> split dim (None: replicated / not TP-split)
    save: ParallelLayout
    load: ParallelLayout
    specs: dict[str, ShardSpec]
    #: (layout, rank) -> this rank's {local key: global key}; default: every key, same name
    keys: Callable[[ParallelLayout, int], dict[str, str]] | None = None

    def local(self, layout: ParallelLayout, rank: int) -> State:
        """Rank ``rank``'s local state under ``layout``: its TP piece of every tensor it holds."""
        names = self.keys(layout, rank) if self.keys else {k: k for k in self.glob}
        tp, tp_rank = layout.tp, layout.coords(rank).tp
        out: State = {}
        for local_key, key in names.items():
            g, dim = self.glob[key], self.dims[key]
            piece = g if dim is None else g.chunk(tp, dim)[tp_rank]
            out[local_key] = piece.clone(memory_format=torch.contiguous_format)
        return out


def _pp_keys(layers: int) -> Callable[[ParallelLayout, int], dict[str, str]]:
    def keys(layout: ParallelLayout, rank: int) -> dict[str, str]:
        per = layers // layout.pp
        stage = layout.coords(rank).pp
        return {f"layers.{j}.w": f"layers.{stage * per + j}.w" for j in range(per)}

    return keys


def cases(quick: bool) -> list[Case]:
    g = torch.Generator().manual_seed(0)
    n_small = 16 if quick else 64
    side = 1024 if quick else 8192  # the column-split matrix: 4 MiB / 256 MiB fp32
    rows = {f"row{i}": torch.randn(256, 1024, generator=g) for i in range(n_small)}  # 1 MiB each
    col = {"col": torch.randn(side, side, generator=g)}
    n_mixed, rows_mixed = (2, 512) if quick else (16, 1024)
    mixed = {
        **{f"r{i}": torch.randn(rows_mixed, 1024, generator=g) for i in range(n_mixed)},
        **{f"c{i}": torch.randn(rows_mixed, 1024, generator=g) for i in range(n_mixed)},
    }
    mixed_dims: dict[str, int | None] = {k: 0 if k.startswith("r") else 1 for k in mixed}
    layers = 4
    pp = {f"layers.{i}.w": torch.randn(512 if quick else 2048, 1024, generator=g) for i in range(layers)}
    row_spec = {"model.row*": ShardSpec(0)}
    mixed_spec = {"model.r*": ShardSpec(0), "model.c*": ShardSpec(1)}
    return [
        Case(
            f"TP 1->4 dim 0 ({n_small} x 1 MiB)",
            rows,
            dict.fromkeys(rows, 0),
            ParallelLayout(),
            ParallelLayout(tp=4),
            row_spec,
        ),
        Case(
            f"TP 1->4 dim 1 ({side * side * 4 // MiB} MiB matrix)",
            col,
            {"col": 1},
            ParallelLayout(),
            ParallelLayout(tp=4),
            {"model.col": ShardSpec(1)},
        ),
        Case("TP 4->1 (dims 0 and 1)", mixed, mixed_dims, ParallelLayout(tp=4), ParallelLayout(), mixed_spec),
        Case(
            "PP 2->1",
            pp,
            dict.fromkeys(pp),
            ParallelLayout(pp=2, pp_layers=[2, 2]),
            ParallelLayout(pp=1, pp_layers=[4]),
            {},
            keys=_pp_keys(layers),
        ),
    ]


def _rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def _count_reads(reader: Any, box: list[int]) -> Any:
    """Wrap ``reader.read_data`` so the rchar it causes is added to ``box[0]``."""
    inner = reader.read_data

    def read_data(plan: Any, planner: Any) -> Any:
        before = _rchar()
        fut = inner(plan, planner)
        fut.wait()  # our reader works in threads: count until they are done
        box[0] += _rchar() - before
        return fut

    reader.read_data = read_data
    return reader


def _one(case: Case, who: str, path: str) -> dict[str, Any]:
    save_world, load_world = case.save.world_size, case.load.world_size
    reset_dcp_caches()
    states = [{"model": case.local(case.save, r)} for r in range(save_world)]
    writers: list[Any] = [
        FsspecStorageWriter(path) if who == "smpckpt" else FileSystemWriter(path) for _ in range(save_world)
    ]
    sim_save(states, [ParallelSavePlanner(case.save, case.specs, rank=r) for r in range(save_world)], writers)
    del states
    expect = [case.local(case.load, r) for r in range(load_world)]
    dests = [{"model": {k: torch.full_like(v, -7.0) for k, v in e.items()}} for e in expect]
    box = [0]
    readers: list[Any] = [
        _count_reads(FsspecStorageReader(path) if who == "smpckpt" else FileSystemReader(path), box)
        for _ in range(load_world)
    ]
    reset_dcp_caches()
    t0 = time.perf_counter()
    sim_load(dests, [ParallelLoadPlanner(case.load, case.specs, rank=r) for r in range(load_world)], readers)
    elapsed = time.perf_counter() - t0
    for r, e in enumerate(expect):
        bad = [k for k, v in e.items() if not torch.equal(dests[r]["model"][k], v)]
        if bad:
            raise RuntimeError(f"{case.name}, {who}, rank {r}: loaded values differ for {bad[:3]}")
    needed = sum(t.numel() * t.element_size() for e in expect for t in e.values())
    row: dict[str, Any] = {"bytes_needed": needed, "rchar": box[0], "rchar_ampl": box[0] / needed, "load_s": elapsed}
    stats = [r.last_read_stats for r in readers if getattr(r, "last_read_stats", None) is not None]
    if stats:
        read = sum(s.bytes_read for s in stats)
        row.update(stats_bytes_read=read, stats_bytes_needed=sum(s.bytes_needed for s in stats))
        row["stats_ampl"] = read / row["stats_bytes_needed"]
        row["requests"] = sum(s.requests for s in stats)
    return row


def run_cases(base: str, quick: bool, log: Callable[[str], None]) -> dict[str, Any]:
    """Every case with both readers; {case name: {"smpckpt": row, "DCP FileSystemReader": row}}."""
    out: dict[str, Any] = {}
    for case in cases(quick):
        out[case.name] = {}
        for who, label in (("smpckpt", "smpckpt"), ("dcp", "DCP FileSystemReader")):
            path = os.path.join(base, f"reshard-{who}")
            shutil.rmtree(path, ignore_errors=True)
            try:
                out[case.name][label] = row = _one(case, who, path)
            finally:
                shutil.rmtree(path, ignore_errors=True)
            extra = f", own stats {row['stats_ampl']:.3f}x" if "stats_ampl" in row else ""
            log(f"  reshard {case.name:34s} {label:22s} read/needed (rchar) {row['rchar_ampl']:.3f}x{extra}")
    return out

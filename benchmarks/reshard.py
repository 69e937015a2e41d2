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

:func:`run_speed` times one loading rank (TP=4 rank 1 of a TP=1 save, ``dcp.load`` without a process
group) beside stock DCP ``FileSystemReader`` on the same layout's checkpoint, cold (page cache dropped)
and warm, interleaved rounds: a column split of fp32 rows of 64 KiB and of bf16 rows of 8 KiB (each also
read with ``request_cost_bytes=0``, a request per row: the choice before the streaming cost model), and
a row split of 16 MiB tensors. Per load: wall and CPU seconds (``getrusage``, every thread), device bytes
(``read_bytes`` of ``/proc/self/io``) and smpckpt's ``last_read_stats`` (bytes requested, requests,
device bytes).
"""

from __future__ import annotations

import dataclasses
import os
import resource
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from bench_full import _spread  # noqa: E402 - one median/min/max helper of the benchmarks
from bench_storage import fsync_tree  # noqa: E402 - one page-cache dropper of the benchmarks
from sim import reset_dcp_caches, sim_load, sim_save  # noqa: E402

from smpckpt.model.layout import ParallelLayout  # noqa: E402
from smpckpt.model.specs import ShardSpec  # noqa: E402
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner  # noqa: E402
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter, FullArtifactWriter  # noqa: E402

__all__ = ["Case", "cases", "run_cases", "run_speed"]

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


# -- one loading rank, timed beside stock DCP -----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SpeedCase:
    name: str
    glob: State
    dim: int  #: split dim of every tensor


def speed_cases(quick: bool) -> list[SpeedCase]:
    g = torch.Generator().manual_seed(1)
    fp32_rows, bf16_rows, tensors, rows = (256, 1024, 16, 256) if quick else (4096, 16384, 16, 4096)
    return [
        SpeedCase(
            f"TP 1->4 dim 1, fp32 rows of 64 KiB ({fp32_rows * 64 // 1024} MiB)",
            {"w": torch.randn(fp32_rows, 16384, generator=g)},
            1,
        ),
        SpeedCase(
            f"TP 1->4 dim 1, bf16 rows of 8 KiB ({bf16_rows * 8 // 1024} MiB)",
            {"w": torch.randn(bf16_rows, 4096, generator=g).to(torch.bfloat16)},
            1,
        ),
        SpeedCase(
            f"TP 1->4 dim 0, {tensors} x {rows * 4 // 1024} MiB fp32",
            {f"r{i:02d}": torch.randn(rows, 1024, generator=g) for i in range(tensors)},
            0,
        ),
    ]


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _device_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


#: the extra contender of the column cases: smpckpt with ``request_cost_bytes=0`` (a request per row)
PER_ROW = "smpckpt, a request per row"
#: the column cases also load a TP=1 full artifact (``FullArtifactWriter``) of the same state: as the
#: streaming cost model reads it, and a request per row (``request_cost_bytes=0``: the full reader's
#: only way before it took the model -- verified, every tile a request per unit row)
FULL = "smpckpt full artifact"
FULL_PER_ROW = "smpckpt full artifact, a request per row"


def run_speed(base: str, quick: bool, rounds: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Every speed case: {case: {"needed": bytes, "readers": {who: {"cold"|"warm": figures}},
    "dcp_over_ours": {"cold"|"warm": spread of per-round time ratios}}}; the column cases also time
    :data:`PER_ROW` (``"dcp_over_per_row"``), the reader's choice before its streaming cost model, and a
    full artifact of the same state read both ways (:data:`FULL`, :data:`FULL_PER_ROW`;
    ``"full_per_row_over_full"``: the time the model saves there)."""
    out: dict[str, Any] = {}
    tp, rank = 4, 1
    for case in speed_cases(quick):
        specs = {f"model.{k}": ShardSpec(case.dim) for k in case.glob}
        want = {k: v.chunk(tp, case.dim)[rank].contiguous() for k, v in case.glob.items()}
        needed = sum(t.numel() * t.element_size() for t in want.values())
        kinds = ("smpckpt", "DCP FileSystemReader") + ((FULL,) if case.dim else ())
        saved = {who: os.path.join(base, f"speed-{who.replace(' ', '-')}") for who in kinds}
        for who, path in saved.items():
            shutil.rmtree(path, ignore_errors=True)
            reset_dcp_caches()
            planner = ParallelSavePlanner(ParallelLayout(), specs, rank=0)
            if who == FULL:  # a TP=1 full export: the artifact a TP=4 job loads by column
                sim_save([{"model": case.glob}], [planner], [FullArtifactWriter(path)])
                continue
            writer = FsspecStorageWriter(path) if who == "smpckpt" else FileSystemWriter(path)
            dcp.save({"model": case.glob}, storage_writer=writer, planner=planner)
        # reader -> (checkpoint, smpckpt reader options; None: DCP's reader)
        readers: dict[str, tuple[str, dict[str, Any] | None]] = {
            "smpckpt": (saved["smpckpt"], {}),
            "DCP FileSystemReader": (saved["DCP FileSystemReader"], None),
        }
        if case.dim:  # the column slice read a request per row, as before the streaming cost model
            readers[PER_ROW] = (saved["smpckpt"], {"request_cost_bytes": 0})
            readers[FULL] = (saved[FULL], {})
            readers[FULL_PER_ROW] = (saved[FULL], {"request_cost_bytes": 0})
        recs: dict[str, dict[str, list[dict[str, Any]]]] = {who: {"cold": [], "warm": []} for who in readers}
        order = list(readers)
        try:
            for r in range(rounds + 1):  # round 0: warm-up
                for who in order[r % len(order) :] + order[: r % len(order)]:
                    path, options = readers[who]
                    for temp in ("cold", "warm"):
                        if temp == "cold":
                            fsync_tree(path, drop_cache=True)
                        got = _speed_one(options, path, specs, want, tp, rank)
                        if r:
                            recs[who][temp].append(got)
        finally:
            for path in saved.values():
                shutil.rmtree(path, ignore_errors=True)
        row: dict[str, Any] = {"needed": needed, "readers": {}, "dcp_over_ours": {}}
        for who, by in recs.items():
            row["readers"][who] = {
                temp: {
                    "s": _spread([g["s"] for g in gs]),
                    "cpu_s": statistics.median(g["cpu_s"] for g in gs),
                    "device_ampl": statistics.median(g["device"] / needed for g in gs),
                    **({"stats": gs[-1]["stats"]} if gs[-1].get("stats") else {}),
                }
                for temp, gs in by.items()
            }
        for temp in ("cold", "warm"):
            ratios = [d["s"] / o["s"] for d, o in zip(recs["DCP FileSystemReader"][temp], recs["smpckpt"][temp])]
            row["dcp_over_ours"][temp] = _spread(ratios)
            if PER_ROW in recs:
                per_row = zip(recs["DCP FileSystemReader"][temp], recs[PER_ROW][temp])
                row.setdefault("dcp_over_per_row", {})[temp] = _spread([d["s"] / o["s"] for d, o in per_row])
            if FULL in recs:
                full = zip(recs[FULL_PER_ROW][temp], recs[FULL][temp])
                row.setdefault("full_per_row_over_full", {})[temp] = _spread([b["s"] / a["s"] for b, a in full])
        out[case.name] = row
        for temp in ("cold", "warm"):
            ours, theirs = row["readers"]["smpckpt"][temp], row["readers"]["DCP FileSystemReader"][temp]
            st = ours.get("stats", {})
            log(
                f"  {case.name:44s} {temp}: DCP time / ours {row['dcp_over_ours'][temp]['median']:.2f}; "
                f"CPU s {ours['cpu_s']:.3f} vs {theirs['cpu_s']:.3f}; device/needed {ours['device_ampl']:.2f} vs "
                f"{theirs['device_ampl']:.2f}; requested/needed {st.get('requested_ampl', float('nan')):.2f} "
                f"in {st.get('requests', 0)} requests"
            )
            if PER_ROW in row["readers"]:
                pr = row["readers"][PER_ROW][temp]
                log(
                    f"  {'':44s} {temp}: a request per row: DCP time / it "
                    f"{row['dcp_over_per_row'][temp]['median']:.2f}; CPU s {pr['cpu_s']:.3f}; device/needed "
                    f"{pr['device_ampl']:.2f} in {pr.get('stats', {}).get('requests', 0)} requests"
                )
            for who in (FULL, FULL_PER_ROW):
                if who in row["readers"]:
                    fr = row["readers"][who][temp]
                    st = fr.get("stats", {})
                    log(
                        f"  {'':44s} {temp}: {who}: {fr['s']['median']:.3f} s, CPU s {fr['cpu_s']:.3f}; "
                        f"device/needed {fr['device_ampl']:.2f}; requested/needed "
                        f"{st.get('requested_ampl', float('nan')):.2f} in {st.get('requests', 0)} requests"
                    )
            if "full_per_row_over_full" in row:
                log(
                    f"  {'':44s} {temp}: full artifact, time per row / streamed "
                    f"{row['full_per_row_over_full'][temp]['median']:.2f}"
                )
    return out


def _speed_one(
    options: dict[str, Any] | None, path: str, specs: dict[str, ShardSpec], want: State, tp: int, rank: int
) -> dict[str, Any]:
    """One timed load: smpckpt's reader with ``options``, or (``None``) DCP's."""
    who = "smpckpt" if options is not None else "DCP FileSystemReader"
    dest = {k: torch.full_like(v, -7) for k, v in want.items()}
    reader: Any = FsspecStorageReader(path, **options) if options is not None else FileSystemReader(path)
    reset_dcp_caches()
    planner = ParallelLoadPlanner(ParallelLayout(tp=tp), specs, rank=rank)
    dev0, cpu0, t0 = _device_bytes(), _cpu_s(), time.perf_counter()
    dcp.load({"model": dest}, storage_reader=reader, planner=planner)
    got: dict[str, Any] = {"s": time.perf_counter() - t0, "cpu_s": _cpu_s() - cpu0, "device": _device_bytes() - dev0}
    bad = [k for k, v in want.items() if not torch.equal(dest[k], v)]
    if bad:
        raise RuntimeError(f"{who}, rank {rank}: loaded values differ for {bad[:3]}")
    st = getattr(reader, "last_read_stats", None)
    if st is not None:
        got["stats"] = {
            "bytes_needed": st.bytes_needed,
            "bytes_requested": st.bytes_requested,
            "requested_ampl": st.amplification,
            "requests": st.requests,
            "device_bytes": st.device_bytes,
        }
    return got

"""Planning at real model sizes in keys and ranks: a Llama-like state, every planner step timed apart,
and a reshard load checked bit-exact against the full state.

The state: ``--layers`` (default 80, Llama-70B's count; 126 for 405B) layers of the 9 Llama parameters
plus embedding, final norm and head, at tiny dims (hidden 64) -- what matters here is the count of keys
and ranks, not bytes -- with Adam's ``exp_avg``, ``exp_avg_sq`` and ``step`` per parameter, the TP
parameters under ``ShardSpec`` (column- and row-parallel), ``pp_layers`` stage renaming, and ZeRO-1
sharding of ``exp_avg``/``exp_avg_sq`` over DP (``--no-zero``: replicated over DP like the params).

Per world size (one process, the calls ``dcp.save``/``dcp.load`` make, as ``tests/sim.py`` does; plans
pickled on their way to and from the coordinator): a save at TP x PP x DP, a load into the same layout
(fast path) and a reshard load into a smaller layout (``LAYOUTS``), every destination tensor compared
with ``torch.equal`` to the piece of the full state it must hold. Each step is timed apart: per-rank steps
(``*.local``: set_up_planner + create_local_plan; ``*.finish``; ``*.write``/``*.read``, the in-memory
copies) summed over ranks, coordinator steps (``*.gather_unpickle``: every local plan unpickled;
``*.global``; ``*.scatter_pickle``) once. ``growth`` = (time ratio, largest world / smallest) / (rank x
keys ratio): about 1 when a step is linear in rank x keys, well above 1 when it is not. ``--storage fs``
runs the same through ``FsspecStorageWriter``/``FsspecStorageReader`` in a temp folder (every rank reads
the manifest and metadata itself, and each reader keeps its own staging pool: slow, and ~40 MiB a
simulated rank, past 64 ranks).

The garbage collector is off during the steps: one process holds every simulated rank's objects, and
a collection would walk all of them, which no real rank's does.

    python benchmarks/bench_scale.py [--quick] [--layers 80] [--worlds 8,64,256,512,1024]
        [--storage memory|fs] [--profile STEP@WORLD] [--out benchmarks/out/scale.json]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pickle
import platform
import pstats
import resource
import sys
import tempfile
import time
from datetime import datetime, timezone
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from sim import MemoryReader, MemoryStore, MemoryWriter, reset_dcp_caches  # noqa: E402

from smpckpt import ParallelLayout, ShardSpec  # noqa: E402
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner  # noqa: E402
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter  # noqa: E402

H, KV, FF, VOCAB = 64, 16, 128, 256
# name, global shape, tp dim (None: replicated), zero dp dim for the optimizer state
LAYER = (
    ("input_layernorm.weight", (H,), None, 0),
    ("self_attn.q_proj.weight", (H, H), 0, 1),
    ("self_attn.k_proj.weight", (KV, H), 0, 1),
    ("self_attn.v_proj.weight", (KV, H), 0, 1),
    ("self_attn.o_proj.weight", (H, H), 1, 0),
    ("post_attention_layernorm.weight", (H,), None, 0),
    ("mlp.gate_proj.weight", (FF, H), 0, 1),
    ("mlp.up_proj.weight", (FF, H), 0, 1),
    ("mlp.down_proj.weight", (H, FF), 1, 0),
)
FIRST = (("embed_tokens.weight", (VOCAB, H), 0, 1),)
LAST = (("norm.weight", (H,), None, 0), ("lm_head.weight", (VOCAB, H), 0, 1))
OPT = ("exp_avg", "exp_avg_sq")


def specs(zero: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for table, pre in ((LAYER, "layers.*."), (FIRST, ""), (LAST, "")):
        for name, _, tpd, dpd in table:
            if zero:
                s = (ShardSpec(dpd, "dp"),) if tpd is None else (ShardSpec(tpd, "tp"), ShardSpec(dpd, "dp"))
                out[f"optim.state.{pre}{name}.exp_avg*"] = s if len(s) > 1 else s[0]
            if tpd is not None:
                out[f"model.{pre}{name}"] = ShardSpec(tpd, "tp")
    return out


def global_params(layers: int) -> list[tuple[str, tuple[int, ...], int | None, int]]:
    out = [(f"model.{n}", s, t, d) for n, s, t, d in FIRST]
    for g in range(layers):
        out += [(f"model.layers.{g}.{n}", s, t, d) for n, s, t, d in LAYER]
    out += [(f"model.{n}", s, t, d) for n, s, t, d in LAST]
    return out


def global_values(layers: int) -> dict[str, torch.Tensor]:
    """Every global tensor, distinct values everywhere (a misplaced element shows)."""
    gen = torch.Generator().manual_seed(59)
    values: dict[str, torch.Tensor] = {}
    for key, shape, _, _ in global_params(layers):
        values[key] = torch.randn(shape, generator=gen)
        for o in OPT:
            values[f"{key}.{o}"] = torch.randn(shape, generator=gen)
        values[f"{key}.step"] = torch.tensor(float(len(values)))
    return values


def stage_params(layers: int, layout: ParallelLayout, stage: int) -> list[tuple[str, str, Any]]:
    """(local key, global key, row) of the params stage ``stage`` holds."""
    first = layout.layer_offset(stage)
    count = layout.pp_layers[stage]
    rows = {k: (k, s, t, d) for k, s, t, d in global_params(layers)}
    out = []
    if stage == 0:
        out += [(n, f"model.{n}", rows[f"model.{n}"]) for n, *_ in FIRST]
    for i in range(count):
        out += [
            (f"layers.{i}.{n}", f"model.layers.{first + i}.{n}", rows[f"model.layers.{first + i}.{n}"])
            for n, *_ in LAYER
        ]
    if stage == layout.pp - 1:
        out += [(n, f"model.{n}", rows[f"model.{n}"]) for n, *_ in LAST]
    return out


def cut(t: torch.Tensor, dim: int | None, parts: int, index: int) -> torch.Tensor:
    if dim is None:
        return t
    step = t.shape[dim] // parts
    return t.narrow(dim, index * step, step)


class World:
    """Per-rank state dicts, pieces shared between ranks that hold the same piece (memory stays small)."""

    def __init__(self, layers: int, layout: ParallelLayout, values: dict[str, torch.Tensor], zero: bool) -> None:
        self.layers, self.layout, self.values, self.zero = layers, layout, values, zero
        self._pieces: dict[tuple[Any, ...], torch.Tensor] = {}

    def piece(self, gkey: str, suffix: str, tpd: int | None, dpd: int, tp: int, dp: int) -> torch.Tensor:
        opt = suffix in OPT
        memo = (gkey, suffix, tp, dp if (opt and self.zero) else None)
        got = self._pieces.get(memo)
        if got is None:
            t = self.values[gkey + suffix if not suffix else f"{gkey}.{suffix}"]
            t = cut(t, tpd, self.layout.tp, tp)
            if opt and self.zero:
                t = cut(t, dpd, self.layout.dp, dp)
            got = self._pieces[memo] = t.contiguous().clone()
        return got

    def rank_state(self, rank: int, blank: bool = False) -> dict[str, Any]:
        c = self.layout.coords(rank)
        model: dict[str, torch.Tensor] = {}
        optim: dict[str, torch.Tensor] = {}
        for local, gkey, (_, _, tpd, dpd) in stage_params(self.layers, self.layout, c.pp):
            p = self.piece(gkey, "", tpd, dpd, c.tp, c.dp)
            e = [self.piece(gkey, o, tpd, dpd, c.tp, c.dp) for o in OPT]
            s = self.values[f"{gkey}.step"]
            if blank:
                p, s = torch.full_like(p, -7.0), torch.full_like(s, -7.0)
                e = [torch.full_like(x, -7.0) for x in e]
            model[local] = p
            optim[f"state.{local}.exp_avg"] = e[0]
            optim[f"state.{local}.exp_avg_sq"] = e[1]
            optim[f"state.{local}.step"] = s
        return {"model": model, "optim": optim}


def even_layout(tp: int, pp: int, dp: int, layers: int) -> ParallelLayout:
    base, extra = divmod(layers, pp)
    return ParallelLayout(tp=tp, pp=pp, dp=dp, pp_layers=tuple(base + (i < extra) for i in range(pp)))


class Timer:
    def __init__(self, profile: str | None) -> None:
        self.t: dict[str, float] = {}
        self.profile = profile
        self.prof: cProfile.Profile | None = None

    def run(self, step: str, fn: Any) -> Any:
        prof = cProfile.Profile() if self.profile == step else None
        start = time.perf_counter()
        if prof:
            prof.enable()
        try:
            return fn()
        finally:
            if prof:
                prof.disable()
                self.prof = prof
            self.t[step] = self.t.get(step, 0.0) + time.perf_counter() - start


def save(world: World, store: Any, timer: Timer, sizes: dict[str, int]) -> list[ParallelSavePlanner]:
    layout = world.layout
    n = layout.world_size
    spec = specs(world.zero)
    planners = [ParallelSavePlanner(layout, spec, rank=r) for r in range(n)]
    if isinstance(store, str):
        writers: list[Any] = [FsspecStorageWriter(store) for _ in range(n)]
    else:
        writers = [MemoryWriter(store) for _ in range(n)]
    plans = []
    gathered = 0
    for r in range(n):
        sd = world.rank_state(r)
        writers[r].set_up_storage_writer(r == 0, rank=r, use_collectives=True)

        def local(r: int = r, sd: dict = sd) -> Any:
            planners[r].set_up_planner(state_dict=sd, storage_meta=None, is_coordinator=r == 0)
            return planners[r].create_local_plan()

        plan = timer.run("save.local", local)
        plan = timer.run("save.w_prep_local", lambda r=r, p=plan: writers[r].prepare_local_plan(p))
        raw = timer.run("save.local_pickle", lambda p=plan: pickle.dumps(p))
        gathered += len(raw)
        plans.append(raw)
    sizes["save.gathered"] = gathered
    # the coordinator unpickles every rank's plan (gather_object), plans, pickles each rank's share
    plans = timer.run("save.gather_unpickle", lambda: [pickle.loads(b) for b in plans])
    global_plans, metadata = timer.run("save.global", lambda: planners[0].create_global_plan(plans))
    global_plans = timer.run("save.w_prep_global", lambda: writers[0].prepare_global_plan(global_plans))
    shares = timer.run("save.scatter_pickle", lambda: [pickle.dumps(p) for p in global_plans])
    sizes["save.scattered"] = sum(len(b) for b in shares)
    global_plans = [timer.run("save.scatter_unpickle", lambda b=b: pickle.loads(b)) for b in shares]
    sizes["metadata"] = len(pickle.dumps(metadata))
    sizes["save.items"] = sum(len(p.items) for p in global_plans)
    results = []
    for r in range(n):
        final = timer.run("save.finish", lambda r=r: planners[r].finish_plan(global_plans[r]))
        results.append(timer.run("save.write", lambda r=r, f=final: writers[r].write_data(f, planners[r]).wait()))
    timer.run("save.w_finish", lambda: writers[0].finish(metadata=metadata, results=results))
    return planners


def load(world: World, store: Any, timer: Timer, sizes: dict[str, int], tag: str) -> list[dict[str, Any]]:
    layout = world.layout
    n = layout.world_size
    spec = specs(world.zero)
    planners = [ParallelLoadPlanner(layout, spec, rank=r) for r in range(n)]
    if isinstance(store, str):
        return load_fs(world, store, timer, sizes, tag, planners)
    readers = [MemoryReader(store) for _ in range(n)]
    dests = []
    plans = []
    # every rank unpickles the same metadata: timed once (a per-rank cost), one copy shared by the
    # simulated ranks (a copy each took ~10 MiB per rank at 256 ranks)
    metadata = timer.run(f"{tag}.md_unpickle_1rank", readers[0].read_metadata)
    for r in range(n):
        dest = world.rank_state(r, blank=True)
        dests.append(dest)

        def local(r: int = r, dest: dict = dest, md: Any = metadata) -> Any:
            planners[r].set_up_planner(dest, md, r == 0)
            return planners[r].create_local_plan()

        plan = timer.run(f"{tag}.local", local)
        plans.append(timer.run(f"{tag}.local_pickle", lambda p=plan: pickle.dumps(p)))
    plans = timer.run(f"{tag}.gather_unpickle", lambda: [pickle.loads(b) for b in plans])
    global_plans = timer.run(f"{tag}.global", lambda: planners[0].create_global_plan(plans))
    shares = timer.run(f"{tag}.scatter_pickle", lambda: [pickle.dumps(p) for p in global_plans])
    sizes[f"{tag}.scattered"] = sum(len(b) for b in shares)
    global_plans = [timer.run(f"{tag}.scatter_unpickle", lambda b=b: pickle.loads(b)) for b in shares]
    sizes[f"{tag}.reads"] = sum(len(p.items) for p in global_plans)
    for r in range(n):
        final = timer.run(f"{tag}.finish", lambda r=r: planners[r].finish_plan(global_plans[r]))
        timer.run(f"{tag}.read", lambda r=r, f=final: readers[r].read_data(f, planners[r]).wait())
    return dests


def load_fs(world: World, path: str, timer: Timer, sizes: dict[str, int], tag: str, planners: list) -> list:
    """The same steps through FsspecStorageReader: every rank reads the manifest and metadata itself."""
    n = world.layout.world_size
    readers = [FsspecStorageReader(path) for _ in range(n)]
    dests, plans = [], []
    for r in range(n):
        dest = world.rank_state(r, blank=True)
        dests.append(dest)
        md = timer.run(f"{tag}.r_read_metadata", readers[r].read_metadata)

        def local(r: int = r, dest: dict = dest, md: Any = md) -> Any:
            planners[r].set_up_planner(dest, md, r == 0)
            readers[r].set_up_storage_reader(md, r == 0, rank=r, use_collectives=True)
            return readers[r].prepare_local_plan(planners[r].create_local_plan())

        plan = timer.run(f"{tag}.local", local)
        plans.append(timer.run(f"{tag}.local_pickle", lambda p=plan: pickle.dumps(p)))
    plans = timer.run(f"{tag}.gather_unpickle", lambda: [pickle.loads(b) for b in plans])
    global_plans = timer.run(f"{tag}.global", lambda: planners[0].create_global_plan(plans))
    global_plans = timer.run(f"{tag}.r_prep_global", lambda: readers[0].prepare_global_plan(global_plans))
    shares = timer.run(f"{tag}.scatter_pickle", lambda: [pickle.dumps(p) for p in global_plans])
    sizes[f"{tag}.scattered"] = sum(len(b) for b in shares)
    sizes[f"{tag}.reads"] = sum(len(p.items) for p in global_plans)
    global_plans = [timer.run(f"{tag}.scatter_unpickle", lambda b=b: pickle.loads(b)) for b in shares]
    for r in range(n):
        final = timer.run(f"{tag}.finish", lambda r=r: planners[r].finish_plan(global_plans[r]))
        timer.run(f"{tag}.read", lambda r=r, f=final: readers[r].read_data(f, planners[r]).wait())
    return dests


def check(world: World, dests: list[dict[str, Any]]) -> int:
    """Bit-exact: every destination rank's tensors against the pieces of the full state. Returns the
    number of tensors compared."""
    checked = 0
    for r, dest in enumerate(dests):
        want = world.rank_state(r)
        for part in ("model", "optim"):
            if want[part].keys() != dest[part].keys():
                raise AssertionError(f"rank {r}: keys differ in {part}")
            for k, v in want[part].items():
                got = dest[part][k]
                if got.dtype != v.dtype or not torch.equal(got, v):
                    raise AssertionError(f"BUG rank {r} ({world.layout.coords(r)}): {part}.{k} differs after the load")
                checked += 1
    return checked


def parse_layout(text: str, layers: int) -> ParallelLayout:
    tp, pp, dp = (int(x) for x in text.split("x"))
    return even_layout(tp, pp, dp, layers)


LAYOUTS = {  # world: (saved layout, reshard-load layout), TPxPPxDP
    8: ("2x2x2", "1x2x2"),
    64: ("4x4x4", "2x2x2"),
    256: ("8x8x4", "4x4x2"),
    512: ("8x8x8", "4x4x4"),
    1024: ("8x8x16", "4x4x8"),
    2048: ("8x16x16", "8x8x8"),
}


def print_table(rows: list[dict[str, Any]]) -> None:
    """Steps as rows, worlds as columns (seconds; per-rank steps summed over ranks), and each step's
    growth: (time ratio last/first world) / (rank*keys ratio) -- about 1 when linear in rank*keys."""
    steps = [k for k in rows[0] if "." in k and isinstance(rows[0][k], float)]
    first, last = rows[0], rows[-1]
    scale = last["rank_keys"] / first["rank_keys"]
    print(f"\n{'step (s)':<26}" + "".join(f"{r['world']:>10}" for r in rows) + f"{'growth':>9}")
    print(f"{'rank*keys':<26}" + "".join(f"{r['rank_keys']:>10}" for r in rows))
    for s in steps:
        growth = (last[s] / first[s]) / scale if first[s] > 0 else float("nan")
        print(f"{s:<26}" + "".join(f"{r[s]:>10.3f}" for r in rows) + f"{growth:>9.2f}")
    for k in ("save.items", "reshard.reads", "metadata", "save.gathered", "save.scattered", "maxrss_mib", "checked"):
        print(f"{k:<26}" + "".join(f"{r[k]:>10}" for r in rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 layers, worlds 8 and 64: a few seconds")
    ap.add_argument("--layers", type=int, default=None, help="transformer layers (default 80, quick 8)")
    ap.add_argument("--worlds", default=None, help=f"comma-separated, of {sorted(LAYOUTS)} (default 8,64,256,512,1024)")
    ap.add_argument("--no-zero", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--profile", default=None, help="STEP@WORLD, e.g. save.global@512")
    ap.add_argument("--profile-out", default=None)
    ap.add_argument("--out", default="benchmarks/out/scale.json")
    ap.add_argument(
        "--storage", choices=("memory", "fs"), default="memory", help="fs: FsspecStorageWriter/Reader in a temp folder"
    )
    args = ap.parse_args()
    layers = args.layers if args.layers is not None else (8 if args.quick else 80)
    worlds = [int(x) for x in (args.worlds or ("8,64" if args.quick else "8,64,256,512,1024")).split(",")]
    for w in worlds:
        if w not in LAYOUTS:
            ap.error(f"world {w}: choose among {sorted(LAYOUTS)}")
    started = datetime.now(timezone.utc)
    t0 = time.perf_counter()
    values = global_values(layers)
    prof_step, prof_world = (args.profile.split("@") + [None])[:2] if args.profile else (None, None)
    rows = []
    for w in worlds:
        src_text, dst_text = LAYOUTS[w]
        src, dst = parse_layout(src_text, layers), parse_layout(dst_text, layers)
        reset_dcp_caches()
        timer = Timer(prof_step if prof_world is None or int(prof_world) == w else None)
        sizes: dict[str, int] = {}
        tmp = tempfile.TemporaryDirectory(prefix="scale59-") if args.storage == "fs" else None
        store: Any = os.path.join(tmp.name, "ckpt") if tmp is not None else MemoryStore()
        world = World(layers, src, values, zero=not args.no_zero)
        gc.collect()
        gc.freeze()
        # one process holds every simulated rank's objects: a collection here walks all of them, which
        # no real rank's would; off, so the steps' times are the planners' own
        gc.disable()
        save(world, store, timer, sizes)
        same = load(world, store, timer, sizes, "load")
        checked = 0
        if not args.no_check:
            checked += check(world, same)
        del same
        dworld = World(layers, dst, values, zero=not args.no_zero)
        resh = load(dworld, store, timer, sizes, "reshard")
        if not args.no_check:
            checked += check(dworld, resh)
        del resh
        gc.enable()
        gc.unfreeze()
        if tmp is not None:
            tmp.cleanup()
        keys = sum(len(world.rank_state(r)["model"]) * 4 for r in range(w))  # rank x keys
        row = {"world": w, "save_layout": src_text, "reshard_to": dst_text, "rank_keys": keys, **timer.t, **sizes}
        row["checked"] = checked
        row["maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        rows.append(row)
        print(
            f"world {w}: done ({row['checked']} tensors checked bit-exact, maxrss {row['maxrss_mib']} MiB)", flush=True
        )
        if timer.prof is not None:
            if args.profile_out:
                timer.prof.dump_stats(args.profile_out)
            pstats.Stats(timer.prof).sort_stats("cumulative").print_stats(30)
            pstats.Stats(timer.prof).sort_stats("tottime").print_stats(20)
    print_table(rows)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "started_utc": started.isoformat(timespec="seconds"),
                "elapsed_s": time.perf_counter() - t0,
                "command": " ".join(sys.argv),
                "machine": platform.platform(),
                "processor": platform.processor(),
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "layers": layers,
                "zero": not args.no_zero,
                "storage": args.storage,
                "rows": rows,
            },
            f,
            indent=1,
        )
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()

"""Resident memory across tiered saves (rss61): each rank's RSS after every one of ``--saves`` async
saves through one ``Checkpointer`` with ``FastTier(replicas=2, durable_every=2, num_kept_local=2)``, and
each save's time (from ``save`` to ``wait`` returned on every rank: its fast tiers, replicas and, every
second save, its drain), at a Llama-70B *shape* scaled down: 80 layers x 9 tensors + embedding, norm and
head (hidden 128, KV 32, MLP 352, vocab 2048), Adam state, TP=2 x PP=2 on 4 gloo ranks (2 simulated nodes
of 2 ranks, ``LOCAL_WORLD_SIZE=2``): ~44 MiB of state per rank. Fast tiers under ``--shm-dir``, the durable
folder under ``--disk-dir``. ``--trim`` calls glibc's ``malloc_trim(0)`` after each save (a complement
measured beside the fix, not in the library). ``--plain``: the same saves without a fast tier (each one
written straight to ``--disk-dir``, async, the Checkpointer keeping the 2 newest). Each row also counts the
threads the save started (``Thread.start`` calls on each rank; none once the Checkpointer keeps them).

To compare two trees side by side, run this file with ``PYTHONPATH`` at each tree's export (see
RESULTS.md, "Resident memory across tiered saves")::

    python benchmarks/bench_tier_rss.py --saves 16 --out /tmp/new.json
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import zlib
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import smpckpt
from smpckpt import ParallelLayout, ShardSpec

LAYERS, H, KV, FF, VOCAB = 80, 128, 32, 352, 2048
LAYER = (("input_layernorm", (H,), None), ("q_proj", (H, H), 0), ("k_proj", (KV, H), 0), ("v_proj", (KV, H), 0))
LAYER += (("o_proj", (H, H), 1), ("post_attention_layernorm", (H,), None), ("gate_proj", (FF, H), 0))
LAYER += (("up_proj", (FF, H), 0), ("down_proj", (H, FF), 1))
SPECS = {f"model.{n}.weight": ShardSpec(0) for n in ("embed_tokens", "lm_head")}
SPECS |= {f"model.layers.*.{n}.weight": ShardSpec(d) for n, _, d in LAYER if d is not None}


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def _state(layout: ParallelLayout, rank: int, k: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """This rank's model (its PP stage's layers, its TP slice) and Adam state, of version ``k``."""
    c, per = layout.coords(rank), LAYERS // layout.pp
    names = [("embed_tokens", "embed_tokens", (VOCAB, H), 0)] if c.pp == 0 else []
    names += [(f"layers.{i}.{n}", f"{c.pp * per + i}.{n}", s, d) for i in range(per) for n, s, d in LAYER]
    names += [("norm", "norm", (H,), None), ("lm_head", "lm_head", (VOCAB, H), 0)] if c.pp == layout.pp - 1 else []
    model, layers = nn.Module(), nn.ModuleList(nn.Module() for _ in range(per))
    model.add_module("layers", layers)
    for name, key, shape, dim in names:
        g = torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(key.encode())))
        t = g if dim is None else g.chunk(layout.tp, dim)[c.tp].contiguous()
        *at, leaf = name.split(".")
        mod = layers[int(at[1])] if at else model
        if not hasattr(mod, leaf):
            mod.add_module(leaf, nn.Module())
        getattr(mod, leaf).register_parameter("weight", nn.Parameter(t + k))
    opt = torch.optim.Adam(list(model.parameters()))
    for p in model.parameters():
        opt.state[p] = {"step": torch.tensor(float(k)), "exp_avg": p.detach() + 0.5, "exp_avg_sq": p.detach().abs()}
    return model, opt


def worker(rank: int, cfg: dict[str, Any]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=cfg["init"], rank=rank, world_size=4)
    layout = ParallelLayout(tp=2, pp=2, pp_layers=(LAYERS // 2, LAYERS // 2))
    tier = smpckpt.FastTier(f"{cfg['shm']}/node{rank // 2}", replicas=2, durable_every=2, num_kept_local=2)
    started = [0]
    start = threading.Thread.start

    def counted(thread: threading.Thread) -> None:
        started[0] += 1
        start(thread)

    threading.Thread.start = counted  # type: ignore[method-assign]
    ck = smpckpt.Checkpointer(
        cfg["durable"],
        smpckpt.Sharding(layout, SPECS),
        fast_tier=None if cfg["plain"] else tier,
        retention=smpckpt.Retention(num_kept_partial_checkpoints=2),
        async_options=smpckpt.AsyncOptions(enabled=True),
    )
    rows = []
    for k in range(1, cfg["saves"] + 1):
        model, opt = _state(layout, rank, k)
        dist.barrier()
        t, started[0] = time.perf_counter(), 0
        ck.save(f"step{k}", model, opt, user_content={"step": k})
        ck.wait()
        dist.barrier()
        dt = time.perf_counter() - t
        del model, opt
        gc.collect()
        if cfg["trim"]:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        rows.append({"save": k, "s": dt, "rss_mib": _rss_mib(), "threads": started[0]})
    ck.close()
    dist.destroy_process_group()
    with open(f"{cfg['out']}.r{rank}", "w") as f:
        json.dump(rows, f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--saves", type=int, default=16)
    ap.add_argument("--trim", action="store_true", help="malloc_trim(0) after each save (glibc)")
    ap.add_argument("--plain", action="store_true", help="no fast tier: every save to --disk-dir")
    ap.add_argument("--shm-dir", default="/dev/shm")
    ap.add_argument("--disk-dir", default=tempfile.gettempdir())
    ap.add_argument("--out", required=True, help="JSON path")
    a = ap.parse_args()
    shm, disk = tempfile.mkdtemp(dir=a.shm_dir), tempfile.mkdtemp(dir=a.disk_dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = {"init": f"tcp://127.0.0.1:{port}", "shm": shm, "durable": f"{disk}/durable", "saves": a.saves}
    cfg |= {"trim": a.trim, "out": a.out, "plain": a.plain}
    try:
        mp.spawn(worker, args=(cfg,), nprocs=4, join=True)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    ranks = []
    for r in range(4):
        with open(f"{a.out}.r{r}") as f:
            ranks.append(json.load(f))
        os.remove(f"{a.out}.r{r}")
    table = [
        {
            "save": i + 1,
            "s": ranks[0][i]["s"],
            "rss_mib": [x[i]["rss_mib"] for x in ranks],
            "threads": [x[i]["threads"] for x in ranks],
        }
        for i in range(a.saves)
    ]
    print(f"smpckpt from {os.path.dirname(smpckpt.__file__)}; trim={a.trim} plain={a.plain}")
    print(f"{'save':>4} {'time s':>7}  RSS per rank after the save (MiB)   threads started per rank")
    for row in table:
        rss, threads = " ".join(f"{m:6.0f}" for m in row["rss_mib"]), " ".join(f"{n:3d}" for n in row["threads"])
        print(f"{row['save']:>4} {row['s']:>7.2f}  {rss}   {threads}")
    with open(a.out, "w") as f:
        json.dump({"argv": sys.argv, "smpckpt": smpckpt.__file__, "saves": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

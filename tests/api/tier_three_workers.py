"""Rank functions of test_tiers_replicas3.py: 3 simulated nodes x 1 gloo rank (``LOCAL_WORLD_SIZE=1``),
``replicas=3`` (each rank's files streamed to both other nodes while written), each node's fast tier its
own folder under ``base/fast``."""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from smpckpt import (
    FastTier,
    ParallelLayout,
    ResumeOptions,
    SaveOptions,
    ShardSpec,
    last_resume_info,
    resume_from_checkpoint,
    save_checkpoint,
    wait_for_saves,
)
from smpckpt.api._tiers import durable_key, job_folder
from smpckpt.storage.format.manifest import MANIFEST_NAME, Manifest

#: rows per rank; a file of 3 MiB: several replica messages (1 MiB coalesced writes and larger ones)
ROWS, COLS = 768, 1024
LAYOUT = ParallelLayout(tp=3)
SPECS = {"model.w": ShardSpec(dim=0)}


class Holder(nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("w", w)


def rows(rank: int, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s rows: each element its flat index in the global tensor (plus ``salt``)."""
    start = rank * ROWS * COLS + salt
    return torch.arange(start, start + ROWS * COLS, dtype=torch.int32).view(ROWS, COLS)


def node_job(base: str, node: int, durable: str) -> str:
    return job_folder(os.path.join(base, "fast", f"node{node}"), durable_key(durable, None))


def files_of(folder: str) -> dict[int, str]:
    """rank -> the data file it wrote (one per rank here), from ``folder``'s manifest."""
    with open(os.path.join(folder, MANIFEST_NAME), "rb") as f:
        recs = Manifest.from_bytes(f.read()).files
    out: dict[int, str] = {}
    for r in recs:
        if r.rank in out:
            raise AssertionError(f"{folder}: rank {r.rank} wrote more than one file")
        out[r.rank] = r.name
    return out


def flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def three_replicas(rank: int, world: int, base: str) -> dict[str, Any]:
    """s1 saved with replicas=3 (not drained); (a) nodes 1 and 2 wiped: resume(tag=None) from node 0's
    replicas; (b) a byte of node 0's copy of rank 0's file flipped: a resume heals it from a peer;
    (c) s2 saved and drained (its second save) while the copies of rank 0's file on node 0 and node 1
    are damaged just before the drain checks each: the drain's third round takes node 2's; a resume from
    ``path`` alone is bit-exact. Then s3 saved (not due) with every node up."""
    import smpckpt.api._drain as drain

    os.environ["LOCAL_WORLD_SIZE"] = "1"
    durable, local = os.path.join(base, "durable"), os.path.join(base, "fast", f"node{rank}")
    tier = FastTier(local, replicas=3, durable_every=2, num_kept_local=None)
    model = Holder(rows(rank))
    out: dict[str, Any] = {}

    def resume(**kw: Any) -> dict[str, Any]:
        model.w.zero_()
        resume_from_checkpoint(durable, model=model, layout=LAYOUT, specs=SPECS, **kw)
        info = last_resume_info()
        assert info is not None
        return {
            "tag": info.tag,
            "tier": info.tier,
            "from_peers": info.from_peers,
            "exact": torch.equal(model.w, rows(rank)),
        }

    opts = (SaveOptions(save_rng=False), tier)
    save_checkpoint(durable, "s1", model=model, layout=LAYOUT, specs=SPECS, options=opts)
    wait_for_saves()
    dist.barrier()
    jobs = [node_job(base, n, durable) for n in range(3)]
    names = files_of(os.path.join(jobs[0], "s1_partial"))
    out["names"] = names
    # every node holds every rank's file, byte-identical
    copies = [{r: read(os.path.join(j, "s1_partial", n)) for r, n in names.items()} for j in jobs]
    out["replicated"] = sorted(names) == [0, 1, 2] and copies[0] == copies[1] == copies[2]
    del copies
    dist.barrier()

    # (a) nodes 1 and 2 lost: everything from node 0's replicas
    if rank in (1, 2):
        shutil.rmtree(local)
    dist.barrier()
    resumed = (ResumeOptions(load_rng=False), FastTier(local, replicas=3))
    out["two_lost"] = resume(options=resumed)
    dist.barrier()

    # (b) node 0's own copy of rank 0's file damaged
    victim = os.path.join(jobs[0], "s1_partial", names[0])
    good = read(
        os.path.join(jobs[1], "s1_partial", names[0])
    )  # fetched into node 1 by (a): rank 0's file holds user_content
    if rank == 0:
        flip(victim, len(good) // 2)
    dist.barrier()
    out["healed_resume"] = resume(options=resumed)
    dist.barrier()
    out["healed"] = read(victim) == good
    dist.barrier()

    # (c) s2 drained while the copies of rank 0's file on nodes 0 and 1 are damaged before each is checked
    real_check, damaged = drain.check_blocks, []

    def damaging(fs: Any, path: str, rec: Any, *args: Any, **kwargs: Any) -> bool:
        if rank in (0, 1) and rec.rank == 0 and not damaged:
            flip(path, rec.size // 2)  # as a failing disk would, between the save and its drain
            damaged.append(path)
        return real_check(fs, path, rec, *args, **kwargs)

    drain.check_blocks = damaging  # type: ignore[assignment]
    try:
        save_checkpoint(durable, "s2", model=model, layout=LAYOUT, specs=SPECS, options=opts)
        wait_for_saves()
    finally:
        drain.check_blocks = real_check  # type: ignore[assignment]
    dist.barrier()
    out["damaged"] = damaged
    out["durable"] = sorted(os.listdir(durable))
    names2 = files_of(os.path.join(durable, "s2_partial"))
    out["durable_is_node2s"] = read(os.path.join(durable, "s2_partial", names2[0])) == read(
        os.path.join(jobs[2], "s2_partial", names2[0])
    )
    out["from_path"] = resume(tag="s2", options=ResumeOptions(load_rng=False))
    dist.barrier()
    # s3 (not due for path): every node holds every rank's file again, for ``smpckpt verify --local``
    save_checkpoint(durable, "s3", model=model, layout=LAYOUT, specs=SPECS, options=opts)
    wait_for_saves()
    return out

"""Rank functions of test_replicas_past_2_gib.py: 2 simulated nodes x 1 gloo rank (``LOCAL_WORLD_SIZE=1``),
each rank's state one int32 tensor of 2.25 GiB (its TP=2 half of a tensor whose elements hold their own
flat index), its file past 2**31 bytes, replicated to the other node."""

from __future__ import annotations

import os
import resource
import shutil
import time
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

#: rows per rank: 589,824 x 1024 int32 = 2.25 GiB per rank (2,415,919,104 bytes, past 2**31); both ranks'
#: flat indices (up to 1.2 G) fit int32
ROWS, COLS = 576 * 1024, 1024
LAYOUT = ParallelLayout(tp=2)
SPECS = {"model.w": ShardSpec(dim=0)}
#: a byte of the tensor's file past 2 GiB (the file's header is a few KiB: still in the tensor's bytes)
PAST_2 = 2**31 + 4097


class Holder(nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("w", w)


def rows(rank: int, lo: int, hi: int) -> torch.Tensor:
    """Rows ``lo..hi`` of rank ``rank``'s half: each element its flat index in the global tensor."""
    start = (rank * ROWS + lo) * COLS
    return torch.arange(start, start + (hi - lo) * COLS, dtype=torch.int32).view(hi - lo, COLS)


def exact(w: torch.Tensor, rank: int) -> bool:
    """``w`` is rank ``rank``'s half, bit-exact; compared a slice at a time (no second 2.25 GiB tensor)."""
    step = ROWS // 16
    return all(torch.equal(w[lo : lo + step], rows(rank, lo, min(lo + step, ROWS))) for lo in range(0, ROWS, step))


def node_job(base: str, node: int, durable: str) -> str:
    return job_folder(os.path.join(base, f"node{node}"), durable_key(durable, None))


def big_file(folder: str, rank: int) -> tuple[str, int]:
    """The name and size of the file past 2**31 bytes that ``rank`` wrote, from ``folder``'s manifest."""
    with open(os.path.join(folder, MANIFEST_NAME), "rb") as f:
        (rec,) = [r for r in Manifest.from_bytes(f.read()).files if r.rank == rank and r.size > 2**31]
    return rec.name, rec.size


def flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def byte_at(path: str, at: int) -> int:
    with open(path, "rb") as f:
        f.seek(at)
        return f.read(1)[0]


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def replicas_past_2_gib(rank: int, world: int, base: str) -> dict[str, Any]:
    """t1 saved to the fast tiers with replicas=2 (durable_every=2: not drained). (a) Node 1's folder
    wiped: resume(tag=None) on both ranks, rank 1's file fetched from node 0's replica. (b) A byte past
    2 GiB of node 0's copy of rank 0's file flipped: a resume heals it from node 1's replica. (c) t2
    saved and drained (its second save) while node 0's copy of rank 0's file is damaged past 2 GiB just
    before the drain checks it: the drain takes node 1's replica; a resume from ``path`` alone is
    bit-exact. Each resume loads into a zeroed tensor and is compared a slice at a time."""
    import smpckpt.api._drain as drain
    import smpckpt.storage.tier.writer as writer

    # the largest replica message this rank sends (README: the writer's chunks, ~1 MiB to 16 MiB): a whole
    # 2.25 GiB file in one gloo message would cost its receiver a 2.25 GiB buffer
    real_as_tensor, largest = writer._as_tensor, [0]

    def measured(data: Any) -> torch.Tensor:
        largest[0] = max(largest[0], len(data))
        return real_as_tensor(data)

    writer._as_tensor = measured  # type: ignore[assignment]
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    durable, local = os.path.join(base, "durable"), os.path.join(base, f"node{rank}")
    tier = FastTier(local, replicas=2, durable_every=2, num_kept_local=1)
    model = Holder(rows(rank, 0, ROWS))
    out: dict[str, Any] = {"times": {}}
    t0 = time.monotonic()

    def lap(name: str) -> None:
        dist.barrier()
        out["times"][name] = round(time.monotonic() - t0, 1)

    def resume(**kw: Any) -> dict[str, Any]:
        model.w.zero_()
        resume_from_checkpoint(durable, model=model, layout=LAYOUT, specs=SPECS, **kw)
        info = last_resume_info()
        assert info is not None
        return {"tag": info.tag, "tier": info.tier, "from_peers": info.from_peers, "exact": exact(model.w, rank)}

    save_checkpoint(durable, "t1", model=model, layout=LAYOUT, specs=SPECS, options=(SaveOptions(save_rng=False), tier))
    wait_for_saves()
    lap("save")
    out["largest_replica_message"] = largest[0]
    node0, node1 = node_job(base, 0, durable), node_job(base, 1, durable)
    names = [big_file(os.path.join(node0, "t1_partial"), r) for r in range(2)]
    out["names"] = names
    out["node1_held"] = sorted(os.listdir(os.path.join(node1, "t1_partial")))
    out["replicated"] = all(
        os.path.getsize(os.path.join(n, "t1_partial", name)) == size for n in (node0, node1) for name, size in names
    )
    dist.barrier()  # both ranks looked before rank 1 wipes node 1 (a rank slower to look found a file gone)

    # (a) node 1 lost
    if rank == 1:
        shutil.rmtree(local)
    dist.barrier()
    out["lost"] = resume(options=(ResumeOptions(load_rng=False), FastTier(local, replicas=2)))
    lap("resume_lost_node")

    # (b) a byte past 2 GiB of node 0's own copy of rank 0's file flipped
    victim = os.path.join(node0, "t1_partial", names[0][0])
    good = byte_at(os.path.join(node1, "t1_partial", names[0][0]), PAST_2)
    if rank == 0:
        flip(victim, PAST_2)
        out["flipped"] = byte_at(victim, PAST_2) != good
    dist.barrier()
    out["healed_resume"] = resume(options=(ResumeOptions(load_rng=False), FastTier(local, replicas=2)))
    out["healed"] = byte_at(victim, PAST_2) == good and os.path.getsize(victim) == names[0][1]
    lap("resume_heal")

    # (c) the drain of t2 (the job's second save: due), node 0's copy of rank 0's file damaged past 2 GiB
    real_check, damaged = drain.check_blocks, []

    def damaging(fs: Any, path: str, rec: Any, *args: Any, **kwargs: Any) -> bool:
        # rank 0 copies its own file from its own node (node 0) first
        if rank == 0 and rec.rank == 0 and rec.size > 2**31 and not damaged:
            flip(path, PAST_2)  # as a failing disk would, between the save and its drain
            damaged.append(path)
        return real_check(fs, path, rec, *args, **kwargs)

    drain.check_blocks = damaging  # type: ignore[assignment]
    try:
        save_checkpoint(
            durable, "t2", model=model, layout=LAYOUT, specs=SPECS, options=(SaveOptions(save_rng=False), tier)
        )
        wait_for_saves()
    finally:
        drain.check_blocks = real_check  # type: ignore[assignment]
    out["damaged_by"] = damaged
    lap("save_and_drain")
    out["durable"] = sorted(os.listdir(durable))
    name2 = big_file(os.path.join(durable, "t2_partial"), 0)[0]
    out["durable_byte_ok"] = byte_at(os.path.join(durable, "t2_partial", name2), PAST_2) == good
    out["node0_still_damaged"] = byte_at(os.path.join(node0, "t2_partial", name2), PAST_2) != good
    out["from_path"] = resume(tag="t2", options=ResumeOptions(load_rng=False))
    lap("resume_from_path")
    out["peak_rss_gib"] = round(_peak_gib(), 2)
    return out

"""Rank functions for tests/storage/test_tier_stream.py: two ranks, each a node of its own, sending the
files they write to each other with :class:`smpckpt.storage.tier.Replicator`."""

from __future__ import annotations

import os
import zlib
from typing import Any

import torch.distributed as dist

from smpckpt.storage.backends._sinks import LocalSink
from smpckpt.storage.tier import Replicator

BIG = 3 << 20  # larger than the coalescing size: sent as its own message while it is written


def payload(rank: int, name: str, size: int) -> bytes:
    """Distinct bytes per rank and file."""
    seed = (zlib.crc32(f"{rank}/{name}".encode()) & 0xFF) or 1
    return bytes((seed * (i + 1)) % 251 for i in range(256)) * (size // 256) + b"x" * (size % 256)


def exchange(rank: int, world: int, base: str) -> dict[str, Any]:
    """Each rank writes four files into its own folder through the replicator: one in many small writes,
    one in big writes, one empty, and one aborted half-way; rank 1 also names a file ``../escape``
    (its receiver refuses it, without blocking the stream). What each folder holds afterwards, and the
    errors each rank saw."""
    folder = os.path.join(base, f"node{rank}")
    os.makedirs(folder, exist_ok=True)
    groups = [dist.new_group(backend="gloo") for _ in range(2)]
    rep = Replicator(
        rank=rank, world_size=world, local_world_size=1, replicas=2, groups=groups, folder=folder, sync=True
    )
    rep.start()
    files = {"small.bin": 100_003, "big.bin": 2 * BIG + 17, "empty.bin": 0}
    for name, size in files.items():
        data = payload(rank, name, size)
        sink = rep.sink(LocalSink(os.path.join(folder, f"own-{rank}-{name}"), sync=True), f"from{rank}-{name}")
        step = 999 if name == "small.bin" else BIG
        for i in range(0, len(data), step):
            sink.write(memoryview(data)[i : i + step])
        sink.commit()
    sink = rep.sink(LocalSink(os.path.join(folder, f"own-{rank}-aborted"), sync=True), f"from{rank}-aborted.bin")
    sink.write(memoryview(payload(rank, "aborted", BIG)))
    sink.abort()
    if rank == 1:
        sink = rep.sink(LocalSink(os.path.join(folder, "own-1-escape"), sync=True), "../escape")
        sink.write(memoryview(b"not here"))
        sink.commit()
        sink = rep.sink(LocalSink(os.path.join(folder, "own-1-after"), sync=True), "from1-after.bin")
        sink.write(memoryview(payload(1, "after", 5000)))
        sink.commit()
    outcome = rep.close()
    dist.barrier()
    peer = 1 - rank
    want = {f"from{peer}-{name}": payload(peer, name, size) for name, size in files.items()}
    if peer == 1:
        want["from1-after.bin"] = payload(1, "after", 5000)
    got = {}
    for name in want:
        if os.path.exists(os.path.join(folder, name)):
            with open(os.path.join(folder, name), "rb") as f:
                got[name] = f.read() == want[name]
    return {
        "listing": sorted(os.listdir(folder)),
        "received": sorted(t.name for t in outcome.received),
        "errors": outcome.errors,
        "exact": got,
        "escaped": os.path.exists(os.path.join(base, "escape")),
    }

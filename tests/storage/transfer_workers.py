"""Rank functions of tests/storage/test_transfers.py: files moved between ranks by
:func:`smpckpt.storage.tier.reader.run_transfers` (a resume's fetches from peers), with a chunk size far
below the files' so each file's chunking (whole chunks, a last partial one, exact multiples, empty files)
and the two buffers' alternation are exercised at every boundary."""

from __future__ import annotations

import os
import random
from typing import Any

import torch.distributed as dist

from smpckpt.storage.tier import reader

#: the chunk size the workers use (odd: no size below is aligned to a power of two by accident)
CHUNK = 4093
#: file sizes around the chunk boundaries: empty, 1 byte, one chunk +-1, exact multiples, and many chunks
SIZES = (0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 3 * CHUNK + 1, 25 * CHUNK + 77)


def content(rank: int, size: int) -> bytes:
    return random.Random(f"{rank}/{size}").randbytes(size)


def name(rank: int, size: int) -> str:
    return f"from{rank}-{size}.bin"


def small_chunks(rank: int, world: int, base: str) -> dict[str, Any]:
    """Every rank sends each of its files to every other rank over 3 streams (gloo groups), all at once;
    rank 0 also lists a file it does not hold and one whose size is not the one listed (each refused by
    its sender with an error; the receiver keeps no file of it and goes on to the next transfer). What
    each rank received, whether each is byte-identical, and the errors."""
    reader.CHUNK_BYTES = CHUNK
    folder = os.path.join(base, f"node{rank}")
    os.makedirs(folder, exist_ok=True)
    for size in SIZES:
        with open(os.path.join(folder, name(rank, size)), "wb") as f:
            f.write(content(rank, size))
    transfers = [
        reader.Transfer(name(src, size), size, src, dst)
        for size in SIZES
        for src in range(world)
        for dst in range(world)
        if src != dst
    ]
    # refused by rank 0 as sender: absent; 5 bytes on disk where the manifest would say 6
    with open(os.path.join(base, "node0", "short.bin") if rank == 0 else os.devnull, "wb") as f:
        f.write(b"12345")
    transfers[3:3] = [reader.Transfer("absent.bin", 10, 0, 1), reader.Transfer("short.bin", 6, 0, 1)]
    groups = [dist.new_group(backend="gloo") for _ in range(3)]
    dist.barrier()
    outcome = reader.run_transfers(
        transfers, rank=rank, group=groups, read_folder=folder, write_folder=folder, sync=False
    )
    exact = {}
    for t in outcome.received:
        with open(os.path.join(folder, t.name), "rb") as f:
            exact[t.name] = f.read() == content(t.src, t.size)
    return {
        "received": sorted(t.name for t in outcome.received),
        "exact": exact,
        "errors": outcome.errors,
        "listing": sorted(os.listdir(folder)),
    }

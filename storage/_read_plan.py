"""Read planning: which bytes each load item needs, widened to checksum blocks, coalesced into requests,
and which items may be read straight into their destination.

No I/O here; :func:`direct_target` asks the planner for the destination (on the calling thread).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from smpckpt.errors import CheckpointCorrupt
from smpckpt.storage._ranges import Fetch, Need, coalesce, slice_byte_range
from smpckpt.storage.manifest import FileRecord

__all__ = [
    "DIRECT_MIN_BYTES",
    "PIECE_BYTES",
    "Item",
    "FetchTask",
    "DirectCandidate",
    "ReadPlan",
    "raw_item",
    "plan_reads",
    "direct_target",
    "pieces",
]

# raw tensor items at least this large skip the shared buffer (read into the destination tensor)
DIRECT_MIN_BYTES = 1 << 20
# bytes of a direct item read (then verified) per task: pieces of one tensor run on several threads
PIECE_BYTES = 16 << 20


@dataclasses.dataclass(frozen=True)
class Item:
    """One load item and the exact bytes ``[start, end)`` of ``file`` it decodes from."""

    req: ReadItem
    file: str
    start: int
    end: int
    raw: bool  # raw tensor bytes (decode with dtype/shape) vs a torch.save record / object bytes
    dtype: torch.dtype | None = None
    chunk_sizes: tuple[int, ...] = ()

    @property
    def fqn(self) -> str:
        return self.req.storage_index.fqn


@dataclasses.dataclass(frozen=True)
class FetchTask:
    """One coalesced request into a pooled buffer: bytes ``fetch.start..fetch.end`` of ``file``."""

    file: str
    fetch: Fetch[Item]


@dataclasses.dataclass(frozen=True)
class DirectCandidate:
    """A raw item that may be read straight into its destination; ``need`` holds its block-widened
    range. Whether it is depends on the destination, resolved when its turn comes."""

    file: str
    need: Need[Item]


@dataclasses.dataclass(frozen=True)
class ReadPlan:
    fetches: list[FetchTask]  # by file, then offset
    empty: list[Item]  # items of no bytes (delivered without a read)
    direct: list[DirectCandidate]  # by file, then offset
    bytes_needed: int  # bytes of the requested slices / records (exact: a strided slice counts its elements)
    needed_per_file: dict[str, int] = dataclasses.field(default_factory=dict)


def raw_item(req: ReadItem, file: str, offset: int, length: int, dtype: torch.dtype, sizes: tuple[int, ...]) -> Item:
    """The item for a raw tensor record of ``length`` bytes at ``offset`` of ``file`` holding a chunk of
    shape ``sizes``: only the bytes of the requested slice (their enclosing span when it is strided)."""
    itemsize = dtype.itemsize
    lo, hi = slice_byte_range(sizes, list(req.storage_offsets), list(req.lengths), itemsize)
    if math.prod(sizes) * itemsize != length:
        raise CheckpointCorrupt(
            f"{file}: record of {req.storage_index.fqn!r} is {length} bytes, "
            f"its shape {list(sizes)} x {dtype} needs {math.prod(sizes) * itemsize}"
        )
    if not 0 <= lo <= hi <= length:
        raise CheckpointCorrupt(
            f"{file}: requested slice of {req.storage_index.fqn!r} (offsets {list(req.storage_offsets)}, "
            f"lengths {list(req.lengths)}) is outside its stored chunk {list(sizes)}"
        )
    return Item(req, file, offset + lo, offset + hi, True, dtype, sizes)


def plan_reads(
    items: list[Item],
    records: Mapping[str, FileRecord],
    *,
    verify: bool,
    local: bool,
    direct_min_bytes: int,
    coalesce_gap: int,
    max_request_bytes: int,
) -> ReadPlan:
    """Widen each item to whole checksum blocks (of files in ``records``, when ``verify``), set aside
    direct candidates (``local`` files only) and coalesce the rest per file."""
    per_file: dict[str, list[Need[Item]]] = {}
    empty: list[Item] = []
    direct: list[DirectCandidate] = []
    needed = 0
    needed_per_file: dict[str, int] = {}
    for it in items:
        if it.end <= it.start:
            empty.append(it)
            continue
        exact = _exact_bytes(it)
        needed += exact
        needed_per_file[it.file] = needed_per_file.get(it.file, 0) + exact
        lo, hi = _widen(it, records.get(it.file) if verify else None)
        if local and it.raw and it.end - it.start >= direct_min_bytes and _file_contiguous(it):
            # candidate for reading straight into the destination (decided when its target is resolved)
            direct.append(DirectCandidate(it.file, Need(lo, hi, it)))
            continue
        per_file.setdefault(it.file, []).append(Need(lo, hi, it))
    fetches = [
        FetchTask(name, f)
        for name in sorted(per_file)
        for f in coalesce(per_file[name], gap=coalesce_gap, max_bytes=max_request_bytes)
    ]
    direct.sort(key=lambda d: (d.file, d.need.start))
    return ReadPlan(fetches, empty, direct, needed, needed_per_file)


def _exact_bytes(it: Item) -> int:
    """The bytes the item's destination receives: a strided (column) slice counts only its elements,
    not the span that encloses them, so ``last_read_stats`` shows what a column read really costs."""
    if it.raw and it.dtype is not None:
        return math.prod(int(x) for x in it.req.lengths) * it.dtype.itemsize
    return it.end - it.start


def _widen(it: Item, rec: FileRecord | None) -> tuple[int, int]:
    """``[it.start, it.end)`` widened to the blocks of ``rec`` it touches (unchanged without ``rec``)."""
    # the reader's record checks have put [it.start, it.end) inside the file and the file in the manifest
    if rec is None or it.end <= it.start:
        return it.start, it.end
    blocks = rec.blocks_covering(it.start, it.end)
    return rec.block_start(blocks[0]), rec.block_ends[blocks[-1]]


def _file_contiguous(it: Item) -> bool:
    """The requested slice is one contiguous run of the stored chunk's bytes."""
    return it.dtype is not None and math.prod(int(x) for x in it.req.lengths) * it.dtype.itemsize == it.end - it.start


def direct_target(it: Item, planner: LoadPlanner) -> tuple[torch.Tensor, memoryview] | None:
    """(calling thread) The destination and a writable view of its bytes, when the item's bytes can be
    read into it as they are (contiguous CPU tensor of the saved dtype and the requested shape)."""
    target = planner.resolve_tensor(it.req).detach()
    if (
        target.device.type != "cpu"
        or target.dtype != it.dtype
        or list(target.size()) != [int(n) for n in it.req.lengths]
        or not target.is_contiguous()
        or target.numel() * target.element_size() != it.end - it.start
    ):
        return None
    try:
        dst = memoryview(cast(Any, target.reshape(-1).view(torch.uint8).numpy()))
    except (RuntimeError, TypeError, ValueError):
        return None
    if dst.readonly or dst.nbytes != it.end - it.start:
        return None
    return target, dst


def pieces(rec: FileRecord | None, lo: int, hi: int) -> list[tuple[int, int]]:
    """Split ``[lo, hi)`` into pieces of about :data:`PIECE_BYTES`, cut at the block boundaries of
    ``rec`` (the file's record when verifying, else ``None``)."""
    if hi - lo <= PIECE_BYTES:
        return [(lo, hi)]
    if rec is None:
        return [(a, min(a + PIECE_BYTES, hi)) for a in range(lo, hi, PIECE_BYTES)]
    out: list[tuple[int, int]] = []
    start = lo
    for i in rec.blocks_covering(lo, hi):
        be = rec.block_ends[i]
        if be - start >= PIECE_BYTES or be >= hi:
            out.append((start, be))
            start = be
    if start < hi:  # pragma: no cover - widened ranges end on a block end
        out.append((start, hi))
    return out

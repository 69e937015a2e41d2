"""Full mode on POSIX: column shards with short rows are written as blocks of whole rows, after a swap.

Why: README, "Full checkpoints". Writer ``i`` of ``k`` ends up with rows ``[n*i//k, n*(i+1)//k)``, all
columns, and writes them as one run. Swaps of consecutive small tensors travel together in batches of up
to :data:`SWAP_BATCH_BYTES` (one message per pair of ranks and batch each way). Every rank walks
its batches in one global order (file, offset), sends before it waits, and lays out each message in the
(swap, block, box) order its peer derives alike: no deadlock, whatever the layout.

Planned by the coordinator (:func:`plan_exchanges`, only when the process group spans every planning
rank); carried out by every rank (:class:`Swapper`). Memory: one batch's boxes and blocks, plus the
previous batch's blocks while they are written.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import SavePlan

from smpckpt.errors import CheckpointError
from smpckpt.storage.format._reading import box_runs
from smpckpt.storage.full._source import FullWrite, RankFullData

__all__ = ["Exchange", "Block", "Swapper", "batches", "plan_exchanges"]
__all__ += ["global_rank", "paste", "SWAP_BATCH_BYTES"]


@dataclasses.dataclass(frozen=True)
class Exchange:
    """One artifact tensor whose writers swap rows: every box of it, and the row block each writer writes."""

    boxes: tuple[tuple[int, FullWrite], ...]  # (rank, box) -- every box of the tensor, each spanning dim 0
    blocks: tuple[tuple[int, int, int], ...]  # (rank, first row, end row) of dim 0, one per writer
    batch: int = 0  # swaps of one batch cross as one message per pair of ranks (numbered in global order)


def _swappable(boxes: list[tuple[int, FullWrite]], below: int) -> bool:
    if len({r for r, _ in boxes}) < 2:
        return False
    first = boxes[0][1]
    view = first.view
    if len(view) < 2 or view[0] < 2:
        return False
    short = False
    for _, w in boxes:
        if w.view != view or w.dtype != first.dtype or w.offsets[0] != 0 or w.sizes[0] != view[0]:
            return False  # only boxes spanning dim 0 split cleanly into row blocks
        _, run = box_runs(w.view, w.offsets, w.sizes, w.dtype.itemsize)
        short = short or run < below
    return short


#: Tensor bytes (all ranks' boxes) per swap batch (a message costs ~2 ms whatever its size up to here);
#: a larger tensor is a batch of its own.
SWAP_BATCH_BYTES = 8 << 20


def plan_exchanges(plans: list[SavePlan], below: int) -> list[SavePlan]:
    """(coordinator) Move the boxes of column-sharded tensors with runs shorter than ``below`` bytes into
    swaps: each writer sends its boxes' rows and gets a one-run block to write. Consecutive swaps are
    numbered into batches of up to :data:`SWAP_BATCH_BYTES` here, once for every rank, so both sides of a
    pair agree on each batch's message even when their own swap lists differ."""
    datas = [cast(RankFullData, p.storage_data) for p in plans]
    by_tensor: dict[tuple[str, int], list[tuple[int, FullWrite]]] = {}
    for r, d in enumerate(datas):
        for w in d.writes:
            by_tensor.setdefault((w.file, w.start), []).append((r, w))
    swaps: dict[tuple[str, int], Exchange] = {}
    batch, batch_bytes = 0, 0
    for where in sorted(by_tensor):
        boxes = sorted(by_tensor[where], key=lambda rw: (rw[0], rw[1].offsets))
        if not _swappable(boxes, below):
            continue
        ranks = sorted({r for r, _ in boxes})
        n, k = boxes[0][1].view[0], len(ranks)
        nbytes = sum(math.prod(w.sizes) * w.dtype.itemsize for _, w in boxes)
        if batch_bytes and batch_bytes + nbytes > SWAP_BATCH_BYTES:
            batch, batch_bytes = batch + 1, 0
        batch_bytes += nbytes
        blocks = tuple((r, n * i // k, n * (i + 1) // k) for i, r in enumerate(ranks))
        swaps[where] = Exchange(tuple(boxes), blocks, batch)
    if not swaps:
        return plans
    out = []
    for r, (p, d) in enumerate(zip(plans, datas)):
        writes = tuple(w for w in d.writes if (w.file, w.start) not in swaps)
        mine = tuple(e for e in swaps.values() if any(rr == r for rr, _, _ in e.blocks))
        out.append(dataclasses.replace(p, storage_data=dataclasses.replace(d, writes=writes, exchanges=mine)))
    return out


def rows_of(buf: memoryview, w: FullWrite, lo: int, hi: int) -> memoryview:
    """Rows ``[lo, hi)`` (dim 0) of a box that spans dim 0, from its row-major bytes: one slice."""
    row = math.prod(w.sizes[1:]) * w.dtype.itemsize
    return buf[lo * row : hi * row]


def paste(dst: np.ndarray, dst_offsets: Sequence[int], dst_sizes: Sequence[int], src: np.ndarray, w: FullWrite) -> None:
    """Copy box ``w`` (``src``: its row-major bytes) into ``dst``, a box holding it (one copy per row of ``w``)."""
    isz = w.dtype.itemsize
    if not w.sizes:  # a 0-dim tensor: its one element
        dst[:] = src
        return
    idx = tuple(slice(o - d, o - d + n) for o, d, n in zip(w.offsets[:-1], dst_offsets[:-1], w.sizes[:-1]))
    lo = (w.offsets[-1] - dst_offsets[-1]) * isz
    idx += (slice(lo, lo + w.sizes[-1] * isz),)
    dst.reshape(*dst_sizes[:-1], dst_sizes[-1] * isz)[idx] = src.reshape(*w.sizes[:-1], w.sizes[-1] * isz)


def global_rank(process_group: Any, rank: int) -> int:
    """The default group's rank of ``rank`` of ``process_group`` (what ``send``/``recv`` take)."""
    return dist.get_global_rank(process_group, rank) if process_group is not None else rank


_Assembly = tuple[FullWrite, np.ndarray, list[tuple[FullWrite, memoryview]]]


class Swapper:
    """(every rank, one thread) Carries out this rank's swaps in the global order."""

    def __init__(self, rank: int, process_group: Any) -> None:
        self.me = rank
        self.pg = process_group

    def swap(self, batch: Sequence[Exchange], my_buf: Mapping[FullWrite, memoryview]) -> list[Block]:
        """Send my boxes' rows to the other writers and receive my blocks' rows, for every swap of one batch:
        one message per peer each way, in the batch's order. ``my_buf``: each of my boxes' row-major bytes.
        Returns my blocks (none for a swap in which I have no rows)."""
        outgoing: dict[int, list[memoryview]] = {}
        incoming: dict[int, list[tuple[int, FullWrite, int]]] = {}  # peer -> (swap, its box, bytes)
        made: list[_Assembly | None] = []  # per swap of the batch: my block, its bytes, its pieces
        for j, e in enumerate(batch):
            mine: _Assembly | None = None
            for r, lo, hi in e.blocks:  # my one-run block (my rows, every column), when I have rows
                if r == self.me and hi > lo:
                    first = next(w for rr, w in e.boxes if rr == self.me)
                    nd = len(first.view)
                    block_w = dataclasses.replace(
                        first,
                        offsets=(lo,) + (0,) * (nd - 1),
                        sizes=(hi - lo,) + tuple(first.view[1:]),
                        perm=tuple(range(nd)),
                        dest_offsets=(0,) * nd,
                    )
                    mine = (block_w, np.empty(math.prod(block_w.sizes) * block_w.dtype.itemsize, np.uint8), [])
            made.append(mine)
            for s, lo, hi in e.blocks:
                for r, w in e.boxes if hi > lo else ():
                    if r == self.me and s != self.me:
                        outgoing.setdefault(s, []).append(rows_of(my_buf[w], w, lo, hi))
                    elif s == self.me and r != self.me:
                        incoming.setdefault(r, []).append((j, w, (hi - lo) * math.prod(w.sizes[1:]) * w.dtype.itemsize))
                    elif s == self.me and mine is not None:
                        own, rows = rows_of(my_buf[w], w, lo, hi), piece_of(w, lo, hi)
                        paste(mine[1], mine[0].offsets, mine[0].sizes, np.frombuffer(own, dtype=np.uint8), rows)
                        mine[2].append((rows, own))
        received = self._send_and_receive(outgoing, {peer: sum(n for _, _, n in got) for peer, got in incoming.items()})
        for peer in sorted(incoming):
            at = 0
            for j, w, n in incoming[peer]:
                entry = made[j]
                if entry is None:
                    raise CheckpointError(f"rank {self.me} received rows of a swap it writes no block of")
                block_w, block, parts = entry
                piece = received[peer][at : at + n]
                at += n
                rows = piece_of(w, lo=block_w.offsets[0], hi=block_w.offsets[0] + block_w.sizes[0])
                paste(block, block_w.offsets, block_w.sizes, piece, rows)
                parts.append((rows, memoryview(cast(Any, piece))))
        return [Block(bw, memoryview(cast(Any, b)), tuple(p)) for bw, b, p in (m for m in made if m is not None)]

    def _send_and_receive(self, outgoing: dict[int, list[memoryview]], sizes: dict[int, int]) -> dict[int, np.ndarray]:
        """One message to each peer (its pieces, in order) and one from each peer (``sizes`` bytes)."""
        pending: list[Any] = []
        for peer in sorted(outgoing):
            pieces = outgoing[peer]
            # one piece (a large tensor's swap) goes as it is; several are joined into one message
            if len(pieces) == 1:
                msg = torch.frombuffer(pieces[0], dtype=torch.uint8)
            else:
                msg = torch.from_numpy(np.concatenate([np.frombuffer(p, np.uint8) for p in pieces]))
            pending.append(dist.isend(msg, dst=global_rank(self.pg, peer), group=self.pg))
        received: dict[int, torch.Tensor] = {}
        for peer in sorted(sizes):
            received[peer] = torch.empty(sizes[peer], dtype=torch.uint8)
            pending.append(dist.irecv(received[peer], src=global_rank(self.pg, peer), group=self.pg))
        for req in pending:
            req.wait()
        return {peer: t.numpy() for peer, t in received.items()}


def batches(exchanges: Sequence[Exchange]) -> list[list[Exchange]]:
    """A rank's swaps grouped by batch (consecutive: they come in the global order)."""
    return [list(group) for _, group in itertools.groupby(exchanges, key=lambda e: e.batch)]


@dataclasses.dataclass(frozen=True)
class Block:
    """A rank's assembled rows: the one-run box it writes, its bytes, and the pieces it was made of (check
    units are cut per piece, so a reader of the saving layout's column shards reads only what it verifies)."""

    write: FullWrite
    data: memoryview
    pieces: tuple[tuple[FullWrite, memoryview], ...]


def piece_of(w: FullWrite, lo: int, hi: int) -> FullWrite:
    """Rows ``[lo, hi)`` of box ``w`` (which spans dim 0), as a box of its own."""
    return dataclasses.replace(w, offsets=(lo,) + tuple(w.offsets[1:]), sizes=(hi - lo,) + tuple(w.sizes[1:]))

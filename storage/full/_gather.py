"""Full mode on object stores (S3, ``memory://``): each file streamed by one owner rank.

An object cannot be written at offsets by many ranks, so here every artifact file has an owner rank
(files round-robin over ranks) that uploads it front to back as one stream (multipart on S3). Tensor
by tensor, in file order, the owner assembles the tensor from the boxes every rank holds: its own are
copied, the others arrive over the process group (``send``/``recv`` of the box bytes, no pickling).
Every rank walks the same global order of boxes (file, tensor offset, sending rank), so each send
meets its receive like steps of one sequential program: no deadlock, whatever the ownership.

Memory: an owner holds one tensor (plus one received box) at a time; a sender one box. The bytes
cross the network once from their holder to the file's owner, and to storage once. The sink borrows
what it is given (S3 parts go out as views, no copy into part buffers): every buffer written is the
resolved tensor's own bytes, a box buffer or an assembled tensor made for this write, none changed
before the sink's commit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from smpckpt.storage.backends._sinks import Sink
from smpckpt.storage.full import _write
from smpckpt.storage.full._exchange import global_rank
from smpckpt.storage.full._layout import FullWrite, RankFullData
from smpckpt.storage.full._units import BoxUnits

__all__ = ["gather_rank"]


def gather_rank(
    data: RankFullData, items: Sequence[WriteItem], planner: SavePlanner, *, open_sink: Any, process_group: Any
) -> list[WriteResult]:
    """(every rank) Send this rank's boxes to the files' owners and stream the files this rank owns."""
    run = _Gather(data, items, planner, process_group)
    sinks: dict[str, Sink] = {}
    try:
        for f in data.files:
            owner = run.owner[f.name] == data.rank
            if owner:
                sinks[f.name] = open_sink(f.name)
            # front to back: the pieces that are not tensor data (a header, a torch.save archive's
            # record headers) between the tensors
            events = sorted([(o, 0, b) for o, b in f.pieces] + [(s, 1, k) for s, k in zip(f.starts, f.keys)])
            for _, kind, what in events:
                if kind == 0:
                    if owner:
                        sinks[f.name].write(memoryview(cast(bytes, what)))
                    continue
                tensor = run.tensor(f.name, cast(str, what))
                if tensor is not None:
                    sinks[f.name].write(memoryview(cast(Any, tensor)))
            if f.name in sinks:
                sinks.pop(f.name).commit()
    except BaseException:
        for sink in sinks.values():
            sink.abort()
        raise
    return _write.tensor_results(items, run.done)


class _Gather:
    """One rank's part in the global order of boxes."""

    def __init__(self, data: RankFullData, items: Sequence[WriteItem], planner: SavePlanner, pg: Any) -> None:
        self.data, self.planner, self.pg = data, planner, pg
        self.owner = {f.name: i % data.world for i, f in enumerate(data.files)}  # files round-robin over ranks
        self.by_index = {it.index: it for it in items}
        self.chunks: dict[Any, torch.Tensor] = {}
        self.done: dict[Any, tuple[int, list[BoxUnits]]] = {}  # item -> (bytes, check units) so far
        self.boxes: dict[tuple[str, str], list[tuple[int, FullWrite]]] = {}
        for r, w in data.all_writes:
            self.boxes.setdefault((w.file, w.key), []).append((r, w))

    def _my_box(self, w: FullWrite) -> memoryview:
        chunk = self.chunks.get(w.item)
        if chunk is None:
            chunk = self.chunks[w.item] = _write.chunk_of(self.planner, self.by_index[w.item])
        buf = _write.box_buffer(chunk, w)
        nbytes, units = self.done.get(w.item, (0, []))
        self.done[w.item] = (nbytes + buf.nbytes, [*units, _write.unit_digests(w, buf, self.data.check_block)])
        return buf

    def tensor(self, file: str, key: str) -> np.ndarray | None:
        """(all ranks) This tensor's boxes: sent by their holders; assembled (and returned) by the owner."""
        me, owner = self.data.rank, self.owner[file]
        boxes = self.boxes.get((file, key), [])
        w0 = boxes[0][1] if len(boxes) == 1 and boxes[0][0] == me == owner else None
        if w0 is not None and not any(w0.offsets) and tuple(w0.sizes) == tuple(w0.view):
            # the owner holds all of it (one rank, a replica), whose own row-major bytes are the tensor's
            # in the file: no assembly
            return np.frombuffer(self._my_box(w0), dtype=np.uint8)
        out: np.ndarray | None = None
        for r, w in boxes:
            if r != me and owner != me:
                continue
            if r == me:
                buf = self._my_box(w)
                if owner != me:
                    dist.send(torch.frombuffer(buf, dtype=torch.uint8), dst=global_rank(self.pg, owner), group=self.pg)
                    continue
                got = np.frombuffer(buf, dtype=np.uint8)
            else:
                recv = torch.empty(math.prod(w.sizes) * w.dtype.itemsize, dtype=torch.uint8)
                dist.recv(recv, src=global_rank(self.pg, r), group=self.pg)
                got = recv.numpy()
            if out is None:
                out = np.zeros(math.prod(w.view) * w.dtype.itemsize, dtype=np.uint8)
            box = tuple(slice(o, o + s) for o, s in zip(w.offsets, w.sizes))
            out.reshape(*w.view, w.dtype.itemsize)[box] = got.reshape(*w.sizes, w.dtype.itemsize)
        return out

"""Full (consolidated) artifacts and Hugging Face folders, reading: exact boxes, verified.

A read request maps through its expression to boxes of artifact tensors
(:func:`smpckpt.model.translation.pieces`), each a set of byte runs (:func:`~._reading.box_runs`); the
check units a box touches are read whole and verified. Where the tensors are comes from
:class:`~._source.ArtifactIndex`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import io
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from smpckpt.errors import CheckpointCorrupt, CheckpointError
from smpckpt.model.translation import Leaf, Piece, pieces, reshaped
from smpckpt.storage.backends._fs import join, read_bytes_or_none
from smpckpt.storage.format._checksum import hash_bytes, hash_parts
from smpckpt.storage.format._columns import REQUEST_COST_BYTES
from smpckpt.storage.format._reading import Box, box_runs
from smpckpt.storage.format._safe_pickle import check_weights_only
from smpckpt.storage.full import _files
from smpckpt.storage.full._files import Held, RunFiles, SpanFetcher, plan_spans, stream_groups
from smpckpt.storage.full._source import ArtifactIndex, StoredTensor
from smpckpt.storage.full._units import Unit, UnitIndex, WholeUnits, bytes_of, cross_view, read_intervals, run_intervals

__all__ = ["FullSource", "THREADS"]

#: worker threads of a full read when none are given (reads and checks of different tensors overlap; a
#: column box's parts are shared by the threads free at the time); the readers pass their ``thread_count``
THREADS = 4


class FullSource(ArtifactIndex):
    """The tensors of one full artifact or Hugging Face folder, and the reads from it."""

    def __init__(
        self,
        fs: Any,
        path: str,
        url: str,
        *,
        verify: bool,
        allow_pickle: bool,
        request_cost: int = REQUEST_COST_BYTES,
        threads: int = THREADS,
    ) -> None:
        super().__init__(fs, path, url)
        #: worker threads of :meth:`read` (the reader's ``thread_count``, checked there)
        self.threads = threads
        self.verify = verify
        self.allow_pickle = allow_pickle
        #: a local column box whose rows' unread gap is below this many bytes is streamed (:mod:`~._files`); on
        #: object stores, runs farther apart take a GET each (:func:`~._files.stream_groups`)
        self.request_cost = request_cost
        self.live: Metadata | None = None  # the Metadata the planner sees (it may reshape a whole tensor)
        self.file_stats: dict[str, list[int]] = {}  # file -> [bytes needed, bytes read] of the last read()
        self.requests = 0
        self._lock = threading.Lock()  # file_stats, from the worker threads of read()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # read()'s, while it runs

    # -- reading ------------------------------------------------------------------------------------
    def read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Every item of ``plan`` into ``planner``; the bytes needed and read go to ``file_stats``. The planner
        is called on this thread only; reads and checks run on ``threads`` workers (at most twice that many
        items in flight); on object stores bytes are fetched ahead in shared spans (:func:`~._files.plan_spans`)."""
        self.requests, self.file_stats = 0, {}
        items = list(plan.items)
        with (
            RunFiles(self.fs, self.path, self.request_cost) as files,
            concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="smpckpt-full-read") as pool,
        ):
            self._files, self._pool = files, pool
            spans: SpanFetcher | None = None
            item_spans: list[tuple[int, ...]] = [()] * len(items)
            if not files.local:
                extents = [self._extents(r) if r.type != LoadItemType.BYTE_IO else [] for r in items]
                span_list, item_spans = plan_spans(extents)
                if span_list:
                    spans = SpanFetcher(
                        files,
                        span_list,
                        item_spans,
                        ahead=self.threads,
                        on_fetch=lambda name, n: self._stat(name, 0, n),
                    )
                    order = sorted(range(len(items)), key=lambda i: item_spans[i][:1] or (-1,))
                    items = [items[i] for i in order]
                    item_spans = [item_spans[i] for i in order]
            pending: dict[concurrent.futures.Future[None], tuple[ReadItem, torch.Tensor, tuple[int, ...]]] = {}

            def make_room() -> bool:
                """Finish the items done first (spans released, tensors committed); ``False``: none pending."""
                if not pending:
                    return False
                for f in concurrent.futures.wait(pending, return_when="FIRST_COMPLETED")[0]:
                    req, target, used = pending.pop(f)
                    f.result()
                    if spans is not None:
                        spans.release(used)
                    planner.commit_tensor(req, target)
                return True

            try:
                for req, used in zip(items, item_spans):
                    if req.type == LoadItemType.BYTE_IO:
                        self._read_object(req, planner)
                        continue
                    target = planner.resolve_tensor(req).detach()
                    held = spans.need(used, make_room) if spans is not None else []
                    pending[pool.submit(self._fill, req, target, held)] = (req, target, used)
                    if spans is not None:
                        spans.top_up()
                    if len(pending) >= 2 * self.threads:
                        make_room()
                while pending:
                    make_room()
            finally:
                for f in pending:
                    f.cancel()
                if spans is not None:
                    spans.close()
                self._pool = None  # boxes still being read (a failed read) go on alone
            self.requests = files.requests

    def _read_object(self, req: ReadItem, planner: LoadPlanner) -> None:
        fqn = req.storage_index.fqn
        name = self.objects.get(fqn)
        if name is None:
            raise CheckpointCorrupt(f"{self.url}: no file holds the object {fqn!r}")
        path = join(self.path, name)
        data = read_bytes_or_none(self.fs, path)
        if data is None:
            raise CheckpointCorrupt(f"{path}: object file of {fqn!r} is missing") from FileNotFoundError(path)
        rec = self.records.get(name)
        if (
            self.verify
            and rec is not None
            and (len(data) != rec.size or (rec.block_digests and hash_bytes(data) != rec.block_digests[0]))
        ):
            raise CheckpointCorrupt(f"{path}: checksum mismatch in the object file of {fqn!r}")
        if not self.allow_pickle:
            check_weights_only(data, where=f"{path} (key {fqn!r})")
        planner.load_bytes(req, io.BytesIO(data))
        self._stat(name, len(data), len(data))

    def _boxes(self, req: ReadItem) -> list[tuple[str, StoredTensor, Piece]]:
        """The artifact boxes that make up ``req``: ``(artifact key, its tensor, piece)``."""
        fqn = req.storage_index.fqn
        if fqn not in self.exprs:
            raise CheckpointCorrupt(f"{self.url}: no tensor {fqn!r} in the artifact")
        art, expr = self.exprs[fqn]
        shapes = self.shapes.get(art, {})
        md = self.live.state_dict_metadata.get(fqn) if self.live is not None else None
        if isinstance(expr, Leaf) and expr.perm is None and isinstance(md, TensorStorageMetadata):
            asked, stored = tuple(md.size), tuple(expr.view or shapes[expr.key])
            if asked != stored and math.prod(asked) == math.prod(stored):
                expr = Leaf(expr.key, view=asked)  # the planner reads this whole tensor in another shape
        elif isinstance(md, TensorStorageMetadata):
            # a translated fused tensor saved in the model's shape ([2I, d]) read in its view ([2, I, d]),
            # or the other way round: the same elements, the expression rewritten
            expr = reshaped(expr, tuple(md.size), shapes) or expr
        out = []
        for pc in pieces(expr, tuple(req.storage_offsets), tuple(req.lengths), shapes):
            out.append((f"{art}/{pc.key}", self.tensors[f"{art}/{pc.key}"], pc))
        return out

    def _extents(self, req: ReadItem) -> list[tuple[str, int, int]]:
        """(object stores) The byte range each box of ``req`` touches in its file, check units included; none
        for a box whose bytes lie farther apart than a request costs (a column reshard's rows): fetched by
        its own thread, a GET per run of close bytes (:func:`~._files.stream_groups`)."""
        out = []
        for key, t, pc in self._boxes(req):
            index = self.units.get(key) if self.verify else None
            units = [u for u, _ in index.touched(pc.offsets, pc.sizes)] if index and index.view == pc.view else []
            lo, hi = read_intervals(tuple(pc.view), tuple(pc.offsets), tuple(pc.sizes), t.dtype.itemsize, units)
            if len(lo) and len(stream_groups(lo, hi, self.request_cost, int(hi[-1] - lo[0]))) == 1:
                out.append((t.file, t.start + int(lo[0]), t.start + int(hi[-1])))
        return out

    def _fill(self, req: ReadItem, target: torch.Tensor, held: Sequence[concurrent.futures.Future[Held]]) -> None:
        """(worker thread) The bytes of ``req`` into ``target``, verified (from ``held`` spans where they lie)."""
        self._files.serve([f.result() for f in held])
        try:
            for key, t, pc in self._boxes(req):
                sub = target
                for d, (o, n) in enumerate(zip(pc.dest_offsets, [pc.sizes[p] for p in pc.perm])):
                    sub = sub.narrow(d, o, n)
                # the box's bytes straight into the destination when it holds them as stored
                dst = bytes_of(sub, t.dtype) if tuple(pc.perm) == tuple(range(len(pc.perm))) else None
                buf = self._read_box(key, t, tuple(pc.view), tuple(pc.offsets), tuple(pc.sizes), dst)
                if dst is None:
                    box = (
                        torch.frombuffer(buf, dtype=torch.uint8).view(t.dtype).reshape(pc.sizes)
                        if len(buf)
                        else torch.empty(pc.sizes, dtype=t.dtype)
                    )
                    sub.copy_(box.permute(tuple(pc.perm)))
        finally:
            self._files.serve(())

    def _read_box(
        self,
        key: str,
        t: StoredTensor,
        view: tuple[int, ...],
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
        dst: memoryview | None = None,
    ) -> memoryview:
        """The box's bytes (into ``dst`` or a new buffer), verified (on object stores from the spans
        :meth:`read` fetched ahead, where they lie)."""
        itemsize = t.dtype.itemsize
        nbytes = math.prod(sizes) * itemsize
        out = dst if dst is not None else memoryview(bytearray(nbytes))
        if nbytes == 0:
            return out
        if math.prod(view) != math.prod(t.shape):
            raise CheckpointCorrupt(
                f"{self.url}: tensor {key!r} of shape {list(t.shape)} cannot be viewed as {list(view)}"
            )
        units = self.units.get(key) if self.verify else None
        if self._files.local and (not units or units.views == {view}):
            streamed = self._read_streamed(key, t, view, offsets, sizes, units or None, out)
            if streamed:
                return out
        starts, run = box_runs(view, offsets, sizes, itemsize)
        if not units:
            self._stat(t.file, nbytes, self._read_rows(t, key, starts, run, sizes[0] if sizes else 1, out, None))
            return out
        other = units.views - {view}
        if other and units.view is not None:  # checked in another view of the same bytes
            return self._read_across_views(key, t, units, starts, run, out)
        if other:
            raise CheckpointError(
                f"{self.url}: tensor {key!r} is requested as shape {list(view)} but was checked as "
                f"{list(next(iter(other)))}"
            )
        whole = units.whole_inside(offsets, sizes)
        touched = units.touched(offsets, sizes) if whole is None else []
        read = covered = 0
        if whole is not None:
            # a box holding every unit it touches whole (any box read at the layout it was saved
            # in, column shards too): read its runs once into ``out`` and check each unit where it
            # lies there (no scratch buffer, no copy)
            read += self._read_rows(t, key, starts, run, sizes[0] if sizes else 1, out, whole, sizes)
            covered = whole.volume()
        if touched:
            read += self._read_touched(t, key, touched, offsets, sizes, out)
            covered += sum(math.prod(box[1]) for _, box in touched)
        if covered != math.prod(sizes):
            raise self._uncovered(t, key)
        self._stat(t.file, nbytes, read)
        return out

    def _read_streamed(
        self,
        key: str,
        t: StoredTensor,
        view: tuple[int, ...],
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
        units: UnitIndex | None,
        out: memoryview,
    ) -> bool:
        """(local files) A column box streamed (:mod:`~._files`); ``False``: not such a box."""
        plan = _files.stream_plan(view, offsets, sizes, t.dtype.itemsize, units, self.request_cost)
        if plan is None:
            return False
        if units is not None and plan.covered != math.prod(sizes):
            raise self._uncovered(t, key)  # some of the box's bytes would go out unchecked
        mismatch = functools.partial(self._mismatch, t, key)
        read = _files.read_streamed(self._files, t.file, t.start, plan, out, units, mismatch, self._spread)
        self._stat(t.file, math.prod(sizes) * t.dtype.itemsize, read)
        return True

    def _spread(self, count: int, work: Callable[[Iterator[int]], int]) -> int:
        """(worker thread) A box's ``count`` parts (:func:`~._files.share`): on local files shared with the
        read's free threads; on object stores, or outside :meth:`read`, on this thread (spans are per thread)."""
        pool = self._pool
        if pool is None or not self._files.local or count < 2:
            return _files.serially(count, work)

        def submit(fn: Callable[[], None]) -> None:
            # RuntimeError: the pool is shutting down (the read failed): this thread does the parts
            with contextlib.suppress(RuntimeError):
                pool.submit(fn)

        return _files.share(count, work, submit, self.threads - 1)

    def _read_rows(
        self,
        t: StoredTensor,
        key: str,
        starts: np.ndarray,
        run: int,
        rows: int,
        out: memoryview,
        whole: WholeUnits | None,
        sizes: Sequence[int] = (),
    ) -> int:
        """The runs ``starts`` (``rows`` rows of the box) into ``out`` back to back, in row groups of about
        :data:`~._files.PART_BYTES` read by several threads, never cutting a ``whole`` unit, each group's
        units checked in ``out`` (``whole`` ``None``: unverified). Returns the bytes fetched."""
        per_row = len(starts) // rows if rows > 1 and len(starts) % rows == 0 else 0
        if per_row and self._files.local:
            urows = (
                np.stack([whole.within[:, 0], whole.within[:, 0] + whole.sizes[:, 0]], axis=1)
                if whole is not None
                else np.zeros((0, 2), dtype=np.int64)
            )
            groups = [(a * per_row, b * per_row, a, b) for a, b in _files.row_groups(rows, urows, per_row * run)]
        else:  # one run, or an object store: one part
            groups = [(0, len(starts), 0, rows)]

        def work(drawn: Iterator[int]) -> int:
            got = 0
            for k in drawn:
                lo, hi, r0, r1 = groups[k]
                got += self._files.read_runs(t.file, t.start + starts[lo:hi], run, out[lo * run : hi * run])
                if whole is None:
                    continue
                mine = whole
                if len(groups) > 1:  # the units starting in this group's rows (no unit crosses a cut)
                    first = whole.within[:, 0]
                    sel = (first >= r0) & (first < r1)
                    mine = WholeUnits(whole.index, whole.idx[sel], whole.within[sel], whole.sizes[sel])
                bad = mine.first_mismatch(mine.digests(out, sizes, t.dtype.itemsize))
                if bad is not None:
                    raise self._mismatch(t, key, bad)
            return got

        return self._spread(len(groups), work)

    def _read_touched(
        self,
        t: StoredTensor,
        key: str,
        touched: Sequence[tuple[Unit, Box]],
        offsets: Sequence[int],
        sizes: Sequence[int],
        out: memoryview,
    ) -> int:
        """Every unit the box touches read whole and checked, its overlap copied into ``out`` (the box's
        row-major bytes), in groups of about :data:`~._files.PART_BYTES` read by several threads. Returns the
        bytes fetched."""
        itemsize = t.dtype.itemsize
        groups: list[tuple[int, int]] = []
        a, acc = 0, 0
        for i, (u, _) in enumerate(touched):
            acc += math.prod(u.sizes) * itemsize
            if acc >= _files.PART_BYTES or i == len(touched) - 1:
                groups.append((a, i + 1))
                a, acc = i + 1, 0
        dst_t = torch.frombuffer(out, dtype=torch.uint8).view(*sizes, itemsize)

        def work(drawn: Iterator[int]) -> int:
            got = 0
            for k in drawn:
                part = touched[groups[k][0] : groups[k][1]]
                # object stores: the part's units fetched first, in GETs as read_runs groups runs (a row's
                # neighbouring units in one; rows farther apart than a request costs, a GET each)
                local = self._files.local
                at = run_intervals([] if local else [box_runs(u.view, u.offsets, u.sizes, itemsize) for u, _ in part])
                with self._files.holding(t.file, t.start + at[0], t.start + at[1]) as fetched:
                    got += fetched
                    for u, box in part:
                        ubytes, fetched = self._unit_bytes(t, key, u)
                        got += fetched
                        s_sub = torch.frombuffer(ubytes, dtype=torch.uint8).view(*u.sizes, itemsize)
                        d_sub = dst_t
                        for d, (lo, n) in enumerate(zip(box[0], box[1])):
                            s_sub = s_sub.narrow(d, lo - u.offsets[d], n)
                            d_sub = d_sub.narrow(d, lo - offsets[d], n)
                        d_sub.copy_(s_sub)  # only after the unit's digest matched
            return got

        return self._spread(len(groups), work)

    def _read_across_views(
        self,
        key: str,
        t: StoredTensor,
        units: UnitIndex,
        starts: np.ndarray,
        run: int,
        out: memoryview,
    ) -> memoryview:
        """A box requested in another view than its units' (:func:`cross_view`): every byte checked."""
        plan = cross_view(units, starts, run, t.dtype.itemsize)
        read = 0
        if plan.partial:  # the bytes they share with the box come with them
            for at, pos, n in plan.direct:
                read += self._files.read_runs(t.file, np.array([t.start + at]), n, out[pos : pos + n])
        else:
            read += self._files.read_runs(t.file, t.start + starts, run, out)
        for u, parts in plan.inside:
            if hash_parts(out[a : a + n] for a, n in parts) != u.digest:
                raise self._mismatch(t, key, u)
        for u, _, _, copies in plan.partial:
            ubytes, fetched = self._unit_bytes(t, key, u)
            read += fetched
            for src, dst, n in copies:
                out[dst : dst + n] = ubytes[src : src + n]
        if plan.covered != len(starts) * run:
            raise self._uncovered(t, key)
        self._stat(t.file, len(starts) * run, read)
        return out

    def _unit_bytes(self, t: StoredTensor, key: str, u: Unit) -> tuple[memoryview, int]:
        """A check unit's bytes, read whole and verified, and the bytes fetched for them."""
        ubytes, fetched = _read_unit(self._files, t, u)
        if hash_bytes(ubytes) != u.digest:
            raise self._mismatch(t, key, u)
        return ubytes, fetched

    def _uncovered(self, t: StoredTensor, key: str) -> CheckpointCorrupt:
        return CheckpointCorrupt(
            f"{join(self.path, t.file)}: part of tensor {key.split('/', 1)[1]!r} is covered by no checksum"
        )

    def _mismatch(self, t: StoredTensor, key: str, u: Unit) -> CheckpointCorrupt:
        return CheckpointCorrupt(
            f"{join(self.path, t.file)}: checksum mismatch in tensor {key.split('/', 1)[1]!r} at box "
            f"{list(u.offsets)}+{list(u.sizes)} (the file is damaged)"
        )

    def _stat(self, name: str, needed: int, read: int) -> None:
        with self._lock:
            st = self.file_stats.setdefault(name, [0, 0])
            st[0] += needed
            st[1] += read

    def verify_all(self, tick: Callable[[int], None] = lambda _: None) -> list[str]:
        """(``smpckpt verify``) Read every header and check unit; the problems found. ``tick(bytes)`` after each
        piece checked (``verify_checkpoint`` counts them)."""
        problems: list[str] = []
        with RunFiles(self.fs, self.path) as files:
            for name, pieces in self.headers.items():
                for offset, length, digest in pieces:
                    buf = bytearray(length)
                    files.read_runs(name, np.array([offset], dtype=np.int64), length, memoryview(buf))
                    if hash_bytes(buf) != digest:
                        what = "header" if offset == 0 else f"archive bytes at offset {offset}"
                        problems.append(f"{join(self.path, name)}: {what} checksum mismatch")
                    tick(length)
            for key, index in self.units.items():
                t = self.tensors[key]
                for u in index.units:
                    ubytes = _read_unit(files, t, u)[0]
                    if hash_bytes(ubytes) != u.digest:
                        problems.append(
                            f"{join(self.path, t.file)}: checksum mismatch in {key.split('/', 1)[1]!r} at {list(u.offsets)}"
                        )
                    tick(len(ubytes))
        return problems


def _read_unit(files: RunFiles, t: StoredTensor, u: Unit) -> tuple[memoryview, int]:
    """A check unit's bytes (row-major), and the bytes fetched for them."""
    starts, run = box_runs(u.view, u.offsets, u.sizes, t.dtype.itemsize)
    ubytes = memoryview(bytearray(len(starts) * run))
    return ubytes, files.read_runs(t.file, t.start + starts, run, ubytes)

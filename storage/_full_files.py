"""Byte runs of full artifacts: ``pread`` on local files, ranged GETs on object stores (strided runs
fetched in enclosing spans, one span held per worker thread for the units of one box)."""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

from smpckpt.errors import CheckpointCorrupt
from smpckpt.storage._errors import translate_errors
from smpckpt.storage._fs import is_local, join

__all__ = ["RunFiles", "SPAN_BYTES"]


class RunFiles:
    """Open files of one read call: ``pread`` on local paths, ranged GETs elsewhere."""

    def __init__(self, fs: Any, path: str) -> None:
        self.fs, self.path = fs, path
        self.local = is_local(fs)
        self.fds: dict[str, int] = {}
        self._lock = threading.Lock()  # fds, from several worker threads
        # object stores: one span fetched ahead for the units of one box (file, start, bytes)
        # (per worker thread: a box's units are held and read by the thread reading that box)
        self._tls = threading.local()

    def hold(self, name: str, lo: int, hi: int) -> int:
        """(object stores) Fetch file bytes ``[lo, hi)`` in one GET and serve runs inside them from
        memory until the next call; returns the bytes fetched (0 on local files, which need none)."""
        self._tls.held = None
        if self.local or hi <= lo:
            return 0
        path = join(self.path, name)
        with translate_errors(path):
            blob = self.fs.cat_file(path, start=lo, end=hi)
        if len(blob) != hi - lo:
            raise CheckpointCorrupt(f"{path}: short read at offset {lo}")
        self._tls.held = (name, lo, blob)
        return hi - lo

    def __enter__(self) -> RunFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def read_runs(self, name: str, starts: np.ndarray, run: int, out: memoryview) -> int:
        """Runs of ``run`` bytes at ``starts`` (ascending), back to back into ``out``; returns the bytes
        fetched from storage (more than the runs' on object stores, where strided runs share a GET)."""
        path = join(self.path, name)
        if self.local:
            with self._lock:
                fd = self.fds.get(name)
                if fd is None:
                    with translate_errors(path):
                        fd = self.fds[name] = os.open(path, os.O_RDONLY)
            # adjacent runs merge into one request
            pos = 0
            for lo, n in _merge(starts, run):
                got = os.preadv(fd, [out[pos : pos + n]], lo)
                if got != n:
                    raise CheckpointCorrupt(f"{path}: truncated ({got} of {n} bytes at offset {lo})")
                pos += n
            return pos
        # Object stores: a GET costs far more than the bytes between strided runs (a column shard's
        # rows), so runs are fetched in enclosing spans of up to SPAN_BYTES and cut out here.
        groups = _span_groups(starts, run)
        spans = [(int(starts[a]), int(starts[b - 1]) + run - int(starts[a])) for a, b in groups]
        held: tuple[str, int, bytes] | None = getattr(self._tls, "held", None)
        if (
            held is not None
            and held[0] == name
            and held[1] <= spans[0][0]
            and spans[-1][0] + spans[-1][1] <= held[1] + len(held[2])
        ):
            base, whole = held[1], memoryview(held[2])
            blobs: list[Any] = [whole[lo - base : lo - base + n] for lo, n in spans]
            fetched = 0
        else:
            with translate_errors(path):
                blobs = self.fs.cat_ranges([path] * len(spans), [lo for lo, _ in spans], [lo + n for lo, n in spans])
            fetched = sum(n for _, n in spans)
        pos = 0
        for (lo, n), (a, b), blob in zip(spans, groups, blobs):
            if isinstance(blob, Exception) or len(blob) != n:
                raise CheckpointCorrupt(f"{path}: short read at offset {lo}") from (
                    blob if isinstance(blob, Exception) else None
                )
            src = np.frombuffer(blob, dtype=np.uint8)
            dst = np.frombuffer(out, dtype=np.uint8)
            rel = starts[a:b].astype(np.int64) - lo
            steps = np.diff(rel)
            if len(rel) > 1 and (steps == steps[0]).all() and steps[0] >= run:
                # evenly spaced rows (the usual column box): one strided copy
                rows = np.lib.stride_tricks.as_strided(src, (len(rel), run), (int(steps[0]), 1))
                dst[pos : pos + len(rel) * run].reshape(len(rel), run)[:] = rows
                pos += len(rel) * run
                continue
            for s in rel.tolist():
                dst[pos : pos + run] = src[s : s + run]
                pos += run
        return fetched


#: object stores: strided runs within one enclosing span of at most this many bytes share one GET
SPAN_BYTES = 32 << 20


def _span_groups(starts: np.ndarray, run: int) -> list[tuple[int, int]]:
    """Index ranges ``[a, b)`` of ``starts`` whose runs fit one span of at most ``SPAN_BYTES`` (a run
    longer than that is a group of its own)."""
    out: list[tuple[int, int]] = []
    a = 0
    for i in range(1, len(starts) + 1):
        if i == len(starts) or int(starts[i]) + run - int(starts[a]) > SPAN_BYTES:
            out.append((a, i))
            a = i
    return out


def _merge(starts: np.ndarray, run: int) -> list[tuple[int, int]]:
    if len(starts) == 0:
        return []
    s = starts.astype(np.int64)
    breaks = np.nonzero(s[1:] != s[:-1] + run)[0] + 1
    firsts = np.concatenate([[0], breaks])
    lasts = np.concatenate([breaks, [len(s)]])
    return [(int(s[a]), int((b - a) * run)) for a, b in zip(firsts, lasts)]

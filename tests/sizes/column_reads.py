"""The requests a streamed column read issues, worked out independently of the reader, for the tests
of ``test_column_reshard_sizes.py`` and ``test_columns_past_32_bits.py`` to check ``last_read_stats``
(and where the requests fall in the file) against."""

from __future__ import annotations

from smpckpt.storage.format._columns import STREAM_PIECE_BYTES
from smpckpt.storage.read._run import STREAM_PART_BYTES


def streamed_spans(rows: int, row_bytes: int, width: int, unit: int, *, pieces: bool) -> list[tuple[int, int]]:
    """``(start, length)`` of each request of a streamed column read of ``rows`` rows of ``row_bytes``,
    ``start`` counted from the box's first byte (its first column of row 0): parts of whole
    ``unit``-row groups of about ``STREAM_PART_BYTES``, each read in pieces of whole units of about
    ``STREAM_PIECE_BYTES`` (``pieces``: the destination takes the rows as stored) or as one request (a
    buffer copied out afterwards); a request spans its rows from the box's first column of its first
    row to the box's last column (``width`` bytes) of its last."""
    part = max(1, STREAM_PART_BYTES // (row_bytes * unit)) * unit
    piece = max(1, STREAM_PIECE_BYTES // (row_bytes * unit)) * unit if pieces else part
    spans = []
    for p0 in range(0, rows, part):
        p1 = min(rows, p0 + part)
        for q0 in range(p0, p1, piece):
            n = min(p1, q0 + piece) - q0
            spans.append((q0 * row_bytes, (n - 1) * row_bytes + width))
    return spans


def streamed(rows: int, row_bytes: int, width: int, unit: int, *, pieces: bool) -> tuple[int, int]:
    """``(requests, bytes requested)`` of :func:`streamed_spans`."""
    spans = streamed_spans(rows, row_bytes, width, unit, pieces=pieces)
    return len(spans), sum(n for _, n in spans)

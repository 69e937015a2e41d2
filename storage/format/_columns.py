"""The column-slice read cost model both readers share (pure, no I/O): when a strided (column) slice's
rows are read as sequential spans of whole rows (:func:`streams`), in pieces of about
:data:`STREAM_PIECE_BYTES`, and the strided copy out of such a span: a reshard reads the same way
from either format.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["REQUEST_COST_BYTES", "STREAM_PIECE_BYTES", "Into", "streams"]

#: the read planner's cost of one more small request, in bytes the device could have streamed meanwhile:
#: rows whose unread gap is below this are read as one sequential span (:func:`streams`), in memory or not
#: (measured: ``benchmarks/RESULTS.md``, "Column slices: the streaming cost model")
REQUEST_COST_BYTES = 16 << 10


def streams(row_bytes: int, width: int, request_cost: int = REQUEST_COST_BYTES) -> bool:
    """Whether a column slice of ``width`` bytes per row of ``row_bytes`` is cheaper to read as one span of
    whole rows than as a request per row costing ``request_cost`` bytes of streaming (0: never)."""
    return row_bytes - width < request_cost


@dataclasses.dataclass(frozen=True)
class Into:
    """A destination a streamed box part copies rows into on the worker: record rows from ``row0`` on,
    ``pitch`` bytes each in ``view``, each the record row's bytes ``[col, col + pitch)``."""

    view: memoryview
    row0: int
    pitch: int
    col: int

    def copy(self, src: memoryview, src_row0: int, src_col: int, rows: tuple[int, int], stride: int) -> None:
        """Rows ``rows`` (those this destination holds) from ``src`` (record rows from ``src_row0`` on, ``stride``
        bytes apart, from byte column ``src_col`` on): one strided copy (numpy, without the GIL)."""
        q0 = max(rows[0], self.row0)
        q1 = min(rows[1], self.row0 + len(self.view) // self.pitch)
        if q1 <= q0:
            return
        np.copyto(
            np.ndarray((q1 - q0, self.pitch), np.uint8, buffer=self.view, offset=(q0 - self.row0) * self.pitch),
            np.ndarray(
                (q1 - q0, self.pitch),
                np.uint8,
                buffer=src,
                offset=(q0 - src_row0) * stride + self.col - src_col,
                strides=(stride, 1),
            ),
        )


#: a streamed box part is read in requests of about this many bytes (whole row groups) into one
#: reused buffer, each verified and copied into the destination before the next: the buffer stays
#: small (no page faults for a part-sized one), and its bytes are still in cache when they are hashed
STREAM_PIECE_BYTES = 4 << 20

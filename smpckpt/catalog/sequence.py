"""Checkpoints under a root are ordered by a sequence number in their manifests, never by clocks.

Every save through the API records ``extra["sequence"]``: one higher than the highest committed under
its root. Retention, a resume without a tag (and its fallback when ``newest`` is missing, stale or
unusable), ``smpckpt ls`` and the fast tier order checkpoints by it, then by save time, then by save id
(:func:`smpckpt.catalog.listing.record_order`). ``newest`` stays a hint for stock tools and a cheap
first guess; wall clocks only break ties among checkpoints written before sequence numbers existed
(smpckpt <= 0.2 manifests, stock DCP folders: sequence 0, so every sequenced checkpoint is newer).

Where a job's highest number comes from (a :class:`SequenceCounter`, which each
:class:`~smpckpt.Checkpointer` owns for its root): the listing a tag-less resume already makes;
otherwise, at its first save, one listing of the root (the same listing retention makes after every
save). After that each save counts on without I/O. A resume of an explicit tag (a roll-back) reads no
listing, so the next save lists the root and numbers past every checkpoint there, the abandoned run's
included: retention then removes those first. Two jobs (or two Checkpointers) saving into one root at
the same time may draw the same number; ties fall back to the save time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["SEQUENCE_KEY", "sequence_of", "SequenceCounter"]

#: the manifest ``extra`` entry holding a checkpoint's sequence number
SEQUENCE_KEY = "sequence"
_MAX = 2**62  # a damaged manifest's number must not push every later one out of range


def sequence_of(extra: Mapping[str, Any] | None) -> int:
    """The sequence number a manifest's ``extra`` records; 0 when it has none (older checkpoints) or it
    is not a plausible one (a bool, negative, or beyond 2**62: damage, ignored)."""
    value = (extra or {}).get(SEQUENCE_KEY)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX:
        return 0
    return value


class SequenceCounter:
    """The highest sequence number one root holds, as this job has seen or drawn it."""

    def __init__(self, root: str, storage_options: Any = None) -> None:
        self.root, self.storage_options = root, storage_options
        self._lock = threading.Lock()  # the save thread and the drain thread draw and note numbers
        self._highest = 0
        self._listed = False  #: every committed checkpoint of the root has been seen (a listing)

    def saw(self, seq: int, *, listed: bool = False) -> None:
        """A checkpoint numbered ``seq`` exists under the root; ``listed``: ``seq`` is the highest of a
        listing of the whole root (a later save need not list it again)."""
        with self._lock:
            if 0 <= seq < _MAX:
                self._highest = max(self._highest, seq)
            self._listed = self._listed or listed

    def next(self, scan: Callable[[], int] | None = None) -> int:
        """(rank 0) The sequence number of a new save. The first time the root was not listed, ``scan()``
        (default: the highest committed number a listing of the root finds) is read first, outside the lock."""
        if not self._listed:
            if scan is None:
                from smpckpt.catalog.listing import highest_sequence

                seen = highest_sequence(self.root, self.storage_options)
            else:
                seen = scan()
            self.saw(seen, listed=True)
        with self._lock:
            self._highest += 1
            return self._highest

"""Checkpoints under a root are ordered by a sequence number in their manifests, never by clocks.

Every save through the API records ``extra["sequence"]``: one higher than the highest committed under
its root. Retention, a resume without a tag (and its fallback when ``newest`` is missing, stale or
unusable), ``smpckpt ls`` and the fast tier order checkpoints by it, then by save time, then by save id
(:func:`smpckpt.catalog.listing.record_order`). ``newest`` stays a hint for stock tools and a cheap
first guess; wall clocks only break ties among checkpoints written before sequence numbers existed
(smpckpt <= 0.2 manifests, stock DCP folders: sequence 0, so every sequenced checkpoint is newer).

Where the highest number comes from, per process and root (however the root is spelled): the listing
a tag-less resume already makes; otherwise, at the first save under the root, one listing of it (the
same listing retention makes after every save). After that each save of this process counts on
without I/O. A resume of an explicit tag (a roll-back) reads no listing, so the next save lists the
root and numbers past every checkpoint there, the abandoned run's included: retention then removes
those first. Two jobs saving into one root at the same time may draw the same number; ties fall back
to the save time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from smpckpt.storage.backends._fs import location_key

__all__ = ["SEQUENCE_KEY", "sequence_of", "saw_sequence", "next_sequence", "forget_roots"]

#: the manifest ``extra`` entry holding a checkpoint's sequence number
SEQUENCE_KEY = "sequence"
_MAX = 2**62  # a damaged manifest's number must not push every later one out of range
_lock = threading.Lock()
_highest: dict[str, int] = {}  # root -> the highest sequence number this process has seen or drawn
_listed: set[str] = set()  # roots whose every committed checkpoint this process has seen (a listing)


def sequence_of(extra: Mapping[str, Any] | None) -> int:
    """The sequence number a manifest's ``extra`` records; 0 when it has none (older checkpoints) or it
    is not a plausible one (a bool, negative, or beyond 2**62: damage, ignored)."""
    value = (extra or {}).get(SEQUENCE_KEY)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX:
        return 0
    return value


def saw_sequence(root: Any, seq: int, storage_options: Any = None, *, listed: bool = False) -> None:
    """A checkpoint numbered ``seq`` exists under ``root``; ``listed``: ``seq`` is the highest of a listing
    of the whole root (a later save need not list it again)."""
    key = location_key(root, storage_options)
    with _lock:
        if 0 <= seq < _MAX:
            _highest[key] = max(_highest.get(key, 0), seq)
        if listed:
            _listed.add(key)


def next_sequence(root: Any, storage_options: Any = None, scan: Callable[[], int] | None = None) -> int:
    """(rank 0) The sequence number of a new save under ``root``. The first time this process has not
    listed ``root``, ``scan()`` (default: the highest committed number a listing of the root finds) is
    read first, outside the lock."""
    key = location_key(root, storage_options)
    with _lock:
        known = key in _listed
    if not known:
        if scan is None:
            from smpckpt.catalog.listing import highest_sequence

            seen = highest_sequence(root, storage_options)
        else:
            seen = scan()
        saw_sequence(root, seen, storage_options, listed=True)
    with _lock:
        seq = _highest.get(key, 0) + 1
        _highest[key] = seq
        return seq


def forget_roots() -> None:
    """Forget every root (as a new process would); for tests."""
    with _lock:
        _highest.clear()
        _listed.clear()

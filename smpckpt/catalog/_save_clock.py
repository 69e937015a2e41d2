"""Save times (``saved_at_ns`` in the manifest) that never go backwards within a job.

Retention keeps the newest checkpoints and a resume without a tag falls back to the newest committed
one, both by this time, which is rank 0's clock. A job restarted on a node whose clock is behind the
previous node's would otherwise stamp its new checkpoints *older* than the ones it resumed from: the
next retention would remove them first, and a fallback resume would pick the older checkpoint. So a
save is stamped no earlier than just after the newest checkpoint this process resumed from or saved
under the same root. That costs no I/O after a resume (it read that manifest already). A resume from
an explicit, older tag (a roll-back), and the first save of a process that did not resume from the
root (a job restarted without a resume), also seed from the checkpoint ``newest`` names
(:func:`smpckpt.catalog.listing.newest_stamp`: two small reads, once), so a node whose clock is behind still
stamps after what the root holds and retention removes the older checkpoints first. A checkpoint
committed after ``newest`` and never named by it (a job killed between the two) is not seen there:
seeding from every tag would need a listing of the root.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from smpckpt.storage.backends._fs import location_key

__all__ = ["saw_checkpoint", "next_save_ns", "plausible_ns"]

_MAX_NS = 2**62  # about the year 2116
_now = time.time_ns  # the clock (a test moves it)
_lock = threading.Lock()
_latest: dict[str, int] = {}  # root -> newest saved_at_ns this process resumed from or stamped


def plausible_ns(saved_at_ns: Any) -> bool:
    """Whether a stamp is a time a save could have (after 1970, before ~2116): a damaged manifest's
    must not push every later stamp out of the range a date can show."""
    return isinstance(saved_at_ns, int) and 0 < saved_at_ns < _MAX_NS


def saw_checkpoint(root: Any, saved_at_ns: Any, storage_options: Any = None) -> None:
    """A checkpoint under ``root`` stamped ``saved_at_ns`` was resumed: later saves stamp after it.
    A stamp that is not :func:`plausible_ns` is ignored."""
    if not plausible_ns(saved_at_ns):
        return
    key = location_key(root, storage_options)
    with _lock:
        _latest[key] = max(_latest.get(key, 0), saved_at_ns)


def next_save_ns(root: Any, storage_options: Any = None, floor: Callable[[], int] = lambda: 0) -> int:
    """(rank 0) The stamp of a new save under ``root``: now, or just after the newest one seen. The first
    time this process neither resumed from nor saved under ``root``, ``floor()`` (read outside the lock)
    is seen first: the root's own floor."""
    key = location_key(root, storage_options)
    with _lock:
        known = key in _latest
    if not known:
        saw_checkpoint(root, floor(), storage_options)
    with _lock:
        ns = max(_now(), _latest.get(key, 0) + 1)
        _latest[key] = ns
        return ns

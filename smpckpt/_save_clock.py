"""Save times (``saved_at_ns`` in the manifest) that never go backwards within a job.

Retention keeps the newest checkpoints and a resume without a tag falls back to the newest committed
one, both by this time, which is rank 0's clock. A job restarted on a node whose clock is behind the
previous node's would otherwise stamp its new checkpoints *older* than the ones it resumed from: the
next retention would remove them first, and a fallback resume would pick the older checkpoint. So a
save is stamped no earlier than just after the newest checkpoint this process resumed from or saved
under the same root. It costs no I/O: resume read that manifest already.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

__all__ = ["saw_checkpoint", "next_save_ns"]

_now = time.time_ns  # the clock (a test moves it)
_lock = threading.Lock()
_latest: dict[str, int] = {}  # root -> newest saved_at_ns this process resumed from or stamped


def _key(root: Any) -> str:
    return os.fspath(root).rstrip("/")


def saw_checkpoint(root: Any, saved_at_ns: int) -> None:
    """(rank 0) A checkpoint under ``root`` stamped ``saved_at_ns`` was resumed: later saves stamp after it."""
    with _lock:
        key = _key(root)
        _latest[key] = max(_latest.get(key, 0), int(saved_at_ns))


def next_save_ns(root: Any) -> int:
    """(rank 0) The stamp of a new save under ``root``: now, or just after the newest one seen."""
    with _lock:
        key = _key(root)
        ns = max(_now(), _latest.get(key, 0) + 1)
        _latest[key] = ns
        return ns

"""Full mode, the in-progress marker: at most one full save writes a folder at a time.

A full artifact has fixed file names (``model.safetensors``, ...), so two saves into one folder write
the same files: the one that commits could hold bytes of the other (seen: ``safetensors`` returning
tensors mixed from both writers). The marker ``smpckpt.writing`` makes the folder one save's:

* it is created **exclusively** (create-if-absent: ``os.link`` on POSIX, a conditional PUT on S3):
  of two saves starting together, one gets the folder and the other a ``CheckpointExists``;
* while its save runs, the coordinator **rewrites it** every :data:`REFRESH_S` seconds (its body is
  ``<save id>\\n<count>``), so a marker found by a later save is either alive -- it changes while that
  save watches it for :data:`WATCH_S` seconds: refused -- or left by a save that stopped (killed): its
  files are debris, removed before the new save takes the folder. No clock is compared (a node's clock
  and the object store's may disagree); only whether the bytes change;
* the commit happens only while the marker names the committing save (``commit_full``), and the
  refreshing stops before it, so a committed folder never gets a marker back.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

from smpckpt.errors import CheckpointExists
from smpckpt.storage.backends._fs import create_bytes_exclusive, join, read_bytes_or_none, write_bytes_atomic
from smpckpt.storage.format._names import WRITING_MARKER, marker_owner

__all__ = ["REFRESH_S", "WATCH_S", "create_marker", "marker_alive", "MarkerRefresher"]

log = logging.getLogger(__name__)

#: a running full save rewrites its marker this often (seconds)
REFRESH_S = 5.0
#: a marker unchanged for this long belongs to a save that stopped: three refreshes missed
WATCH_S = 3 * REFRESH_S + 1.0


def create_marker(fs: Any, path: str, url: str, save_id: str, *, sync: bool) -> None:
    """(coordinator) Take the folder: the marker, created only if absent."""
    try:
        create_bytes_exclusive(fs, join(path, WRITING_MARKER), f"{save_id}\n0".encode(), sync=sync)
    except FileExistsError as exc:
        raise CheckpointExists(
            f"{url}: another full save started writing here at the same moment (its {WRITING_MARKER} was "
            "created first); this one wrote nothing. Save under another tag, or retry once that save ended"
        ) from exc


def marker_alive(fs: Any, path: str, first: bytes) -> bool:
    """(coordinator) Whether the save whose marker reads ``first`` is still running: the marker changes
    (or goes: that save ended) within :data:`WATCH_S` seconds. Polled, so a live save is seen early."""
    where = join(path, WRITING_MARKER)
    deadline = time.monotonic() + WATCH_S
    while time.monotonic() < deadline:
        time.sleep(min(REFRESH_S / 2, max(0.0, deadline - time.monotonic())))
        if read_bytes_or_none(fs, where) != first:
            return True
    return False


class MarkerRefresher:
    """(coordinator, while its full save runs) Rewrites the marker every :data:`REFRESH_S` seconds on a
    daemon thread, as long as the marker still names this save and the writer that started it exists
    (a ``dcp.save`` caller that never calls ``discard_failed_save`` cannot leave it running forever)."""

    def __init__(self, fs: Any, path: str, save_id: str, owner: object) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_refresh,
            args=(fs, path, save_id, self._stop, weakref.ref(owner)),
            name="smpckpt-full-marker",
            daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop refreshing and wait for a rewrite in progress (before the commit removes the marker)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


def _refresh(fs: Any, path: str, save_id: str, stop: threading.Event, owner: weakref.ref[object]) -> None:
    where = join(path, WRITING_MARKER)
    count = 0
    while not stop.wait(REFRESH_S):
        if owner() is None:
            return
        try:
            if marker_owner(read_bytes_or_none(fs, where)) != save_id:
                return  # another save took the folder, or this one ended: nothing of ours to keep alive
            count += 1
            write_bytes_atomic(fs, where, f"{save_id}\n{count}".encode(), sync=False, sync_dir=False)
        except Exception as exc:  # noqa: BLE001 - a missed refresh only lets a watcher take the folder later
            log.warning("%s: could not refresh the full save's marker: %s", where, exc)

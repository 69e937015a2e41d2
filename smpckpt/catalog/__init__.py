"""What is under a checkpoint root: tags and ``newest``, sequence numbers, retention, debris.

May import: ``smpckpt.storage``, ``smpckpt.errors``. Not the API, planners or model layer.
"""

from __future__ import annotations

from typing import Any

from smpckpt.catalog.root import (
    CheckpointRecord,
    ManifestCache,
    Mark,
    RecordState,
    SequenceCounter,
    _record,
    mark_of,
    newest_tag,
    partial_url,
    record_order,
    scan_root,
)
from smpckpt.errors import CheckpointError

__all__ = ["CheckpointRecord", "RecordState", "scan_root", "record_order", "newest_tag", "highest_sequence"]
__all__ += ["holds_last"]


def highest_sequence(root: str, storage_options: Any = None, cache: ManifestCache | None = None) -> int:
    """(rank 0) The highest sequence number committed under ``root`` (one listing; 0 when there is none)."""
    records = scan_root(root, storage_options=storage_options, cache=cache)
    return max((r.order[0] for r in records if r.committed), default=0)


def holds_last(counter: SequenceCounter) -> bool:
    """(rank 0, one manifest read) Whether ``counter``'s root now holds the job's last checkpoint there
    (``SequenceCounter.mark``, its save stamp included): the same run, its folder moved under the link (or copied,
    or mounted twice), not another run's folder holding a tag and number alike."""
    mark: Mark | None = counter.mark
    if mark is None:
        return False
    try:
        found = _record(mark[0], partial_url(counter.root, mark[0]), counter.storage_options, counter.manifests)
    except (CheckpointError, OSError):  # unreadable: not known to be the same run
        return False
    return found.committed and mark_of(found.tag, found.extra, found.order[1]) == mark

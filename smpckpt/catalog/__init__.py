"""What is under a checkpoint root: tags and ``newest``, sequence numbers, retention, debris.

May import: ``smpckpt.storage``, ``smpckpt.errors``. Not the API, planners or model layer.
"""

from __future__ import annotations

from typing import Any

from smpckpt.catalog.root import (
    CheckpointRecord,
    ManifestCache,
    RecordState,
    newest_tag,
    record_order,
    scan_root,
)

__all__ = ["CheckpointRecord", "RecordState", "scan_root", "record_order", "newest_tag", "highest_sequence"]


def highest_sequence(root: str, storage_options: Any = None, cache: ManifestCache | None = None) -> int:
    """(rank 0) The highest sequence number committed under ``root`` (one listing; 0 when there is none)."""
    records = scan_root(root, storage_options=storage_options, cache=cache)
    return max((r.order[0] for r in records if r.committed), default=0)

"""What is under a checkpoint root: tags and ``newest``, sequence numbers, retention, debris.

May import: ``smpckpt.storage``, ``smpckpt.errors``. Not the API, planners or model layer.
"""

from smpckpt.catalog.root import (
    CheckpointRecord,
    RecordState,
    highest_sequence,
    newest_tag,
    record_order,
    scan_root,
)

__all__ = ["CheckpointRecord", "RecordState", "scan_root", "record_order", "newest_tag", "highest_sequence"]

"""What is under a checkpoint root: tags and ``newest``, the save clock, retention, debris.

May import: ``smpckpt.storage``, ``smpckpt.errors``. Not the API, planners or model layer.
"""

from smpckpt.catalog.listing import CheckpointRecord, RecordState, newest_stamp, newest_tag, record_order, scan_root

__all__ = ["CheckpointRecord", "RecordState", "scan_root", "record_order", "newest_tag", "newest_stamp"]

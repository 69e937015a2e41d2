"""smpckpt: fast, safe, portable checkpoints for model-parallel PyTorch training.

Public entry points:

* :class:`ParallelLayout`, :class:`ShardSpec` -- describe how ranks hold tensors.
* :mod:`smpckpt.planners` -- ``ParallelSavePlanner``/``ParallelLoadPlanner`` for ``dcp.save``/``dcp.load``.
* :mod:`smpckpt.storage` -- fsspec-backed ``StorageWriter``/``StorageReader`` (local, shared FS, S3).
"""

from smpckpt.errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointExists,
    CheckpointNotFound,
    LayoutMismatch,
    ReplicaMismatch,
    SpecError,
    UnsafeCheckpoint,
)
from smpckpt.layout import ParallelLayout, RankCoords
from smpckpt.specs import ShardSpec

__version__ = "0.1.0"

__all__ = [
    "ParallelLayout",
    "RankCoords",
    "ShardSpec",
    "CheckpointError",
    "CheckpointNotFound",
    "CheckpointCorrupt",
    "CheckpointExists",
    "LayoutMismatch",
    "SpecError",
    "ReplicaMismatch",
    "UnsafeCheckpoint",
    "__version__",
]

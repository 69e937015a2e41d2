"""DCP planners that map TP/PP/DP shards to global write items and reshard on load."""

if __name__ != "smpckpt.planners":
    raise ImportError(
        f"this folder is the package 'smpckpt.planners'; import it by that name, not as {__name__!r} "
        "(install the project with `pip install -e .`)"
    )

from smpckpt.planners._entries import ObjectBytes, dtensor_layout
from smpckpt.planners._key_notes import likely_causes, module_note, warn_skipped
from smpckpt.planners.load import LoadReport, ParallelLoadPlanner
from smpckpt.planners.save import ObjectBuffer, ParallelSavePlanner, SaveReport

__all__ = ["ParallelSavePlanner", "ParallelLoadPlanner", "LoadReport", "SaveReport", "ObjectBytes", "likely_causes"]
__all__ += ["module_note", "ObjectBuffer"]
__all__ += ["dtensor_layout", "warn_skipped"]

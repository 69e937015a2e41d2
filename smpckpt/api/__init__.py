"""The checkpoint API: the :class:`~smpckpt.Checkpointer`, its option objects, and smp's functions as its
thin face (``save_checkpoint`` / ``resume_from_checkpoint``).

May import: ``smpckpt.model``, ``smpckpt.catalog``, ``smpckpt.planners``, ``smpckpt.storage`` (their
public names), ``smpckpt.errors``. Nothing below the API imports it.
"""

from smpckpt.api import calls, checkpointer, options
from smpckpt.api._async import DrainStatus, drain_status, free_staging_buffers, wait_for_saves
from smpckpt.api.calls import *  # noqa: F403 - its __all__: smp's two functions and their report
from smpckpt.api.checkpointer import *  # noqa: F403 - its __all__: the Checkpointer
from smpckpt.api.options import *  # noqa: F403 - its __all__: the option classes

__all__ = [
    *checkpointer.__all__,
    *(n for n in calls.__all__ if n not in checkpointer.__all__),
    *options.__all__,
    "wait_for_saves",
    "drain_status",
    "DrainStatus",
    "free_staging_buffers",
]

"""The smp-style checkpoint API: ``save_checkpoint`` / ``resume_from_checkpoint`` and what they save.

May import: ``smpckpt.model``, ``smpckpt.catalog``, ``smpckpt.planners``, ``smpckpt.storage`` (their
public names), ``smpckpt.errors``. Nothing below the API imports it.
"""

from smpckpt.api import calls, options
from smpckpt.api.calls import *  # noqa: F403 - its __all__: the two calls and their report
from smpckpt.api.options import *  # noqa: F403 - its __all__: the option classes

__all__ = [*calls.__all__, *options.__all__]

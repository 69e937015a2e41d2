"""The smp-style checkpoint API: ``save_checkpoint`` / ``resume_from_checkpoint`` and what they save.

May import: ``smpckpt.model``, ``smpckpt.catalog``, ``smpckpt.planners``, ``smpckpt.storage`` (their
public names), ``smpckpt.errors``. Nothing below the API imports it.
"""

from smpckpt.api.calls import ResumeInfo, last_resume_info, resume_from_checkpoint, save_checkpoint
from smpckpt.api.options import ResumeOptions, SaveOptions

__all__ = [
    "save_checkpoint",
    "resume_from_checkpoint",
    "last_resume_info",
    "ResumeInfo",
    "SaveOptions",
    "ResumeOptions",
]

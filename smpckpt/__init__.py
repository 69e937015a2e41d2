"""smpckpt: fast, safe, portable checkpoints for model-parallel PyTorch training.

Public entry points:

* :class:`ParallelLayout`, :class:`ShardSpec` -- describe how ranks hold tensors.
* :mod:`smpckpt.planners` -- ``ParallelSavePlanner``/``ParallelLoadPlanner`` for ``dcp.save``/``dcp.load``.
* :mod:`smpckpt.storage` -- fsspec-backed ``StorageWriter``/``StorageReader`` (local, shared FS, S3).
* :func:`save_checkpoint`, :func:`resume_from_checkpoint` -- the smp-style checkpoint API (tags,
  ``newest``, retention, user_content); :func:`last_resume_info` says whether a resume resharded;
  :class:`SaveOptions` / :class:`ResumeOptions` document (and validate) their options.
* :func:`gc_frozen` -- what the API does around a synchronous save or load, for ``dcp.save``/``dcp.load``
  called directly: the process's existing objects sit out cyclic garbage collections meanwhile.
* :mod:`smpckpt.hf` -- Hugging Face translations per model family (``smpckpt.hf.llama.TRANSLATION``);
  imported on first use (``smpckpt.hf`` works after ``import smpckpt``), and it never imports transformers.
* ``smpckpt`` / ``python -m smpckpt`` -- CLI: ``ls``, ``inspect``, ``verify``, ``prune``.
"""

import importlib as _importlib
from typing import Any as _Any

from smpckpt import _moved
from smpckpt import errors as _errors
from smpckpt._gc import gc_frozen
from smpckpt._version import VERSION
from smpckpt.api._async import (
    DrainStatus,
    drain_status,
    free_staging_buffers,
    set_exit_status_on_failed_save,
    wait_for_saves,
)
from smpckpt.api.calls import ResumeInfo, last_resume_info, resume_from_checkpoint, save_checkpoint
from smpckpt.api.options import ResumeOptions, SaveOptions
from smpckpt.errors import *  # noqa: F403 - the error classes are public names of the package
from smpckpt.model.layout import ParallelLayout, RankCoords
from smpckpt.model.specs import ShardSpec
from smpckpt.tools.consolidate import consolidate_checkpoint

_moved.install()  # 0.1.0's flat module paths (smpckpt.layout, smpckpt.storage.writer, ...) keep importing

__version__ = VERSION  # pyproject.toml's, as installed

#: submodules reachable as attributes of the package without importing them first
_LAZY_SUBMODULES = ("hf", "translation")


def __getattr__(name: str) -> _Any:
    if name in _LAZY_SUBMODULES:
        return _importlib.import_module(f"smpckpt.{name}")
    raise AttributeError(f"module 'smpckpt' has no attribute {name!r}")


# the checkpoint API and its options; async saves; layouts, tools and errors
__all__ = ["save_checkpoint", "resume_from_checkpoint", "last_resume_info", "ResumeInfo"]
__all__ += ["SaveOptions", "ResumeOptions"]
__all__ += ["wait_for_saves", "drain_status", "DrainStatus", "set_exit_status_on_failed_save", "free_staging_buffers"]
__all__ += ["ParallelLayout", "RankCoords", "ShardSpec", "consolidate_checkpoint", "gc_frozen", "__version__"]
__all__ += _errors.__all__

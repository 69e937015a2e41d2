"""smpckpt: fast, safe, portable checkpoints for model-parallel PyTorch training.

Public entry points:

* :class:`ParallelLayout`, :class:`ShardSpec` -- describe how ranks hold tensors.
* :mod:`smpckpt.planners` -- ``ParallelSavePlanner``/``ParallelLoadPlanner`` for ``dcp.save``/``dcp.load``.
* :mod:`smpckpt.storage` -- fsspec-backed ``StorageWriter``/``StorageReader`` (local, shared FS, S3).
* :class:`Checkpointer` -- one per job, built from option objects (:class:`Location`, :class:`Sharding`,
  :class:`FastTier`, :class:`Retention`, :class:`AsyncOptions`; per call :class:`SaveOptions`,
  :class:`ExportOptions`, :class:`ResumeOptions`): ``save``, ``resume``, ``export``, ``wait``, ``close``
  (tags, ``newest``, retention, user_content, async saves, tiers, full artifacts).
* :func:`save_checkpoint`, :func:`resume_from_checkpoint` -- smp's functions, as the Checkpointer's thin
  face; :func:`last_resume_info` says whether a resume resharded.
* :func:`gc_frozen` -- what the API does around a synchronous save or load, for ``dcp.save``/``dcp.load``
  called directly: the process's existing objects sit out cyclic garbage collections meanwhile.
* :mod:`smpckpt.hf` -- Hugging Face translations per model family (``smpckpt.hf.llama.TRANSLATION``);
  imported on first use (``smpckpt.hf`` works after ``import smpckpt``), and it never imports transformers.
* ``smpckpt`` / ``python -m smpckpt`` -- CLI: ``ls``, ``inspect``, ``verify``, ``prune``.
"""

import importlib as _importlib
from typing import Any as _Any

from smpckpt import _moved
from smpckpt import api as _api
from smpckpt import errors as _errors
from smpckpt._gc import gc_frozen
from smpckpt._version import VERSION
from smpckpt.api import *  # noqa: F403 - the call API: its __all__
from smpckpt.errors import *  # noqa: F403 - the error classes are public names of the package
from smpckpt.model.layout import ParallelLayout, RankCoords
from smpckpt.model.specs import ShardSpec
from smpckpt.tools.consolidate import consolidate_checkpoint

_moved.install()  # 0.1.0's flat module paths (smpckpt.layout, smpckpt.storage.writer, ...) keep importing

__version__ = VERSION  # pyproject.toml's, as installed

#: submodules reachable as attributes of the package without importing them first
_LAZY_SUBMODULES = ("hf", "translation")


#: process-wide functions of 0.1.0 whose job one Checkpointer's option or method now does
_MOVED_TO_CHECKPOINTER = (("set_exit_status_on_failed_save", "AsyncOptions(exit_status=...)"),)


def __getattr__(name: str) -> _Any:
    if name in _LAZY_SUBMODULES:
        return _importlib.import_module(f"smpckpt.{name}")
    for old, new in _MOVED_TO_CHECKPOINTER:
        if name == old:
            raise AttributeError(f"smpckpt.{name} is gone: each Checkpointer has its own ({new})")
    raise AttributeError(f"module 'smpckpt' has no attribute {name!r}")


__all__ = [
    "consolidate_checkpoint",
    *_api.__all__,  # Checkpointer, the option classes, save_checkpoint, resume_from_checkpoint, wait_for_saves...
    "ParallelLayout",
    "RankCoords",
    "ShardSpec",
    "gc_frozen",
    "__version__",
    *_errors.__all__,
]

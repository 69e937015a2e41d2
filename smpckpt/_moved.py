"""Old import paths of modules that moved into rooms (0.1.0's flat layout), kept importable.

``import smpckpt.layout`` (or ``smpckpt.storage.writer``, or unpickling a class by its 0.1.0 path) gives
the very module object at its new path (``smpckpt.model.layout``), so classes keep one identity. Only
names that no longer exist are listed; new code imports the new paths. ``smpckpt/__init__`` installs the
finder before anything else is imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Mapping
from types import MappingProxyType, ModuleType

__all__ = ["MOVED", "install"]

#: where each module lives now (below ``smpckpt.``) -> its old paths (0.1.0's flat layout, and modules
#: merged into the module of their concept, issue 44, which other branches may still name)
_OLD_PATHS: Mapping[str, str] = MappingProxyType(
    {
        "model.layout": "layout naming record keys model.keys model.naming model.record",
        "model.specs": "specs",
        "catalog.root": "catalog.retention catalog.listing catalog.sequence catalog.tags tags retention",
        "api._dist": "api.rng api._args api.user_content _args _dist rng user_content",
        "api._fast_save": "api._fast_tier",
        "api._tiers": "api._tier_copies",
        "tools._tiers": "tools._tier_verify",
        "storage.tier.writer": "storage.tier.stream",
        "storage.tier.reader": "storage.tier.transfer",
        "api._save": "api._planner_reuse _planner_reuse _save api._full _full",
        "storage.backends._fs": (
            "storage.backends._errors storage.backends._location storage.backends._threads "
            "storage.backends._prefixes storage._fs storage._errors storage._prefixes "
            "storage._location storage._threads"
        ),
        "planners._cache": "planners._wire planners._plan_cache planners._plan_wire",
        "planners.save": "planners._checks planners._plan_checks",
        "planners._entries": "planners._ties",
        "planners._replica_values": "planners._ownership",
        "storage.format._reading": (
            "storage.format._ranges storage.format._tensor_bytes storage._tensor_bytes storage._ranges "
            "storage.format._regions storage._regions storage.backends._page_cache"
        ),
        "storage.backends._folder": "storage.backends._paths",
        "storage.read.reader": "storage.full.reader storage.reader",
        "storage.format.manifest": (
            "storage.format._state storage.format._names storage.manifest storage._names storage._state"
        ),
        "storage.write.writer": (
            "storage.write._rank_files storage.write._write_file storage.writer storage._partial_write "
            "storage._write_file"
        ),
        "storage.write._base": "storage.write._failed_save storage.format._wire storage._wire storage._failed_save",
        "storage.format._staging": "storage.backends._staging storage.format._staged",
        "model.translation": "translation model._translation_checks",
        "model._translation_algebra": "_translation_algebra",
        "api._async": "_async",
        "api._resume": "_resume",
        "catalog._debris": "_debris",
        "tools.cli": "cli _cli_maintain tools._maintain tools._common _cli_common",  # cli re-exports _tiers' part
        "tools.consolidate": "consolidate",
        "tools.convert": "convert",
        "_gc": "storage._gc",
        "storage.format._checksum": "storage._checksum",
        "storage.format._check_units": "storage._check_units",
        "storage.format._safe_pickle": "storage._safe_pickle",
        "storage.backends._s3": "storage._s3",
        "storage.backends._sinks": "storage._sinks",
        "storage.format.commit": "storage._partial_commit",
        "storage.read._fetch": "storage._read_io storage.read._boxes",
        "storage.read._plan": "storage._read_plan",
        "storage.read._run": "storage._read_run storage._read_gate storage.read._gate",
        "storage.tools": "storage._verify_plan storage.read._verify_plan",
        "storage.full._commit": "storage._full_commit",
        "storage.full._exchange": "storage._full_exchange",
        "storage.full._files": "storage._full_files storage.full._strided",
        "storage.full._write": "storage._full_gather storage.full._gather storage._full_write",
        "storage.full.options": "storage._full_options",
        "storage.full._plan": "storage._full_plan storage._torch_zip",
        "storage.full._read": "storage._full_read",
        "storage.full._units": "storage._full_units",
        "storage.full._source": "storage._hf_ties storage.full._layout storage.full._safetensors storage._safetensors",
    }
)
#: old dotted module path -> where it lives now
MOVED: Mapping[str, str] = MappingProxyType(
    {f"smpckpt.{old}": f"smpckpt.{new}" for new, olds in _OLD_PATHS.items() for old in olds.split()}
)


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module at its new path is already imported."""


def install() -> None:
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())

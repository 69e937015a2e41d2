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

#: old dotted module path -> where it lives now
MOVED: Mapping[str, str] = MappingProxyType(
    {
        "smpckpt.layout": "smpckpt.model.layout",
        "smpckpt.specs": "smpckpt.model.specs",
        "smpckpt.naming": "smpckpt.model.layout",
        "smpckpt.record": "smpckpt.model.layout",
        "smpckpt.keys": "smpckpt.model.layout",
        "smpckpt.model.keys": "smpckpt.model.layout",
        "smpckpt.model.naming": "smpckpt.model.layout",
        "smpckpt.model.record": "smpckpt.model.layout",
        "smpckpt.catalog.retention": "smpckpt.catalog.root",
        "smpckpt.catalog.listing": "smpckpt.catalog.root",
        "smpckpt.api.rng": "smpckpt.api._dist",
        "smpckpt.catalog.sequence": "smpckpt.catalog.root",
        "smpckpt.catalog.tags": "smpckpt.catalog.root",
        # merged into the module of their concept (issue 44); other branches may still name them
        "smpckpt.api._fast_tier": "smpckpt.api._fast_save",
        "smpckpt.api._tier_copies": "smpckpt.api._tiers",
        "smpckpt.tools._tier_verify": "smpckpt.tools._tiers",
        "smpckpt.storage.tier.stream": "smpckpt.storage.tier.writer",
        "smpckpt.storage.tier.transfer": "smpckpt.storage.tier.reader",
        "smpckpt.api._planner_reuse": "smpckpt.api._save",
        "smpckpt.api._args": "smpckpt.api._dist",
        "smpckpt.storage.backends._errors": "smpckpt.storage.backends._fs",
        "smpckpt.storage.backends._location": "smpckpt.storage.backends._fs",
        "smpckpt.storage.backends._threads": "smpckpt.storage.backends._fs",
        "smpckpt.storage.backends._page_cache": "smpckpt.storage.backends._fs",
        "smpckpt.planners._wire": "smpckpt.planners._cache",
        "smpckpt.planners._checks": "smpckpt.planners.save",
        "smpckpt.planners._ties": "smpckpt.planners._entries",
        "smpckpt.storage.format._ranges": "smpckpt.storage.format._reading",
        "smpckpt.storage.backends._paths": "smpckpt.storage.backends._folder",
        "smpckpt.storage.backends._prefixes": "smpckpt.storage.backends._fs",
        "smpckpt.storage.full.reader": "smpckpt.storage.read.reader",
        "smpckpt.storage.format._state": "smpckpt.storage.format.manifest",
        "smpckpt.storage.format._tensor_bytes": "smpckpt.storage.format._reading",
        "smpckpt.storage.write._rank_files": "smpckpt.storage.write.writer",
        "smpckpt.storage.write._write_file": "smpckpt.storage.write.writer",
        "smpckpt.storage.write._failed_save": "smpckpt.storage.write._base",
        "smpckpt.storage.format._wire": "smpckpt.storage.write._base",
        "smpckpt.storage.backends._staging": "smpckpt.storage.format._staging",
        "smpckpt.api.user_content": "smpckpt.api._dist",
        "smpckpt.storage.format._names": "smpckpt.storage.format.manifest",
        "smpckpt.storage.format._staged": "smpckpt.storage.format._staging",
        "smpckpt.translation": "smpckpt.model.translation",
        "smpckpt._translation_algebra": "smpckpt.model._translation_algebra",
        "smpckpt._args": "smpckpt.api._dist",
        "smpckpt._async": "smpckpt.api._async",
        "smpckpt._dist": "smpckpt.api._dist",
        "smpckpt._full": "smpckpt.api._full",
        "smpckpt._planner_reuse": "smpckpt.api._save",
        "smpckpt._resume": "smpckpt.api._resume",
        "smpckpt._save": "smpckpt.api._save",
        "smpckpt.rng": "smpckpt.api._dist",
        "smpckpt.user_content": "smpckpt.api._dist",
        "smpckpt.tags": "smpckpt.catalog.root",
        "smpckpt.retention": "smpckpt.catalog.root",
        "smpckpt._debris": "smpckpt.catalog._debris",
        "smpckpt.cli": "smpckpt.tools.cli",
        "smpckpt._cli_common": "smpckpt.tools._common",
        "smpckpt._cli_maintain": "smpckpt.tools._maintain",
        "smpckpt.consolidate": "smpckpt.tools.consolidate",
        "smpckpt.convert": "smpckpt.tools.convert",
        "smpckpt.storage._gc": "smpckpt._gc",
        "smpckpt.planners._plan_cache": "smpckpt.planners._cache",
        "smpckpt.planners._plan_checks": "smpckpt.planners.save",
        "smpckpt.planners._plan_wire": "smpckpt.planners._cache",
        "smpckpt.storage.manifest": "smpckpt.storage.format.manifest",
        "smpckpt.storage._names": "smpckpt.storage.format.manifest",
        "smpckpt.storage._wire": "smpckpt.storage.write._base",
        "smpckpt.storage._checksum": "smpckpt.storage.format._checksum",
        "smpckpt.storage._check_units": "smpckpt.storage.format._check_units",
        "smpckpt.storage._safe_pickle": "smpckpt.storage.format._safe_pickle",
        "smpckpt.storage._tensor_bytes": "smpckpt.storage.format._reading",
        "smpckpt.storage._ranges": "smpckpt.storage.format._reading",
        "smpckpt.storage._regions": "smpckpt.storage.format._regions",
        "smpckpt.storage._state": "smpckpt.storage.format.manifest",
        "smpckpt.storage._fs": "smpckpt.storage.backends._fs",
        "smpckpt.storage._s3": "smpckpt.storage.backends._s3",
        "smpckpt.storage._errors": "smpckpt.storage.backends._fs",
        "smpckpt.storage._sinks": "smpckpt.storage.backends._sinks",
        "smpckpt.storage._prefixes": "smpckpt.storage.backends._fs",
        "smpckpt.storage._location": "smpckpt.storage.backends._fs",
        "smpckpt.storage._threads": "smpckpt.storage.backends._fs",
        "smpckpt.storage.writer": "smpckpt.storage.write.writer",
        "smpckpt.storage._partial_write": "smpckpt.storage.write.writer",
        "smpckpt.storage._write_file": "smpckpt.storage.write.writer",
        "smpckpt.storage._partial_commit": "smpckpt.storage.format.commit",
        "smpckpt.storage._failed_save": "smpckpt.storage.write._base",
        "smpckpt.storage.reader": "smpckpt.storage.read.reader",
        "smpckpt.storage._read_gate": "smpckpt.storage.read._gate",
        "smpckpt.storage._read_io": "smpckpt.storage.read._fetch",
        "smpckpt.storage._read_plan": "smpckpt.storage.read._plan",
        "smpckpt.storage._read_run": "smpckpt.storage.read._run",
        "smpckpt.storage._verify_plan": "smpckpt.storage.read._verify_plan",
        "smpckpt.storage._full_commit": "smpckpt.storage.full._commit",
        "smpckpt.storage._full_exchange": "smpckpt.storage.full._exchange",
        "smpckpt.storage._full_files": "smpckpt.storage.full._files",
        "smpckpt.storage._full_gather": "smpckpt.storage.full._write",
        "smpckpt.storage.full._gather": "smpckpt.storage.full._write",
        "smpckpt.storage._full_options": "smpckpt.storage.full.options",
        "smpckpt.storage._full_plan": "smpckpt.storage.full._plan",
        "smpckpt.storage._full_read": "smpckpt.storage.full._read",
        "smpckpt.storage._full_units": "smpckpt.storage.full._units",
        "smpckpt.storage._full_write": "smpckpt.storage.full._write",
        "smpckpt.storage._hf_ties": "smpckpt.storage.full._source",
        "smpckpt.storage._safetensors": "smpckpt.storage.full._safetensors",
        "smpckpt.storage._torch_zip": "smpckpt.storage.full._plan",
    }
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

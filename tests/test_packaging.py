"""The package-dir mapping: smpckpt.planners / smpckpt.storage exist; bare planners / storage do not."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name", ["planners", "storage"])
def test_bare_folder_import_fails_with_a_clear_message(name):
    proc = subprocess.run(
        [sys.executable, "-c", f"import {name}"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    assert f"this folder is the package 'smpckpt.{name}'" in proc.stderr


def test_mapped_subpackages_import_from_anywhere(tmp_path):
    code = "import smpckpt.planners, smpckpt.storage, smpckpt; print(smpckpt.planners.ParallelSavePlanner.__name__)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ParallelSavePlanner"


def test_old_module_paths_give_the_moved_modules() -> None:
    """0.1.0's flat paths (``smpckpt.layout``, ``smpckpt.storage.writer``...) import the module at its room's
    path, the same object, so classes keep one identity (isinstance, pickles naming the old path)."""
    import importlib
    import pickle

    from smpckpt._moved import MOVED
    from smpckpt.model.layout import ParallelLayout

    for old, new in MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    # protocol 0 names the class by a newline-ended string, so the path can be swapped in place
    old_pickle = pickle.dumps(ParallelLayout(tp=2, dp=3), protocol=0).replace(
        b"smpckpt.model.layout", b"smpckpt.layout"
    )
    assert b"smpckpt.layout" in old_pickle
    assert pickle.loads(old_pickle) == ParallelLayout(tp=2, dp=3)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("smpckpt.no_such_module")
    # a module's names followed it when it moved again (rev67g F2: the page-cache reads left _fs for _reading)
    page_cache = importlib.import_module("smpckpt.storage.backends._page_cache")
    for name in ("pread_cached", "NOT_SUPPORTED", "in_memory", "advise_random", "device_read_bytes"):
        assert hasattr(page_cache, name), name


def test_old_module_paths_keep_their_public_names() -> None:
    """A module merged into another keeps every public name at its old path (rev62f F3: ``tools._common``'s
    were split between ``tools._tiers`` and ``tools.cli``)."""
    import importlib

    old_names = {
        "smpckpt.tools._common": "ENV_OPTIONS UsageError storage_options_arg human layout_text layout_json "
        "resolve_checkpoint_url check_root",
        "smpckpt.catalog._debris": "sweep_debris sweep_stale select_stale_uncommitted",
        # 0.1.0's retention module, now catalog.root: its names that moved on to catalog._abandoned (rev69i L5)
        "smpckpt.retention": "KeepLatestN select_for_removal apply_retention RetentionResult validate_keep "
        "CheckpointRecord scan_root record_order newest_tag highest_sequence NEWEST_NAME PARTIAL_SUFFIX "
        "validate_tag is_valid_tag split_lineage write_abandoned read_abandoned SequenceCounter",
    }
    old_names["smpckpt._cli_common"] = old_names["smpckpt.tools._common"]
    for path, names in old_names.items():
        module = importlib.import_module(path)
        assert [n for n in names.split() if not hasattr(module, n)] == [], path
    star: dict[str, object] = {}
    exec("from smpckpt.retention import *", star)  # rev69j L4: the moved names came by name only
    assert {"KeepLatestN", "select_for_removal", "highest_sequence"} <= set(star)

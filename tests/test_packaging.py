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

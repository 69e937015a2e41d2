"""Smoke test of tests/fault_injection.py: 6 SIGKILLs (deterministic and timed) spread over the three save
loops (partial saves; partial + full saves; tiered saves with fast-tier node copies and drains), 0 lost.

Nine child processes each import torch, which takes 40-60 s on a loaded 2-core CI machine (more
than the ~40 s budget of a default test), so it is opt-in: ``pytest --run-slow``. The full campaign
is ``python tests/fault_injection.py --kills 60 --seed 0``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("fault_injection.py")


@pytest.mark.slow
def test_fault_injection_smoke(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    root = tmp_path / "work"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--kills", "6", "--seed", "0", "--root", str(root), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ),
    )
    assert out.exists(), f"no report (rc={proc.returncode})\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    report = json.loads(out.read_text())
    totals = report["totals"]
    summary = f"rc={proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
    assert proc.returncode == 0, summary
    assert totals["points"] == 6, summary
    assert totals["lost"] == 0 and totals["resume_failures"] == 0 and totals["restart_failures"] == 0, summary
    assert totals["corrupt_committed"] == 0 and totals["errors"] == 0, summary
    assert report["final_restart_check"] == "ok", summary
    # both kinds of kill took part, in every save loop, and the kills really landed (the child died of SIGKILL)
    kinds = set(report["by_kind"])
    assert any(k.endswith(":timed") for k in kinds) and any(not k.endswith(":timed") for k in kinds), kinds
    assert {k.split(":")[0] for k in kinds} == {"partial", "full", "tiered"}, kinds
    assert totals["landed"] == 6, summary

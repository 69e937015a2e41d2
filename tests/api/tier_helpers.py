"""Helpers of the tiered-checkpoint tests (test_tiers*.py): models, the job folder, its records."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from smpckpt.api._tiers import durable_key, job_folder


def linear(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(8, 8)


def same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def job(local: Path, durable: Path | str) -> Path:
    """The job folder of the durable root ``durable`` in the fast tier ``local``."""
    return Path(job_folder(str(local), durable_key(str(durable), None)))


def partials(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith("_partial"))


def tier_record(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "smpckpt.manifest.json").read_text())["extra"]["tier"]

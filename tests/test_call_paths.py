"""How many of the package's modules one call passes through (issue 44: "modules by concept").

A one-process partial ``save_checkpoint`` and a ``resume_from_checkpoint`` are traced with
``sys.setprofile``: every module of the package one of whose functions is called counts once. A concept
split over many fragments shows up here as a long list; the bound keeps the fragments merged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
import torch
from torch import nn

import smpckpt

#: issue 44's "done when": each call passes through at most this many of the package's modules
MAX_MODULES = 25


def _modules_called(fn: Callable[[], Any]) -> list[str]:
    called: set[str] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            if name == "smpckpt" or name.startswith("smpckpt."):
                called.add(name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return sorted(called)


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """The modules a one-process partial save and then a resume of nn.Linear + Adam pass through."""
    root = str(tmp_path_factory.mktemp("call_paths"))
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    # the first save imports (and plans) what the traced calls then only use
    smpckpt.save_checkpoint(root, "warm", model=model, optimizer=optimizer)
    saved = _modules_called(lambda: smpckpt.save_checkpoint(root, "s1", model=model, optimizer=optimizer))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    resumed = _modules_called(lambda: smpckpt.resume_from_checkpoint(root, model=model, optimizer=optimizer))
    # the traced calls did their job (the resume brought back what was saved) and the trace saw them
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert "smpckpt.api.calls" in saved and "smpckpt.api.calls" in resumed, (saved, resumed)
    return {"save": saved, "resume": resumed}


def test_a_partial_save_passes_through_at_most_25_modules(traced: dict[str, list[str]]) -> None:
    saved = traced["save"]
    assert len(saved) <= MAX_MODULES, f"save_checkpoint passes through {len(saved)} modules: {saved}"


def test_a_resume_passes_through_at_most_25_modules(traced: dict[str, list[str]]) -> None:
    resumed = traced["resume"]
    assert len(resumed) <= MAX_MODULES, f"resume_from_checkpoint passes through {len(resumed)} modules: {resumed}"

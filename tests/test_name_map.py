"""The judgements a load makes by the destination's names under a name_map (``specs.stateless_when_saved``, and
``ReservedKeys.in_own_dtype`` beside it): one plan, one table of each destination name -> the key read for it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from sim import MemoryReader, MemoryStore, MemoryWriter, sim_load, sim_save

from smpckpt import ParallelLayout
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner

_MAPS: dict[str, Callable[[str], str] | None] = {
    "no-map": None,
    "optim-to-opt": lambda k: "opt." + k[6:] if k.startswith("optim.") else k,
    "suffix": lambda k: k + "@v1",
    "moved-and-suffixed": lambda k: "opt." + k[6:] + ".v1" if k.startswith("optim.") else k,
    "rename-state": lambda k: k.replace(".exp_avg", ".m"),
}


@pytest.mark.parametrize("name_map", list(_MAPS.values()), ids=list(_MAPS))
def test_one_plan_judges_stateless_and_own_dtype_state_by_the_same_names(name_map: Callable[[str], str] | None) -> None:
    """fix74f 2: the stateless-when-saved judgement and the own-dtype one each built their table of destination
    names (before a map) -> checkpoint keys read; one plan builds it once now and both judge by it. In one load:
    ``v`` held no state when saved (its state left without, not refused), ``w``'s fp32 moment of a bf16 weight is
    kept in its own dtype (reported), every value read bit-exact."""
    w, v, m = torch.arange(4.0).bfloat16(), (torch.arange(4.0) + 10).bfloat16(), torch.arange(4.0) / 3

    def state(blank: bool) -> dict[str, Any]:
        z = torch.zeros(4)
        return {
            "model": {"w": z.bfloat16() if blank else w.clone(), "v": z.bfloat16() if blank else v.clone()},
            "optim": {
                "state": {
                    "w": {"exp_avg": z.clone() if blank else m.clone()},
                    **({"v": {"exp_avg": z}} if blank else {}),
                },
                "param_groups": {n: {"lr": 0.1} for n in ("w", "v")},
            },
        }

    store = MemoryStore()
    sim_save([state(False)], [ParallelSavePlanner(ParallelLayout(), name_map=name_map)], [MemoryWriter(store)])
    dest, loader = [state(True)], ParallelLoadPlanner(ParallelLayout(), name_map=name_map)
    sim_load(dest, [loader], [MemoryReader(store)])
    named = name_map or str
    assert loader.report is not None
    assert loader.report.stateless_saved == (named("optim.state.v.exp_avg"),)
    assert loader.report.own_dtype == ("optim.state.w.exp_avg",)
    got = dest[0]
    assert torch.equal(got["model"]["w"], w) and torch.equal(got["model"]["v"], v)
    assert got["optim"]["state"]["w"]["exp_avg"].dtype == torch.float32
    assert torch.equal(got["optim"]["state"]["w"]["exp_avg"], m)
    assert torch.equal(got["optim"]["state"]["v"]["exp_avg"], torch.zeros(4))  # left as it was

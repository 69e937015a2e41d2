"""Single process: optimizer state keeps the dtype it was saved in (not its parameter's), in fresh and live
optimizers and full artifacts, and follows a model cast where it was saved in its parameter's dtype."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from optim_state_helpers import _MomentIn
from test_api_single import _equal
from torch import nn

import smpckpt
from smpckpt import resume_from_checkpoint, save_checkpoint


@pytest.mark.parametrize("moment, param", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_optimizer_state_keeps_its_saved_dtype_not_its_parameters(tmp_path: Any, moment: Any, param: Any) -> None:
    """torch's ``Optimizer.load_state_dict`` (under DCP's ``set_state_dict``) casts floating state to its parameter's
    dtype: fp32 moments of a bf16 model came back rounded to bf16, bf16 ones of an fp32 model as fp32, and the next
    step differed from the uninterrupted run's (hunt71d). The state keeps the dtype it was saved and loaded in, bit-exact,
    in a fresh optimizer and a live one; the next step equals the uninterrupted run's."""

    def run(seed: int, steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        m = nn.Linear(8, 8).to(param)
        o = type("MomentIn", (_MomentIn,), {"dtype": moment})(m.parameters())
        for _ in range(steps):
            o.zero_grad()
            m(torch.randn(4, 8, dtype=param)).sum().backward()
            o.step()
        return m, o

    m, o = run(0, 3)
    save_checkpoint(str(tmp_path), "a", model=m, optimizer=o)
    save_checkpoint(str(tmp_path), "a", partial=False, model=m, optimizer=o, include_optimizer=True)
    x = torch.randn(4, 8, dtype=param)
    for steps, partial in ((0, True), (1, True), (1, False)):  # a fresh optimizer, a live one; a full artifact
        m2, o2 = run(1, steps)
        resume_from_checkpoint(str(tmp_path), "a", partial=partial, model=m2, optimizer=o2)
        for p, p2 in zip(m.parameters(), m2.parameters()):
            for saved, got in (
                (o.state[p]["m"], o2.state[p2]["m"]),
                (o.state[p]["nest"]["m"], o2.state[p2]["nest"]["m"]),
            ):
                assert got.dtype == moment and torch.equal(got, saved), (steps, partial, got.dtype)
        m3, o3 = copy.deepcopy((m, o))  # the uninterrupted run (copies: m and o stay as saved), one step on
        for model, opt in ((m2, o2), (m3, o3)):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        assert _equal(m2, m3), steps


def test_live_optimizer_state_the_resume_does_not_fill_keeps_its_dtype_and_values(tmp_path: Any) -> None:
    """rev71h M1: live fp32 state of a bf16 model that the load did not fill was still cast to bf16 by torch's
    ``load_state_dict``: (1) ``strict=False``, a parameter new in the model (README: it keeps what it had; max
    error 0.0014); (2) a full artifact exported without optimizer state (README: a live optimizer is left as it
    was). Now bit-exact as before the resume, nested state included; the loaded parameters' state as saved."""

    def run(seed: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        m = nn.Sequential(*(nn.Linear(8, 8) for _ in range(layers))).bfloat16()
        o = _MomentIn(m.parameters())
        for _ in range(2):
            o.zero_grad()
            m(torch.randn(4, 8, dtype=torch.bfloat16)).float().sum().backward()
            o.step()
        return m, o

    def leaves(o: torch.optim.Optimizer, p: torch.Tensor) -> list[torch.Tensor]:
        return [o.state[p]["m"], o.state[p]["nest"]["m"]]

    m, o = run(0, 1)
    save_checkpoint(str(tmp_path), "a", model=m, optimizer=o)
    save_checkpoint(str(tmp_path), "a", partial=False, model=m, optimizer=o)  # without optimizer state
    with_optim = smpckpt.api.options.ExportOptions(include_optimizer=True)
    save_checkpoint(str(tmp_path), "b", partial=False, model=m, optimizer=o, options=with_optim)
    # (3) a full artifact with optimizer state and a parameter new in the model: its live state kept, not
    # dropped as "had none when saved" (rev71h2 M1)
    for tag, partial, layers in (("a", False, 1), ("a", True, 2), ("b", False, 2)):
        m2, o2 = run(1, layers)
        before = {n: [t.clone() for t in leaves(o2, p)] for n, p in m2.named_parameters()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # strict=False's warning naming the new parameter's keys
            resume_from_checkpoint(str(tmp_path), tag, partial=partial, model=m2, optimizer=o2, strict=False)
        for n, p2 in m2.named_parameters():
            loaded = (partial or tag == "b") and n.startswith("0.")
            want = leaves(o, dict(m.named_parameters())[n]) if loaded else before[n]
            for got, w in zip(leaves(o2, p2), want):
                assert got.dtype == torch.float32 and torch.equal(got, w), (partial, n, got.dtype)


def test_state_saved_in_its_parameters_dtype_follows_a_model_cast_at_the_resume(tmp_path: Any) -> None:
    """Only state saved in a dtype other than its parameter's keeps it (above): a bf16 model's bf16 Adam state
    resumed with ``allow_dtype_cast`` into a bf16 model whose live Adam state is fp32 (stepped before
    ``model.bfloat16()``) takes its parameter's dtype, as torch casts it; kept fp32, the next step failed
    (``expected dtype float for 'end' but got dtype c10::BFloat16``, rev71d M2)."""

    def step(m: nn.Module, o: torch.optim.Optimizer, dtype: torch.dtype) -> None:
        o.zero_grad()
        m(torch.randn(2, 4, dtype=dtype)).float().square().sum().backward()
        o.step()

    torch.manual_seed(0)
    m = nn.Linear(4, 3).bfloat16()
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    for _ in range(2):
        step(m, o, torch.bfloat16)
    save_checkpoint(str(tmp_path), "a", model=m, optimizer=o)
    m2 = nn.Linear(4, 3)
    o2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
    step(m2, o2, torch.float32)
    m2.bfloat16()
    resume_from_checkpoint(str(tmp_path), model=m2, optimizer=o2, options=smpckpt.ResumeOptions(allow_dtype_cast=True))
    for p, p2 in zip(m.parameters(), m2.parameters()):
        got = o2.state[p2]["exp_avg"]
        assert got.dtype == torch.bfloat16 and torch.equal(got, o.state[p]["exp_avg"])
    m3, o3 = copy.deepcopy((m, o))  # the uninterrupted run, one step on
    for model, opt in ((m2, o2), (m3, o3)):
        torch.manual_seed(1)
        step(model, opt, torch.bfloat16)
    assert _equal(m2, m3)

"""Single process, no process group: optimizer state at the seam of a save and a resume -- fresh and live
optimizers, parameters saved without state, rollbacks, param groups, optimizers whose step cannot run. Split off
test_api_single.py; frozen parameters, odd state keys, state dtypes and name_maps are in the
test_optimizer_state_*.py beside it."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
from torch import nn
from unused_branch import unused_branch_model, unused_branch_step

import smpckpt
from smpckpt import LayoutMismatch, resume_from_checkpoint, save_checkpoint


def test_a_rollback_to_a_checkpoint_saved_without_optimizer_leaves_the_optimizer_fresh(tmp_path: Any) -> None:
    """The README: under strict=False every parameter of a checkpoint saved without optimizer resumes without
    state, live state or not. An in-process roll-back to one kept the live Adam state of step 3 beside the
    weights of step 0 (its next step() was neither the saved run's nor a fresh one's)."""
    torch.manual_seed(0)
    m = nn.Linear(2, 2)
    o = torch.optim.Adam(m.parameters())
    save_checkpoint(str(tmp_path), "model_only", model=m)
    saved = {k: v.clone() for k, v in m.state_dict().items()}
    for _ in range(3):
        m(torch.ones(1, 2)).sum().backward()
        o.step()
        o.zero_grad()
    with pytest.warns(UserWarning, match=r"not in the checkpoint: optim\.param_groups\.bias\.amsgrad"):
        resume_from_checkpoint(str(tmp_path), "model_only", model=m, optimizer=o, strict=False)
    assert all(torch.equal(v, saved[k]) for k, v in m.state_dict().items())
    assert not o.state, {n: sorted(o.state[p]) for n, p in m.named_parameters() if p in o.state}


def test_an_optimizer_over_new_parameters_keeps_its_live_state_when_the_checkpoint_holds_optimizer_state(
    tmp_path: Any,
) -> None:
    """rev61c F1: a checkpoint saved with Adam over the base; the resumed model gained an adapter whose own
    optimizer (over the adapter only) has live state. Every key of that optimizer is missing, as for a
    checkpoint saved without optimizer, but this one holds optimizer state: the adapter keeps its state."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(2, 2))
    o = torch.optim.Adam(m.parameters())
    m(torch.ones(1, 2)).sum().backward()
    o.step()
    save_checkpoint(str(tmp_path), "base", model=m, optimizer=o)
    m2 = nn.Sequential(nn.Linear(2, 2))
    m2.add_module("adapter", nn.Linear(2, 2))
    o2 = torch.optim.Adam(m2.adapter.parameters())
    for _ in range(3):
        m2.adapter(m2[0](torch.ones(1, 2))).sum().backward()
        o2.step()
        o2.zero_grad()
    live = {n: {k: v.clone() for k, v in o2.state[p].items()} for n, p in m2.adapter.named_parameters()}
    with pytest.warns(UserWarning, match="skipped keys"):
        resume_from_checkpoint(str(tmp_path), "base", model=m2, optimizer=o2, strict=False)
    assert torch.equal(m2[0].weight, m[0].weight)
    for n, p in m2.adapter.named_parameters():
        assert sorted(o2.state[p]) == sorted(live[n]), n
        assert all(torch.equal(o2.state[p][k], v) for k, v in live[n].items()), n


def test_an_optimizer_with_an_empty_param_group_is_refused_by_name(tmp_path: Any) -> None:
    """DCP's set_state_dict fails on a param group without parameters with a bare IndexError; the resume
    names the optimizer and the group instead."""

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = nn.Linear(4, 2)
        return m, torch.optim.SGD([{"params": [m.weight, m.bias]}, {"params": [], "lr": 0.3}], lr=0.01)

    m, opt = build()
    smpckpt.save_checkpoint(str(tmp_path), "t", model=m, optimizer=opt, options=smpckpt.SaveOptions(save_rng=False))
    m2, opt2 = build()
    with pytest.raises(smpckpt.SpecError, match=r"optimizer 0's param group 1 holds no parameters"):
        smpckpt.resume_from_checkpoint(str(tmp_path), "t", model=m2, optimizer=opt2)


def test_param_groups_saved_apart_resumed_into_one_group_refused(tmp_path: Any) -> None:
    """Saved with two param groups (lr 0.01 and 0.5), resumed into one group: DCP's set_state_dict gave
    the whole group the first parameter's lr (the bias's 0.5 was lost, silently). Refused by name;
    strict=False warns and takes the first value; the groups as saved resume exactly."""

    def setup(groups: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = nn.Linear(2, 2)
        params: Any = (
            [{"params": [m.weight], "lr": 0.01}, {"params": [m.bias], "lr": 0.5}] if groups else m.parameters()
        )
        o = torch.optim.Adam(params, lr=0.1)
        m(torch.randn(3, 2)).sum().backward()
        o.step()
        return m, o

    saved, saved_opt = setup(True)
    save_checkpoint(str(tmp_path), "a", model=saved, optimizer=saved_opt)
    m, o = setup(False)
    with pytest.raises(LayoutMismatch, match=r"param group 0: .*different 'lr' \(weight: 0.01, bias: 0.5\)"):
        resume_from_checkpoint(str(tmp_path), model=m, optimizer=o)
    m, o = setup(False)
    with pytest.warns(UserWarning, match="the group takes 0.01") as warned:
        resume_from_checkpoint(str(tmp_path), model=m, optimizer=o, strict=False)
    # the caller's line (it named a line of smpckpt's own, DistContext.all_ok)
    assert [w.filename for w in warned if "the group takes" in str(w.message)] == [__file__]
    m, o = setup(True)
    resume_from_checkpoint(str(tmp_path), model=m, optimizer=o)
    assert [g["lr"] for g in o.param_groups] == [0.01, 0.5]


def test_a_parameter_saved_without_optimizer_state_resumes_without_it(tmp_path: Any) -> None:
    """A parameter with no Adam state at the save (no gradient yet: an unused branch) was given the state
    of DCP's get_state_dict on a fresh optimizer (step 1, zero moments) by a strict=False resume, so the
    next step differed from the saved run's, silently; a strict resume refused the checkpoint its own run
    saved, naming the state keys. Both resume it stateless now (the checkpoint holds its param groups and
    no state for it), and the next step is the saved run's bit for bit."""

    setup, step = unused_branch_model, unused_branch_step

    m, o = setup()
    step(m, o, both=False)  # layer 1 gets no gradient, so no state
    save_checkpoint(str(tmp_path), "a", model=m, optimizer=o)
    strict_m, strict_o = setup()
    resume_from_checkpoint(str(tmp_path), model=strict_m, optimizer=strict_o)
    m2, o2 = setup()
    resume_from_checkpoint(str(tmp_path), model=m2, optimizer=o2, strict=False)
    for mm, oo in ((strict_m, strict_o), (m2, o2)):
        assert mm[1].weight not in oo.state and mm[1].bias not in oo.state
        assert torch.equal(oo.state[mm[0].weight]["exp_avg"], o.state[m[0].weight]["exp_avg"])
    step(m, o, both=True)
    step(m2, o2, both=True)
    step(strict_m, strict_o, both=True)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), strict_m.parameters(), strict=True))
    # saved without optimizer: a fresh optimizer resumes fresh (no state), not at step 1
    save_checkpoint(str(tmp_path), "model_only", model=m)
    m3, o3 = setup()
    resume_from_checkpoint(str(tmp_path), "model_only", model=m3, optimizer=o3, strict=False)
    assert not o3.state and all(torch.equal(a, b) for a, b in zip(m.parameters(), m3.parameters(), strict=True))


def test_saving_a_fresh_optimizer_leaves_it_fresh_and_stores_no_invented_state(tmp_path: Any) -> None:
    """DCP's get_state_dict steps a fresh optimizer (no state, no gradients) once at lr 0 to give it state:
    a save before the first step turned the saving run's first step into Adam's step 2 (another bias
    correction: the run diverged from one that never saved, silently) and stored step-1, zero-moment
    state no step made, which a resume then gave a fresh run too. Saved (partial and full) as it is now;
    an artifact exported with that optimizer (online, or from the partial checkpoint) says it had no
    state, so a rollback to it leaves a trained optimizer stateless, as the partial checkpoint does."""

    setup, step = unused_branch_model, unused_branch_step
    with_optimizer = smpckpt.ExportOptions(include_optimizer=True)

    m, o = setup()
    ref_m, ref_o = copy.deepcopy((m, o))  # the run that never saves
    save_checkpoint(str(tmp_path), "fresh", model=m, optimizer=o)
    save_checkpoint(str(tmp_path), "fresh_full", partial=False, model=m, optimizer=o, options=with_optimizer)
    with smpckpt.Checkpointer(str(tmp_path)) as ckpt:  # the offline export of the committed partial one
        ckpt.export("fresh", str(tmp_path / "exported"), options=with_optimizer)
    assert not o.state and all(p.grad is None for p in m.parameters())
    step(m, o, both=True)
    step(ref_m, ref_o, both=True)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), ref_m.parameters(), strict=True))
    sources = (("fresh", True), ("fresh_full", False), ("exported", False))
    for tag, partial in sources:
        m2, o2 = setup()
        resume_from_checkpoint(str(tmp_path), tag, partial=partial, model=m2, optimizer=o2)
        assert not o2.state, tag
        step(m2, o2, both=True)
        assert all(torch.equal(a, b) for a, b in zip(m2.parameters(), m.parameters(), strict=True)), tag
    # a trained run rolled back to the fresh save resumes fresh, as saved, strict or not
    for (tag, partial), strict in itertools.product(sources, (True, False)):
        trained_m, trained_o = setup()
        step(trained_m, trained_o, both=True)
        resume_from_checkpoint(str(tmp_path), tag, partial=partial, model=trained_m, optimizer=trained_o, strict=strict)
        assert not trained_o.state, (tag, strict)


def test_saved_optimizer_state_reaches_a_live_optimizer_that_holds_none_for_that_parameter(tmp_path: Any) -> None:
    """DCP initialises only an optimizer without any state: one with state for some parameters and none for
    others (a parameter with no gradient yet in a live run; or the first of two resumes left it so) had no
    destination for the others' saved state: refused as keys "loaded by no rank" under strict, skipped
    silently without (the reviewer's repro: resume x, where b had no state, then y, where it has)."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def step(m: M, o: torch.optim.Optimizer, use_b: bool) -> None:
        o.zero_grad()
        y = m.a(torch.ones(2, 4))
        (m.b(y) if use_b else y).sum().backward()
        o.step()

    def fresh() -> tuple[M, torch.optim.Optimizer]:
        torch.manual_seed(1)
        m = M()
        return m, torch.optim.Adam(m.parameters(), lr=0.01)

    torch.manual_seed(0)
    m = M()
    o = torch.optim.Adam(m.parameters(), lr=0.01)
    step(m, o, use_b=False)
    save_checkpoint(str(tmp_path), "x", model=m, optimizer=o)  # b: no state
    step(m, o, use_b=True)
    save_checkpoint(str(tmp_path), "y", model=m, optimizer=o)  # b: real state
    for strict in (False, True):
        m2, o2 = fresh()
        resume_from_checkpoint(str(tmp_path), "x", model=m2, optimizer=o2, strict=False)
        assert m2.b.weight not in o2.state
        resume_from_checkpoint(str(tmp_path), "y", model=m2, optimizer=o2, strict=strict)
        for name in ("a", "b"):
            for pname in ("weight", "bias"):
                want, got = o.state[getattr(getattr(m, name), pname)], o2.state[getattr(getattr(m2, name), pname)]
                assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), (strict, name)
        step(m2, o2, use_b=True)
    # a live optimizer keeps no invented state for a parameter the checkpoint holds none for either
    m3, o3 = fresh()
    step(m3, o3, use_b=False)
    resume_from_checkpoint(str(tmp_path), "x", model=m3, optimizer=o3, strict=False)
    assert m3.b.weight not in o3.state and m3.a.weight in o3.state


def test_optimizer_state_edges_of_a_resume_rollbacks_failures_and_odd_optimizers(tmp_path: Any) -> None:
    """The reviewer's F1-F4 around optimizer state given for a resume: a refused resume leaves none behind
    (a retry took it as saved); a strict in-process rollback to a checkpoint where ``b`` had no state
    drops ``b``'s live state (it kept later steps' state); an optimizer whose step cannot take zero dense
    gradients (SparseAdam) still resumes; an empty state entry (a read of the defaultdict) is no state."""

    class M(nn.Module):
        def __init__(self, extra: bool = False) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            if extra:
                self.c = nn.Linear(4, 4)

    def step(m: nn.Module, o: torch.optim.Optimizer, use_b: bool) -> None:
        o.zero_grad()
        y = m.a(torch.ones(2, 4))
        (m.b(y) if use_b else y).sum().backward()
        o.step()

    def equal_params(x: nn.Module, y: nn.Module) -> bool:
        return all(torch.equal(a, b) for a, b in zip(x.parameters(), y.parameters(), strict=True))

    root = str(tmp_path)
    torch.manual_seed(0)
    m = M()
    o = torch.optim.Adam(m.parameters(), lr=0.01)
    step(m, o, use_b=False)
    save_checkpoint(root, "x", model=m, optimizer=o)  # b: no state
    ref_m, ref_o = copy.deepcopy((m, o))  # one copy: the optimizer steps the copied parameters
    # F1: a refused resume (an extra parameter) leaves b without state; the retry resumes as saved
    torch.manual_seed(1)
    m1 = M(extra=True)
    o1 = torch.optim.Adam(m1.parameters(), lr=0.01)
    step(m1, o1, use_b=False)
    with pytest.raises(LayoutMismatch, match="not in the checkpoint"):
        resume_from_checkpoint(root, "x", model=m1, optimizer=o1)
    assert not o1.state.get(m1.b.weight)
    # F2: a strict rollback: b stepped since x (live state) ends stateless as x holds it
    step(m, o, use_b=True)
    assert o.state.get(m.b.weight)
    resume_from_checkpoint(root, "x", model=m, optimizer=o)
    assert m.b.weight not in o.state and equal_params(m, ref_m)
    step(m, o, use_b=True)
    step(ref_m, ref_o, use_b=True)
    assert equal_params(m, ref_m)
    # F4: an empty entry for b is no state: a fresh optimizer resumes x as saved
    torch.manual_seed(1)
    m4 = M()
    o4 = torch.optim.Adam(m4.parameters(), lr=0.01)
    step(m4, o4, use_b=False)
    _ = [o4.state[p].get("step") for p in m4.parameters()]  # logging code reading every parameter's state
    save_checkpoint(root, "y", model=m, optimizer=o)  # b: real state now
    resume_from_checkpoint(root, "y", model=m4, optimizer=o4)
    assert torch.equal(o4.state[m4.b.weight]["exp_avg"], o.state[m.b.weight]["exp_avg"])
    # a fresh optimizer whose parameters already hold gradients (a backward, no step): DCP gives it no
    # state, so the saved state had no destination (rev55's E3)
    torch.manual_seed(1)
    m5 = M()
    o5 = torch.optim.Adam(m5.parameters(), lr=0.01)
    m5.a(torch.ones(2, 4)).sum().backward()
    grad = m5.a.weight.grad.clone()
    resume_from_checkpoint(root, "y", model=m5, optimizer=o5)
    assert torch.equal(o5.state[m5.b.weight]["exp_avg"], o.state[m.b.weight]["exp_avg"])
    assert torch.equal(m5.a.weight.grad, grad)  # the caller's gradients are theirs
    # a full artifact: a rollback to one exported when b had no state leaves b stateless (rev55's E1)
    torch.manual_seed(0)
    mf = M()
    of = torch.optim.Adam(mf.parameters(), lr=0.01)
    step(mf, of, use_b=False)
    save_checkpoint(root, "fx", partial=False, model=mf, optimizer=of, include_optimizer=True)
    step(mf, of, use_b=True)
    assert of.state.get(mf.b.weight)
    resume_from_checkpoint(root, "fx", partial=False, model=mf, optimizer=of)
    assert mf.b.weight not in of.state and of.state.get(mf.a.weight)
    # F3: SparseAdam cannot step zero dense gradients: its stateless parameter stays so, the resume works
    e = nn.Embedding(5, 4, sparse=True)
    f = nn.Embedding(5, 4, sparse=True)
    sm = nn.ModuleDict({"e": e, "f": f})
    so = torch.optim.SparseAdam(list(sm.parameters()), lr=0.01)
    so.zero_grad()
    e(torch.tensor([0, 2])).sum().backward()
    so.step()
    save_checkpoint(root, "sparse", model=sm, optimizer=so)
    resume_from_checkpoint(root, "sparse", model=sm, optimizer=so)
    assert f.weight not in so.state and e.weight in so.state


def test_a_fresh_sparse_adam_resumes_bit_exact(tmp_path: Any) -> None:
    """rev66e (e3): a resume into a fresh SparseAdam failed ("does not support dense gradients": the step
    that builds its state took dense zero gradients) and left it at lr 0 with zero gradients."""

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        m = nn.Embedding(10, 4, sparse=True)
        return m, torch.optim.SparseAdam(m.parameters(), lr=0.01)

    def step(m: nn.Module, o: torch.optim.Optimizer, ids: list[int]) -> None:
        o.zero_grad()
        m(torch.tensor(ids)).sum().backward()
        o.step()

    m, o = build(0)
    step(m, o, [1, 2])
    save_checkpoint(str(tmp_path), "a", model=m, optimizer=o)
    m2, o2 = build(1)
    resume_from_checkpoint(str(tmp_path), "a", model=m2, optimizer=o2)
    assert o2.param_groups[0]["lr"] == 0.01 and m2.weight.grad is None
    assert torch.equal(m2.weight, m.weight)
    assert o2.state[m2.weight]["step"] == o.state[m.weight]["step"] == 1
    assert all(torch.equal(o2.state[m2.weight][k], o.state[m.weight][k]) for k in ("exp_avg", "exp_avg_sq"))
    step(m, o, [2, 3])
    step(m2, o2, [2, 3])
    assert torch.equal(m2.weight, m.weight)


class _NoStep(torch.optim.SGD):
    """An optimizer whose step fails (as LBFGS's without a closure does)."""

    def step(self, closure: Any = None) -> Any:
        raise RuntimeError("this step needs a closure")


def test_a_fresh_optimizer_whose_step_fails_is_refused_by_name_with_its_lr_and_gradients_kept(tmp_path: Any) -> None:
    """The step at lr 0 that gives a fresh optimizer its state failing left lr 0 and zero gradients behind."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    saved = [torch.optim.SGD(m[0].parameters(), lr=0.5), torch.optim.SGD(m[1].parameters(), lr=0.5, momentum=0.9)]
    m(torch.randn(3, 4)).sum().backward()
    for o in saved:
        o.step()
    save_checkpoint(str(tmp_path), "a", model=m, optimizer=saved)
    keep, fresh = torch.optim.SGD(m[0].parameters(), lr=0.1), _NoStep(m[1].parameters(), lr=0.25, momentum=0.9)
    m.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match=r"optimizer 1 \(_NoStep\).*this step needs a closure"):
        resume_from_checkpoint(str(tmp_path), "a", model=m, optimizer=[keep, fresh])
    assert fresh.param_groups[0]["lr"] == 0.25 and keep.param_groups[0]["lr"] == 0.1
    assert all(p.grad is None for p in m.parameters()) and not fresh.state
    # rev67a F8: a fresh LBFGS was told to step once, which leads into the refusal of its list state
    save_checkpoint(str(tmp_path), "b", model=m)
    with pytest.raises(RuntimeError, match=r"optimizer 0 \(LBFGS\).*Leave it out of optimizer= and put its state_dict"):
        resume_from_checkpoint(str(tmp_path), "b", model=m, optimizer=torch.optim.LBFGS(m.parameters()), strict=False)

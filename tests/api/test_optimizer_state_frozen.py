"""Single process: the optimizer state of frozen and integer (quantised) or complex parameters, and which
optimizer holds a parameter (kept while frozen, in two optimizers, left out of every one)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from test_api_single import _assert_optim_equal, _equal
from torch import nn

import smpckpt
from smpckpt import LayoutMismatch, resume_from_checkpoint, save_checkpoint


class Quantised(nn.Module):
    """A linear layer and a frozen int8 parameter (a quantised weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.q = nn.Parameter(torch.randint(-5, 5, (4,), dtype=torch.int8), requires_grad=False)


def test_a_frozen_integer_parameter_with_optimizer_state_resumes(tmp_path: Any) -> None:
    """rev66e F3: a frozen int8 parameter (a quantised weight) in Adagrad (state made for every parameter)
    failed the resume: it was made trainable for the load, which torch refuses for integer tensors."""

    torch.manual_seed(0)
    m = Quantised()
    o = torch.optim.Adagrad(m.parameters(), lr=0.1)
    m.lin(torch.randn(2, 4)).sum().backward()
    o.step()
    save_checkpoint(str(tmp_path), "a", model=m, optimizer=o)
    torch.manual_seed(1)
    m2 = Quantised()
    o2 = torch.optim.Adagrad(m2.parameters(), lr=0.1)
    resume_from_checkpoint(str(tmp_path), "a", model=m2, optimizer=o2)
    assert torch.equal(m2.lin.weight, m.lin.weight) and torch.equal(m2.q, m.q)
    assert torch.equal(o2.state[m2.lin.weight]["sum"], o.state[m.lin.weight]["sum"])


def test_a_frozen_integer_parameters_saved_optimizer_state_is_restored(tmp_path: Any) -> None:
    """DCP loads no state into a frozen parameter and torch refuses requires_grad on an integer one: its saved
    Adagrad state was dropped, silently (fresh optimizer and in-process roll-back alike)."""

    torch.manual_seed(0)
    m = Quantised()
    o = torch.optim.Adagrad(m.parameters(), lr=0.1)
    m.lin(torch.randn(2, 4)).sum().backward()
    o.step()
    o.state[m.q]["sum"].fill_(3)  # state a fresh optimizer does not hold (a quantisation step set it, say)
    saved = copy.deepcopy(o.state[m.q])
    save_checkpoint(str(tmp_path), "a", model=m, optimizer=o)
    torch.manual_seed(1)
    m2 = Quantised()
    o2 = torch.optim.Adagrad(m2.parameters(), lr=0.1)
    o.state[m.q]["sum"].fill_(5)
    for model, opt in ((m2, o2), (m, o)):
        resume_from_checkpoint(str(tmp_path), "a", model=model, optimizer=opt)
        got = opt.state[model.q]
        assert set(got) == set(saved) and all(
            torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in saved.items()
        )
        assert torch.equal(model.q, m.q) and not model.q.requires_grad


def test_putting_integer_parameters_state_back_walks_the_model_once(tmp_path: Any) -> None:
    """rev67a F7: the state of each integer parameter was put back after a walk over the model's parameters and
    the whole state dict of its own: quadratic (1000 of them: 14-18 s a resume, 2.4-3.1 s before)."""

    class Counted(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.walks = 0
            for i in range(n):
                self.register_parameter(f"f{i}", nn.Parameter(torch.randn(4)))
                self.register_parameter(
                    f"q{i}", nn.Parameter(torch.full((4,), i, dtype=torch.int8), requires_grad=False)
                )

        def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
            self.walks += 1
            return super().named_parameters(*args, **kwargs)

    walks = []
    for n in (2, 40):
        m = Counted(n)
        o = torch.optim.Adagrad(m.parameters(), lr=0.1)
        o.state[m.q1]["sum"].fill_(7)
        save_checkpoint(str(tmp_path), f"n{n}", model=m, optimizer=o)
        o.state[m.q1]["sum"].fill_(0)
        m.walks = 0
        resume_from_checkpoint(str(tmp_path), f"n{n}", model=m, optimizer=o)
        walks.append(m.walks)
        assert torch.equal(o.state[m.q1]["sum"], torch.full((4,), 7.0)) and torch.equal(
            m.q1, torch.full((4,), 1, dtype=torch.int8)
        )
    assert walks[0] == walks[1], walks


def test_a_frozen_complex_parameter_keeps_its_optimizer_state(tmp_path: Any) -> None:
    """rev66f F2: the int8 fix (only floating-point parameters made trainable for the load) left a frozen
    complex parameter, which can be trained, without its saved Adam state, silently."""

    class Complex(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.c = nn.Parameter(torch.randn(4, dtype=torch.complex64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).sum() + (self.c * self.c.conj()).real.sum()

    torch.manual_seed(0)
    m = Complex()
    o = torch.optim.Adam(m.parameters(), lr=0.1)
    m(torch.randn(2, 4)).backward()
    o.step()
    m.c.requires_grad_(False)
    save_checkpoint(str(tmp_path), "a", model=m, optimizer=o)
    torch.manual_seed(1)
    m2 = Complex()
    m2.c.requires_grad_(False)
    o2 = torch.optim.Adam(m2.parameters(), lr=0.1)
    resume_from_checkpoint(str(tmp_path), "a", model=m2, optimizer=o2)
    assert torch.equal(m2.c, m.c) and not m2.c.requires_grad
    assert set(o2.state[m2.c]) == set(o.state[m.c]), o2.state[m2.c]
    assert all(torch.equal(o2.state[m2.c][k], v) for k, v in o.state[m.c].items())


def test_a_frozen_integer_parameter_leaves_a_frozen_float_ones_saved_state_to_a_fresh_optimizer(tmp_path: Any) -> None:
    """rev67a F4: the scratch step giving frozen parameters fresh state took the int8 one too (Adam's step fails
    on it), so the frozen float parameter's saved state was refused, "loaded by no rank"."""

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.f = nn.Linear(4, 4), nn.Parameter(torch.randn(4))
            self.q = nn.Parameter(torch.randint(-5, 5, (4,), dtype=torch.int8), requires_grad=False)

    torch.manual_seed(0)
    m = Mixed()
    o = torch.optim.Adam(m.parameters(), lr=0.1)
    (m.lin(torch.randn(2, 4)) * m.f).sum().backward()
    o.step()
    m.f.requires_grad_(False)
    save_checkpoint(str(tmp_path), "a", model=m, optimizer=o)
    torch.manual_seed(1)
    m2 = Mixed()
    m2.f.requires_grad_(False)
    o2 = torch.optim.Adam(m2.parameters(), lr=0.1)
    resume_from_checkpoint(str(tmp_path), "a", model=m2, optimizer=o2)
    assert _equal(m, m2) and m2.q not in o2.state and m.q not in o.state
    for p, p2 in ((m.f, m2.f), (m.lin.weight, m2.lin.weight)):
        assert set(o2.state[p2]) == set(o.state[p]) and all(
            torch.equal(o2.state[p2][k], v) for k, v in o.state[p].items()
        )


def test_a_frozen_parameter_kept_in_its_optimizer_keeps_its_saved_state(tmp_path: Any) -> None:
    """hunt66c F1: a parameter trained, then frozen (requires_grad=False) but kept in its param group holds
    Adam state. DCP's set_state_dict loads none into a frozen parameter and the optimizer's load_state_dict
    then drops what it held: an in-process resume (or roll-back) lost it silently, strict or not; a
    restarted job freezing it alike was refused (its saved state "loaded by no rank": a fresh optimizer
    gives a frozen parameter no state). Unfrozen later, its next step() then differed from the saved run's.
    Adagrad, which makes state for every parameter when built, lost a frozen one's silently on a restart; a
    full artifact exported with the optimizer (its optimizer keys optional) lost it silently, strict too."""

    def build(kind: str = "adam") -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(1)
        m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
        opt = torch.optim.Adagrad(m.parameters()) if kind == "adagrad" else torch.optim.Adam(m.parameters())
        return m, opt

    def step(m: nn.Module, o: torch.optim.Optimizer) -> None:
        m(torch.ones(3, 4)).sum().backward()
        o.step()
        o.zero_grad()

    for kind in ("adam", "adagrad"):
        m, o = build(kind)
        step(m, o)
        m[0].weight.requires_grad_(False)  # trained, then frozen: its state stays in the optimizer
        step(m, o)
        saved = copy.deepcopy(o.state_dict())
        save_checkpoint(str(tmp_path), kind, model=m, optimizer=o)
        with_optimizer = smpckpt.ExportOptions(include_optimizer=True)
        save_checkpoint(str(tmp_path), f"{kind}_full", partial=False, model=m, optimizer=o, options=with_optimizer)
        m_full, o_full = build(kind)
        m_full[0].weight.requires_grad_(False)
        resume_from_checkpoint(str(tmp_path), f"{kind}_full", partial=False, model=m_full, optimizer=o_full)
        _assert_optim_equal(m, o, m_full, o_full)  # a full artifact's optimizer keys are optional: lost silently
        step(m, o)  # then an in-process roll-back to the save
        for strict in (True, False):
            resume_from_checkpoint(str(tmp_path), kind, model=m, optimizer=o, strict=strict)
            got = o.state_dict()
            assert got["state"].keys() == saved["state"].keys(), (kind, strict, got["state"].keys())
            assert all(torch.equal(v, got["state"][i][k]) for i, s in saved["state"].items() for k, v in s.items())
        for strict in (True, False):  # a restarted job, frozen alike
            m2, o2 = build(kind)
            m2[0].weight.requires_grad_(False)
            resume_from_checkpoint(str(tmp_path), kind, model=m2, optimizer=o2, strict=strict)
            _assert_optim_equal(m, o, m2, o2)
            for model, opt in ((m, o), (m2, o2)):  # unfrozen: the next step is the saved run's, bit for bit
                model[0].weight.requires_grad_(True)
                step(model, opt)
            assert _equal(m, m2), (kind, strict)
            resume_from_checkpoint(str(tmp_path), kind, model=m, optimizer=o)  # the saved run again
            m[0].weight.requires_grad_(False)


class _Nested(torch.optim.Optimizer):
    """Keeps nested state, which DCP flattens to ``state.<fqn>.inner.<key>``: ``{step, inner: {m, count}}``."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for p in (p for g in self.param_groups for p in g["params"] if p.grad is not None):
            s = self.state[p]
            s.setdefault("inner", {"m": torch.zeros_like(p), "count": 0})["count"] += 1
            s["step"] = s.get("step", 0) + 1
            p.sub_(s["inner"]["m"].mul_(0.9).add_(p.grad), alpha=self.param_groups[0]["lr"])


def test_a_frozen_parameters_nested_optimizer_state_is_restored(tmp_path: Any) -> None:
    """rev66b R1: a frozen parameter's state put back after DCP's load was looked up by flat keys only, so a
    nested int (``inner.count``) kept the live value on an in-process roll-back, the scratch step's on a restart."""

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
        return m, _Nested(m.parameters())

    def step(m: nn.Module, o: torch.optim.Optimizer, n: int) -> None:
        for _ in range(n):
            m(torch.ones(3, 4)).sum().backward()
            o.step()
            o.zero_grad()

    m, o = build()
    step(m, o, 2)
    m[0].weight.requires_grad_(False)
    step(m, o, 1)
    saved = copy.deepcopy(o.state[m[0].weight])
    save_checkpoint(str(tmp_path), "n", model=m, optimizer=o)
    m[0].weight.requires_grad_(True)
    step(m, o, 3)
    m[0].weight.requires_grad_(False)
    m2, o2 = build()
    m2[0].weight.requires_grad_(False)
    for model, opt in ((m, o), (m2, o2)):  # an in-process roll-back, a restart frozen alike
        resume_from_checkpoint(str(tmp_path), "n", model=model, optimizer=opt)
        got = opt.state[model[0].weight]
        assert (got["step"], got["inner"]["count"]) == (saved["step"], saved["inner"]["count"]) == (2, 2), got
        assert torch.equal(got["inner"]["m"], saved["inner"]["m"])


def test_a_fresh_optimizer_holding_a_frozen_parameter_warns_of_nothing(tmp_path: Any, caplog: Any) -> None:
    """rev66b R2: a fresh optimizer holding a never-trained frozen parameter (a fine-tune passing
    model.parameters()) sent every parameter to the scratch step, so a class not built from its groups alone (an
    extra ``__init__`` argument) logged "could not be given fresh state ... cannot be loaded" on each restart,
    though DCP's own initialisation gives its trainable parameters their state and the resume was exact."""

    class Named(torch.optim.Adam):
        def __init__(self, params: Any, name: str) -> None:
            super().__init__(params)

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        m[0].weight.requires_grad_(False)
        return m, Named(m.parameters(), "fine-tune")

    (m, o), (m2, o2) = build(), build()
    m(torch.ones(3, 4)).sum().backward()
    o.step()
    save_checkpoint(str(tmp_path), "f", model=m, optimizer=o)
    with caplog.at_level("WARNING", logger="smpckpt"):
        resume_from_checkpoint(str(tmp_path), "f", model=m2, optimizer=o2)
    assert not [r.message for r in caplog.records if r.levelname == "WARNING"]
    assert m2[0].weight not in o2.state and len(o2.state) == len(o.state) == 3
    p1, p2 = dict(m.named_parameters()), dict(m2.named_parameters())
    assert all(torch.equal(v, o2.state[p2[n]][k]) for n, p in p1.items() if p in o.state for k, v in o.state[p].items())


def test_a_parameter_in_two_optimizers_is_refused_by_name(tmp_path: Any) -> None:
    """hunt66c F2: DCP keys optimizer state by parameter name, so two optimizers holding one parameter (Adam over
    the model, SGD with momentum over a layer) overwrote each other's state and param groups in the state dict:
    the save was accepted, and held one optimizer's state for that layer, the other's lost; the resume was
    refused for keys the other lacked, and strict=False failed inside torch (``TypeError: float() argument must
    be ... not 'dict'``) after the model was loaded. Refused now, before anything is written or read, naming
    the parameter and both optimizers; one optimizer passed twice is still one."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    adam, sgd = torch.optim.Adam(m.parameters()), torch.optim.SGD(m[2].parameters(), lr=0.1, momentum=0.9)
    m(torch.ones(2, 4)).sum().backward()
    adam.step()
    sgd.step()
    refusal = r"^parameter '2\.weight' is in optimizers 0 and 1: pass optimizers over disjoint parameters$"
    with pytest.raises(ValueError, match=refusal):
        save_checkpoint(str(tmp_path), "a", model=m, optimizer=[adam, sgd])
    assert not list(tmp_path.iterdir())
    save_checkpoint(str(tmp_path), "a", model=m, optimizer=[adam, adam])
    with pytest.raises(ValueError, match=refusal):
        resume_from_checkpoint(str(tmp_path), "a", model=m, optimizer=[adam, sgd], strict=False)
    resume_from_checkpoint(str(tmp_path), "a", model=m, optimizer=adam)

    # rev66b R3: one optimizer listing a tied weight by both its names (torch warns, accepts) saved and resumed
    # bit-exactly before, and was refused as "two optimizers"; a parameter in two groups of one failed KeyError: 1
    def tied() -> tuple[nn.Module, torch.optim.Optimizer]:
        tie = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
        tie[1].weight = tie[0].weight
        with pytest.warns(UserWarning, match="duplicate parameters"):
            return tie, torch.optim.Adam([p for _, p in tie.named_parameters(remove_duplicate=False)])

    (t, o), (t2, o2) = tied(), tied()
    t(torch.arange(4)).sum().backward()
    o.step()
    save_checkpoint(str(tmp_path), "tied", model=t, optimizer=o)
    resume_from_checkpoint(str(tmp_path), "tied", model=t2, optimizer=o2)
    _assert_optim_equal(t, o, t2, o2)
    assert torch.equal(t[0].weight, t2[0].weight)
    o.param_groups.append({**o.param_groups[0], "params": [t[0].weight]})  # add_param_group would refuse it
    with pytest.raises(ValueError, match=r"^parameter '0\.weight' is in param_groups 0 and 1 of optimizer 0: "):
        save_checkpoint(str(tmp_path), "b", model=t, optimizer=o)


def test_a_parameter_left_out_of_the_optimizer_with_saved_state_is_refused_saying_why(tmp_path: Any) -> None:
    """hunt66c L3: trained at save, frozen and left out of the optimizer at the resume: refused naming only
    the optimizer keys no rank loads, not why nor what to do."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    o = torch.optim.Adam(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    o.step()
    save_checkpoint(str(tmp_path), "a", model=m, optimizer=o)
    m[1].requires_grad_(False)
    live = torch.optim.Adam(m[0].parameters())
    with pytest.raises(
        LayoutMismatch, match=r"parameter\(s\) 1.bias, 1.weight were in a saved optimizer.*in no optimizer passed"
    ):
        resume_from_checkpoint(str(tmp_path), "a", model=m, optimizer=live)
    resume_from_checkpoint(str(tmp_path), "a", model=m, optimizer=o)  # what it says to do: an optimizer holding them

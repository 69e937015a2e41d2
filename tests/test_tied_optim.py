"""The optimizer state of tied parameters: a tie held apart (pipeline stages, aliases) follows the copy its
weights come from (keep_tied's, or the two compared like the weights), a tie saved tied is read once, a copy's
``step`` compared by value whatever its type, and all of it through a name_map."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import smpckpt
from smpckpt import ParallelLayout


class _PipeStage(nn.Module):
    """Stage ``stage`` of ``pp`` (the embedding on the first, its own head on the last); pp=1 ties them."""

    def __init__(self, stage: int, pp: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        embed, head = nn.Embedding(11, 4), nn.Linear(4, 11, bias=False)
        with torch.no_grad():
            head.weight.copy_(embed.weight)
        self.layers = nn.ModuleList(nn.Linear(4, 4, bias=False) for _ in range(2 // pp))
        if stage == 0:
            self.embed = embed
        if stage == pp - 1:
            self.head = head
        if pp == 1:
            self.head.weight = self.embed.weight


def _tie_apart(model: nn.Module) -> list[dict[str, Any]]:
    """Param groups: the layers, then the embedding and head (a group of their own)."""
    tied = [p for name, p in model.named_parameters() if not name.startswith("layers.")]
    return [{"params": list(model.layers.parameters())}, {"params": tied}]


def _save_pp2_stages(rank: int, world: int, root: str) -> dict[str, dict[str, torch.Tensor]]:
    """Tag "same": the tie's gradient all-reduced (head and embedding alike); "drift": the head's gradient
    differs, so its weights and Adam moments drift from the embedding's; "moments": one moment differs;
    "lr": equal tensors, the head's lr differs; "frozen": the head had no gradient (no state), the embedding
    a zero one (Adam state, its weights unchanged: equal to the head's). Returns each
    tag's Adam state."""
    out = {}
    for tag, head_grad in (("same", -0.25), ("drift", 0.5), ("moments", -0.25), ("lr", -0.25), ("frozen", None)):
        model = _PipeStage(rank, 2)
        opt = torch.optim.Adam(_tie_apart(model), lr=0.1)
        for name, p in model.named_parameters():
            grad = (-0.25 if head_grad is None else head_grad) if rank == 1 else -0.25 if head_grad else 0.0
            p.grad = None if head_grad is None and name == "head.weight" else torch.full_like(p, grad)
        opt.step()
        if tag == "moments" and rank == 1:  # equal weights, one moment apart
            opt.state[model.head.weight]["exp_avg"][0, 0] += 1.0
        if tag == "lr" and rank == 1:  # equal tensors, the head's param group apart
            opt.param_groups[1]["lr"] = 0.05
        smpckpt.save_checkpoint(root, tag, model=model, optimizer=opt, layout=ParallelLayout(pp=2, pp_layers=(1, 1)))
        param = model.embed.weight if rank == 0 else model.head.weight
        out[tag] = {"weight": param.detach().clone(), **{k: v.clone() for k, v in opt.state[param].items()}}
    return out


@pytest.mark.dist
def test_a_tie_held_apart_by_pipeline_stages_loads_with_its_own_optimizer_state(tmp_path: Path) -> None:
    """A tied embedding/head trained under PP (each stage its own copy) resumed into a model that ties them:
    keep_tied's choice brought that key's weights but the other key's Adam moments, and a strict resume was
    refused for the other key's optimizer state (loaded by no rank), tie or no tie (hunt62a). The state now
    follows the weights: the key kept, or, without keep_tied, the two keys' states compared as the weights."""
    from dist_harness import run_world

    saved = run_world(_save_pp2_stages, 2, str(tmp_path), timeout=180)
    embed, head = saved[0]["drift"], saved[1]["drift"]
    assert not torch.equal(embed["exp_avg"], head["exp_avg"])
    for keep, want in ((["model.head.weight"], head), (["model.embed.weight"], embed), ((), saved[0]["same"])):
        model = _PipeStage(0, 1)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        options = smpckpt.ResumeOptions(keep_tied=keep)  # strict
        smpckpt.resume_from_checkpoint(
            str(tmp_path), "drift" if keep else "same", model=model, optimizer=opt, options=options
        )
        assert torch.equal(model.embed.weight, want["weight"]), keep
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[model.embed.weight][name], want[name]), (keep, name)
        assert smpckpt.last_resume_info().skipped_keys == ()
    model = _PipeStage(0, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    with pytest.raises(
        smpckpt.LayoutMismatch,
        match=r"'optim\.state\.head\.weight\.exp_avg' and 'optim\.state\.embed.*keep_tied=\['model\.embed\.weight'\]",
    ):
        smpckpt.resume_from_checkpoint(str(tmp_path), "moments", model=model, optimizer=opt)
    # a copy's objects (a param group's lr) compared like its tensors: the embedding's were taken silently
    model = _PipeStage(0, 1)
    opt = torch.optim.Adam(_tie_apart(model), lr=0.7)
    with pytest.raises(
        smpckpt.LayoutMismatch,
        match=r"'optim\.param_groups\.head\.weight\.lr' and 'optim\.param_groups\.embed\.weight\.lr'.*"
        r"keep_tied=\['model\.embed\.weight'\]",
    ):
        smpckpt.resume_from_checkpoint(str(tmp_path), "lr", model=model, optimizer=opt)
    for keep, lr in ((["model.head.weight"], 0.05), (["model.embed.weight"], 0.1)):
        opt = torch.optim.Adam(_tie_apart(model), lr=0.7)
        options = smpckpt.ResumeOptions(keep_tied=keep)
        smpckpt.resume_from_checkpoint(str(tmp_path), "lr", model=model, optimizer=opt, options=options)
        assert opt.param_groups[1]["lr"] == lr, keep
    # a copy saved without state (frozen head) resumes without, strict, whichever keep_tied names (hunt62/rev62g
    # F6: keep_tied=head was refused naming the embedding's state, which the checkpoint holds, as absent)
    for keep, want in ((["model.head.weight"], saved[1]["frozen"]), (["model.embed.weight"], saved[0]["frozen"])):
        model = _PipeStage(0, 1)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        options = smpckpt.ResumeOptions(keep_tied=keep)
        smpckpt.resume_from_checkpoint(str(tmp_path), "frozen", model=model, optimizer=opt, options=options)
        assert torch.equal(model.embed.weight, want["weight"]), keep
        state = opt.state.get(model.embed.weight, {})
        assert sorted(state) == sorted(k for k in want if k != "weight"), keep
        assert all(torch.equal(state[k], want[k]) for k in state), keep
        stateless = () if state else tuple(f"optim.state.embed.weight.{k}" for k in ("exp_avg", "exp_avg_sq", "step"))
        assert smpckpt.last_resume_info().skipped_keys == stateless, keep  # as any parameter saved without state
    # without keep_tied, a copy with state and one without differ, equal weights or not (were: the state kept)
    with pytest.raises(
        smpckpt.LayoutMismatch,
        match=r"rank 0: 'model\.head\.weight' and 'model\.embed\.weight' .*only one holds optim\.state\.embed\.weight\."
        r"exp_avg, .*keep_tied=\['model\.embed\.weight'\]",
    ) as caught:
        smpckpt.resume_from_checkpoint(str(tmp_path), "frozen", model=model, optimizer=opt)
    # the planner's own refusal names its rank, as its other load refusals do (it did not: rev63 item 4)
    assert str(caught.value.__cause__.failures[0][0]).startswith("rank 0: 'model.head.weight' and "), caught.value


def test_a_tie_saved_tied_resumes_through_one_read_whichever_key_keep_tied_names(tmp_path: Path) -> None:
    """rev62h F1/F2: a tie saved tied (one tensor listed under both keys) resumed into the same tied model
    with Adam: keep_tied naming the alias (the README's own example) was refused ("14 keys are not in the
    checkpoint: optim.state..."), and without keep_tied the tensor was read twice, into scratch, and
    compared (a copy of the embedding per resume)."""
    from smpckpt.planners import _shared_memory

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed = nn.Embedding(7, 3)
            self.head = nn.Linear(3, 7, bias=False)
            self.head.weight = self.embed.weight

    m = Tied()
    o = torch.optim.Adam(m.parameters(), lr=0.1)
    m.embed.weight.grad = torch.full((7, 3), -0.25)
    o.step()
    smpckpt.save_checkpoint(str(tmp_path), "t", model=m, optimizer=o)
    compared: list[dict[str, str]] = []
    real = _shared_memory.TiedLoads.plan

    def plan(self: Any, *args: Any, **kwargs: Any) -> Any:
        real(self, *args, **kwargs)
        compared.append(dict(self.compare))

    _shared_memory.TiedLoads.plan = plan  # type: ignore[method-assign]
    try:
        for keep in ([], ["model.embed.weight"], ["model.head.weight"], ["model.*"]):
            dm = Tied()
            do = torch.optim.Adam(dm.parameters(), lr=0.1)
            opts = smpckpt.ResumeOptions(keep_tied=keep)
            smpckpt.resume_from_checkpoint(str(tmp_path), "t", model=dm, optimizer=do, options=opts)
            assert compared[-1] == {}, (keep, compared[-1])  # one read, nothing into scratch
            assert torch.equal(dm.embed.weight, m.embed.weight) and dm.head.weight is dm.embed.weight, keep
            for name in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(do.state[dm.embed.weight][name], o.state[m.embed.weight][name]), (keep, name)
    finally:
        _shared_memory.TiedLoads.plan = real  # type: ignore[method-assign]


@pytest.mark.parametrize("case", ["four_keys_equal", "four_keys_differ", "head_declared_first"])
def test_a_tie_of_aliases_follows_its_stored_copies_optimizer_state(tmp_path: Path, case: str) -> None:
    """rev62i F1: a T5-like tie of four keys saved as two tied pairs (pipeline stages) with equal values and
    Adam state was refused as "only one holds optim..." (an alias's state lies under its stored key);
    rev62i F2 / rev62h F5: a tied model declaring the head first could not resume the optimizer state of a
    checkpoint that stores the tensor under the embedding ("14 keys are not in the checkpoint")."""
    names = ("shared", "encoder", "decoder", "lm_head") if case != "head_declared_first" else ("head", "embed")

    def build(tie_all: bool, order: tuple[str, ...]) -> nn.Module:
        m = nn.Module()
        for n in order:
            setattr(m, n, nn.Linear(3, 5, bias=False))
        torch.manual_seed(0)
        w = nn.Parameter(torch.randn(5, 3))
        v = w if tie_all or len(order) == 2 else nn.Parameter(w.detach().clone())
        for i, n in enumerate(order):
            getattr(m, n).weight = w if i < len(order) // 2 or len(order) == 2 else v
        return m

    src = build(False, names if len(names) == 4 else ("embed", "head"))
    o = torch.optim.Adam(src.parameters(), lr=0.1)
    for i, p in enumerate(src.parameters()):
        p.grad = torch.full_like(p, -0.25 if i == 0 or case != "four_keys_differ" else 0.5)
    o.step()
    smpckpt.save_checkpoint(str(tmp_path), "t", model=src, optimizer=o)
    want = next(iter(src.parameters()))
    dest = build(True, names)
    do = torch.optim.Adam(dest.parameters(), lr=0.1)
    if case == "four_keys_differ":
        with pytest.raises(smpckpt.LayoutMismatch, match="with different values"):
            smpckpt.resume_from_checkpoint(str(tmp_path), "t", model=dest, optimizer=do)
        return
    for keep in ([], [f"model.{names[0]}.weight"], [f"model.{names[-1]}.weight"]):
        dest = build(True, names)
        do = torch.optim.Adam(dest.parameters(), lr=0.1)
        opts = smpckpt.ResumeOptions(keep_tied=keep)
        smpckpt.resume_from_checkpoint(str(tmp_path), "t", model=dest, optimizer=do, options=opts)
        (p,) = dest.parameters()
        assert torch.equal(p, want), keep
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(do.state[p][name], o.state[want][name]), (keep, name)


class _StepKinds(torch.optim.Optimizer):
    """Keeps a ``step`` per parameter, as a 0-d tensor for those in ``as_tensor``, else a Python int (two
    pipeline stages' optimizers of one tie may differ so)."""

    def __init__(self, params: Any, as_tensor: tuple[nn.Parameter, ...] = ()) -> None:
        super().__init__(params, {"lr": 0.1})
        self.as_tensor = {id(p) for p in as_tensor}

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0) if id(p) in self.as_tensor else 0
                state["step"] += 1


class _EmbedHead(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(6, 3), nn.Linear(3, 6, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        else:
            self.head.weight = nn.Parameter(self.embed.weight.detach().clone())


@pytest.mark.parametrize("dest_step", ["int", "tensor"])
@pytest.mark.parametrize("tensor_on", ["head", "embed"])
def test_a_tie_held_apart_whose_copies_saved_step_as_tensor_and_int(
    tmp_path: Path, dest_step: str, tensor_on: str
) -> None:
    """rev62i F2/F3: one copy's ``step`` saved as a 0-d tensor, the other's as an int: equal values load
    (an internal AttributeError before), differing ones are refused naming both keys."""
    src = _EmbedHead(tied=False)
    opt = _StepKinds(src.parameters(), (getattr(src, tensor_on).weight,))
    opt.step()
    opt.step()
    smpckpt.save_checkpoint(str(tmp_path), "same", model=src, optimizer=opt)
    opt.state[src.head.weight]["step"] += 1
    smpckpt.save_checkpoint(str(tmp_path), "differ", model=src, optimizer=opt)
    for tag in ("same", "differ"):
        dst = _EmbedHead(tied=True)
        dopt = _StepKinds(dst.parameters(), (dst.embed.weight,) if dest_step == "tensor" else ())
        # the live step made the tensor copy's (head 3, embed 2): it was compared with the live value when
        # the other copy's object arrived after it, and such differing copies loaded in silence
        for _ in range(1 if tag == "same" else 3 if tensor_on == "head" else 2):
            dopt.step()
        if tag == "differ":
            with pytest.raises(smpckpt.LayoutMismatch) as caught:
                smpckpt.resume_from_checkpoint(str(tmp_path), tag, model=dst, optimizer=dopt)
            assert "'optim.state.head.weight.step' and 'optim.state.embed.weight.step'" in str(caught.value)
            continue
        smpckpt.resume_from_checkpoint(str(tmp_path), tag, model=dst, optimizer=dopt)
        step = dopt.state[dst.embed.weight]["step"]
        assert type(step) is (torch.Tensor if dest_step == "tensor" else int) and step == 2
        assert torch.equal(dst.embed.weight, src.embed.weight)


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        (2.0, 2, True),  # rev63b F2: refused as different before
        (float("nan"), float("nan"), True),
        (torch.tensor(float("nan")), float("nan"), True),
        (torch.tensor(True), True, True),
        (torch.tensor(2.0), 2, True),
        (True, 1, False),
        (2, 3, False),
        (torch.tensor([2.0]), 2.0, False),
        ({"a": 1}, {"a": 1}, True),
    ],
)
def test_tie_copies_saved_as_numbers_are_compared_by_value(a: Any, b: Any, same: bool) -> None:
    from smpckpt.planners._shared_memory import _same_object

    assert _same_object(a, b) is same and _same_object(b, a) is same


def test_planning_a_head_first_tie_splits_only_the_tied_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """rev62k F2: a tie whose head is declared first had every optimizer key of the model split by owner
    on each resume (seconds at 280k keys). Counted, not timed: the owner lookups stay those of the tie."""
    from smpckpt.model.layout import ReservedKeys
    from smpckpt.planners._shared_memory import TiedLoads

    calls: list[str] = []
    owner = ReservedKeys.state_owner
    monkeypatch.setattr(
        ReservedKeys, "state_owner", staticmethod(lambda rest, params: calls.append(rest) or owner(rest, params))
    )

    def keys(p: str) -> list[str]:
        return [f"model.{p}", f"optim.state.{p}.exp_avg", f"optim.param_groups.{p}.lr"]

    params = [f"layers.{i}.w" for i in range(2000)]
    md_all = {k: None for p in [*params, "embed.weight"] for k in keys(p)} | {"model.head.weight": None}
    entries: dict[str, Any] = {k: None for p in [*params, "head.weight"] for k in keys(p)} | {
        "model.embed.weight": None
    }
    ties = TiedLoads(None)
    ties.plan(
        entries, {"model.embed.weight": "model.head.weight"}, {"model.head.weight": "model.embed.weight"}, md_all, 0
    )
    assert ties.sources == {
        "optim.state.head.weight.exp_avg": "optim.state.embed.weight.exp_avg",
        "optim.param_groups.head.weight.lr": "optim.param_groups.embed.weight.lr",
    }
    assert ties.through == {"model.embed.weight": "model.head.weight"}
    assert len(calls) == 4, calls[:8]  # the dest's two keys of the tie and the checkpoint's two


_OUT = {
    f"{p}.head.weight{s}": f"{p}.out.weight{s}"
    for p in ("optim.state", "optim.param_groups")
    for s in (".exp_avg", ".exp_avg_sq", ".step", ".lr", ".betas", ".eps", ".weight_decay", ".amsgrad", ".maximize")
    + (".foreach", ".capturable", ".differentiable", ".fused", ".decoupled_weight_decay")
} | {"model.head.weight": "model.out.weight"}


_PREFIX_MAPS = {  # as tests/api/optim_state_helpers.py's _MAPS: name_maps moving the model's or optimizer's prefix
    "model-to-net": lambda k: "net." + k[6:] if k.startswith("model.") else k,
    "model-only-under-body": lambda k: "model.body." + k[6:] if k.startswith("model.") else k,
    "optim-to-opt": lambda k: "opt." + k[6:] if k.startswith("optim.") else k,
    "all-under-stage": lambda k: "stage/" + k if k.startswith(("model.", "optim.")) else k,
    # a dict of whole keys (no prefix moved): the head's keys renamed one by one (rev72q: refused by 7614b74)
    "exact-dict": lambda k: _OUT.get(k, k),
    # the same, strict (a dict's __getitem__): called on a probe name it was never given, a resume of a healthy tie
    # held apart ended in KeyError 'optim.state.embed.weight.\x00' (fix73a)
    "strict-dict": {
        **{k.replace(".head.", ".embed."): k.replace(".head.", ".embed.") for k in _OUT},
        **_OUT,
    }.__getitem__,
}


@pytest.mark.parametrize("name_map", list(_PREFIX_MAPS.values()), ids=list(_PREFIX_MAPS))
def test_a_tie_held_apart_loads_its_kept_copys_optimizer_state_through_a_name_map(
    tmp_path: Path, name_map: Any
) -> None:
    """rev72l H1: copies of a tie saved apart, resumed into a tied model under a prefix-moving name_map: strict
    was refused ("14 checkpoint keys are loaded by no rank: opt.param_groups.head.weight.amsgrad, ..."), and
    strict=False loaded the kept copy's weights with the other copy's moments (silently)."""
    src = _EmbedHead(tied=False)
    opt = torch.optim.Adam(src.parameters(), lr=0.1)
    src.embed.weight.grad, src.head.weight.grad = torch.full((6, 3), -0.25), torch.full((6, 3), 0.5)
    opt.step()
    sharding = smpckpt.Sharding(name_map=name_map)
    smpckpt.save_checkpoint(str(tmp_path), "a", model=src, optimizer=opt, options=sharding)
    for kept in (src.head.weight, src.embed.weight):
        keep = name_map("model.head.weight" if kept is src.head.weight else "model.embed.weight")
        for strict in (True, False):
            dst = _EmbedHead(tied=True)
            dopt = torch.optim.Adam(dst.parameters(), lr=0.1)
            options = [sharding, smpckpt.ResumeOptions(keep_tied=[keep], strict=strict)]
            smpckpt.resume_from_checkpoint(str(tmp_path), "a", model=dst, optimizer=dopt, options=options)
            assert torch.equal(dst.embed.weight, kept), (keep, strict)
            for name in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(dopt.state[dst.embed.weight][name], opt.state[kept][name]), (keep, strict, name)
    # equal weights, differing moments, no keep_tied: refused naming the mapped keys (and mapped keep_tied advice)
    with torch.no_grad():
        src.head.weight.copy_(src.embed.weight)
    smpckpt.save_checkpoint(str(tmp_path), "b", model=src, optimizer=opt, options=sharding)
    dst = _EmbedHead(tied=True)
    with pytest.raises(smpckpt.LayoutMismatch) as caught:
        smpckpt.resume_from_checkpoint(
            str(tmp_path), "b", model=dst, optimizer=torch.optim.Adam(dst.parameters()), options=sharding
        )
    want = f"'{name_map('optim.state.head.weight.exp_avg')}' and '{name_map('optim.state.embed.weight.exp_avg')}'"
    assert want in str(caught.value) and f"keep_tied=['{name_map('model.embed.weight')}']" in str(caught.value)

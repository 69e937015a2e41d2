"""Mixture-of-experts state with experts as modules under their global ids (Hugging Face style,
``experts.{g}``), on real gloo ranks: each rank holds its own experts' keys, so the ranks of a stage hold
different keys. ``Sharding(held_by_some=["experts.*"])`` says so: the ranks holding such a key are copies of
each other (expert-data-parallel: each expert on two ranks), compared by value, one writes it, and ranks
without it do not "disagree". Keys outside the globs held by some ranks stay refused, with the API's way
out in the message (hunt64a M1). The reference is what the saving run gathered from its live tensors.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_world
from torch import nn

import smpckpt
from smpckpt import ReplicaMismatch

pytestmark = pytest.mark.dist

E, H, F = 6, 4, 5
PARTS = {4: (2, 2, 1, 1), 2: (3, 3), 1: (6,)}
HELD = smpckpt.Sharding(held_by_some=["experts.*"])  # the model's own names; optimizer state follows


def _build(ids: list[int], seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.set_num_threads(1)
    model = nn.Module()
    model.router = nn.Linear(H, E, bias=False)
    model.router.weight.data = torch.randn(E, H, generator=torch.Generator().manual_seed(seed))
    model.experts = nn.ModuleDict({str(g): nn.Linear(H, F) for g in ids})
    for g, lin in model.experts.items():  # expert g is the same tensor under any EP size
        gen = torch.Generator().manual_seed(100 * seed + int(g))
        lin.weight.data, lin.bias.data = torch.randn(F, H, generator=gen), torch.randn(F, generator=gen)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01 * (seed + 1))


def _ep(rank: int, world: int) -> list[int]:
    first = sum(PARTS[world][:rank])
    return list(range(first, first + PARTS[world][rank]))


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(8, H, generator=torch.Generator().manual_seed(0))  # the same on every rank
    for g, lin in model.experts.items():
        if g != "4":  # expert 4 gets no token: no optimizer state
            lin(x).pow(2).mean().backward()
    opt.step()


def _gathered(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    names = {id(p): n for n, p in model.named_parameters()}
    mine: dict[str, Any] = {n: p.detach().clone() for n, p in model.named_parameters()}
    mine.update({f"{names[id(p)]}.{k}": v.clone() for p, s in opt.state.items() for k, v in s.items()})
    mine["lr"] = opt.param_groups[0]["lr"]
    parts: list[Any] = [mine]
    if dist.is_initialized():
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert (torch.equal(got[k], v) and got[k].dtype == v.dtype) if isinstance(v, torch.Tensor) else got[k] == v, k


def _save_ep(rank: int, world: int, root: str) -> dict[str, Any]:
    model, opt = _build(_ep(rank, world), 0)
    _train(model, opt)
    smpckpt.save_checkpoint(root, "ep4", model=model, optimizer=opt, options=HELD)
    return _gathered(model, opt)


def _resume_ep(rank: int, world: int, root: str) -> dict[str, Any]:
    model, opt = _build(_ep(rank, world), 1)
    smpckpt.resume_from_checkpoint(root, "ep4", model=model, optimizer=opt, options=HELD)
    smpckpt.save_checkpoint(root, "ep2", model=model, optimizer=opt, options=HELD)
    return _gathered(model, opt)


def test_per_expert_keys_resume_ep4_to_ep2_to_one_process(tmp_path: Any) -> None:
    root = str(tmp_path / "ckpt")
    saved = run_world(_save_ep, 4, root)[0]
    assert "experts.4.weight.exp_avg" not in saved and "experts.5.weight.exp_avg" in saved
    _same(run_world(_resume_ep, 2, root)[0], saved)
    model, opt = _build(_ep(0, 1), 2)  # one process, no process group: every expert
    smpckpt.resume_from_checkpoint(root, "ep2", model=model, optimizer=opt, options=HELD)
    _same(_gathered(model, opt), saved)


def _epdp(rank: int) -> list[int]:
    """EP2 x DP2 on 4 ranks: ranks 0 and 2 hold experts 0-2, ranks 1 and 3 experts 3-5."""
    return _ep(rank % 2, 2)


def _save_epdp(rank: int, world: int, root: str) -> dict[str, Any]:
    model, opt = _build(_epdp(rank), 0)
    _train(model, opt)
    smpckpt.save_checkpoint(root, "epdp", model=model, optimizer=opt, options=HELD)
    return _gathered(model, opt)


def _resume_epdp(rank: int, world: int, root: str) -> dict[str, Any]:
    model, opt = _build(_epdp(rank), 1)
    smpckpt.resume_from_checkpoint(root, "epdp", model=model, optimizer=opt, options=HELD)
    return _gathered(model, opt)


def test_experts_held_by_two_dp_ranks_each_save_and_resume(tmp_path: Any) -> None:
    root = str(tmp_path / "ckpt")
    saved = run_world(_save_epdp, 4, root)[0]
    _same(run_world(_resume_epdp, 4, root)[0], saved)


def _refusals(rank: int, world: int, root: str) -> list[str]:
    """Two saves that must fail on every rank: one DP copy of expert 1 drifted; biases outside the globs."""
    model, opt = _build(_epdp(rank), 0)
    _train(model, opt)
    out = []
    for tag, options in (("drift", HELD), ("outside", smpckpt.Sharding(held_by_some=["experts.*.weight"]))):
        if tag == "drift" and rank == 2:
            model.experts["1"].weight.data += 1.0
        try:
            smpckpt.save_checkpoint(root, tag, model=model, optimizer=opt, options=options)
        except ReplicaMismatch as exc:
            out.append(str(exc))
        if tag == "drift" and rank == 2:
            model.experts["1"].weight.data -= 1.0
    return out


def test_a_drifted_copy_and_keys_outside_the_globs_are_refused_by_name(tmp_path: Any) -> None:
    results = run_world(_refusals, 4, str(tmp_path / "ckpt"))
    assert all(len(r) == 2 for r in results), results
    drift, outside = results[0]
    assert "'model.experts.1.weight'" in drift and "ranks 0 and 2" in drift, drift
    assert "experts.1.bias" not in drift and "experts.0.weight" not in drift, drift
    assert "model.experts.0.bias" in outside and "absent on ranks" in outside, outside
    assert "Sharding(held_by_some=" in outside and "ShardSpec(0, axis='dp'" in outside, outside
    assert "rank_local=" not in outside, outside  # the API has no rank_local= to pass

"""Rank functions that run README.md's Python examples as printed (``tests/test_readme_examples.py``).

The parent extracts each example's text from README.md and passes it here; a rank builds the names the
example leaves to the reader (``model``, ``opt``, ``layout``, ...) and ``exec``s the text in a namespace
holding them, compiled under README.md's own path and line numbers so a failure's traceback points at
the README line. Each function returns plain values (booleans, lists of mismatching keys) for the
parent to assert on.

Block 1's model is a tiny Megatron-style stage (fused QKV, column- and row-parallel MLP) whose global
values are a function of the global layer alone, so a load under any layout can be checked bit-exactly
against that layout's slices of them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

import smpckpt
from smpckpt.model.layout import ParallelLayout

HERE = os.path.dirname(os.path.abspath(__file__))

#: block 1: the layouts the example names (checked against the ones it builds)
SAVE_LAYOUT = ParallelLayout(tp=2, pp=2, dp=2, pp_layers=(2, 2))
LOAD_LAYOUT = ParallelLayout(tp=4)
D = 64  #: hidden size: the README's ``view=(3, -1, 64)``
F = 128  #: MLP width
LAYERS = 4
#: which global dim of each tensor (the QKV as its [3, D, D] view) the TP ranks split
SPLIT_DIM = {"attn.qkv.weight": 1, "mlp.fc1.weight": 0, "mlp.fc2.weight": 1}
#: block 4: the seed of the tiny Llama (the parent's save_pretrained folder uses it too)
LLAMA_SEED = 5


def run_snippet(code: str, first_line: int, readme: str, namespace: dict[str, Any]) -> dict[str, Any]:
    """``exec`` README text in ``namespace``, padded so tracebacks name README.md's own line numbers."""
    exec(compile("\n" * (first_line - 1) + code, readme, "exec"), namespace)
    return namespace


# -- block 1: a tiny TP x PP stage ----------------------------------------------------------------------


def global_tensor(layer: int, name: str) -> torch.Tensor:
    """Global layer ``layer``'s tensor ``name`` (the QKV in its [3, D, D] view), the same on every rank."""
    shape = {"attn.qkv.weight": (3, D, D), "mlp.fc1.weight": (F, D), "mlp.fc2.weight": (D, F)}[name]
    gen = torch.Generator().manual_seed(1000 * layer + sorted(SPLIT_DIM).index(name))
    return torch.randn(shape, generator=gen)


def tp_slice(name: str, tensor: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s local tensor of a global one: for the QKV, the q, k and v rows of its heads
    (the view split on dim 1, then flattened to the local ``[3*D/tp, D]``)."""
    dim = SPLIT_DIM[name]
    part = tensor.shape[dim] // tp
    piece = tensor.narrow(dim, tp_rank * part, part)
    if name == "attn.qkv.weight":
        piece = piece.reshape(3 * part, D)
    return piece.clone().contiguous()


def from_slices(name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """The global tensor (QKV as its view) from every TP rank's local piece, in TP order."""
    if name == "attn.qkv.weight":
        pieces = [p.reshape(3, -1, D) for p in pieces]
    return torch.cat(pieces, SPLIT_DIM[name])


class _Weight(nn.Module):
    """A bias-free linear layer's parameter, nothing else (no init cost, no forward needed)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)


class _Layer(nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.attn = nn.Module()
        self.attn.qkv = _Weight(tensors["attn.qkv.weight"])
        self.mlp = nn.Module()
        self.mlp.fc1 = _Weight(tensors["mlp.fc1.weight"])
        self.mlp.fc2 = _Weight(tensors["mlp.fc2.weight"])


class TinyStage(nn.Module):
    """One pipeline stage's TP shard: stage-local ``layers.<i>`` holding global layers ``layers``."""

    def __init__(self, layers: Iterable[int], tp: int, tp_rank: int, zero: bool = False) -> None:
        super().__init__()
        built = []
        for g in layers:
            tensors = {n: tp_slice(n, global_tensor(g, n), tp, tp_rank) for n in SPLIT_DIM}
            built.append(_Layer({n: torch.zeros_like(t) if zero else t for n, t in tensors.items()}))
        self.layers = nn.ModuleList(built)


def adam_step(model: nn.Module, grad_of_param: bool = True) -> torch.optim.Optimizer:
    """One Adam step with deterministic gradients (``sin(3p)``, or ones), so ``exp_avg`` = 0.1 * grad."""
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.sin(p.detach() * 3) if grad_of_param else torch.ones_like(p)
    opt.step()
    return opt


def flat_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The FQN-keyed, flattened optimizer state the README's ``fqn_keyed_optimizer_state`` stands for."""
    _, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    return osd


def ten_lines_save(rank: int, world: int, readme: str, setup: tuple[str, int], save: tuple[str, int]) -> bool:
    """8 ranks (tp=2 x pp=2 x dp=2): each builds its stage's TP shard, takes one Adam step, and runs the
    example's set-up and ``dcp.save``. True when the example's layout is the one the model was cut for."""
    coords = SAVE_LAYOUT.coords(rank)
    model = TinyStage(SAVE_LAYOUT.stage_layers(coords.pp), SAVE_LAYOUT.tp, coords.tp)
    opt = adam_step(model)
    ns: dict[str, Any] = {"model": model, "fqn_keyed_optimizer_state": flat_optimizer_state(model, opt)}
    run_snippet(*setup, readme, ns)
    run_snippet(*save, readme, ns)
    return bool(ns["layout"] == SAVE_LAYOUT)


def _expected_after_save() -> dict[str, dict[str, torch.Tensor]]:
    """What the 8-rank save held, as global tensors: parameters and ``exp_avg`` after the Adam step,
    recomputed on the same tp=2 pieces (same shapes, so the same kernels and the same bits)."""
    pieces: dict[str, list[torch.Tensor]] = {}
    for tp_rank in range(SAVE_LAYOUT.tp):
        model = TinyStage(range(LAYERS), SAVE_LAYOUT.tp, tp_rank)
        opt = adam_step(model)
        for fqn, p in model.named_parameters():
            pieces.setdefault(fqn, []).append(p.detach().clone())
            pieces.setdefault(fqn + ".exp_avg", []).append(opt.state[p]["exp_avg"].clone())
    out: dict[str, dict[str, torch.Tensor]] = {"param": {}, "exp_avg": {}}
    for key, parts in pieces.items():
        name = key.split(".", 2)[2].removesuffix(".exp_avg")  # layers.<i>.<name>[.exp_avg]
        out["exp_avg" if key.endswith(".exp_avg") else "param"][key.removesuffix(".exp_avg")] = from_slices(name, parts)
    return out


def ten_lines_load(rank: int, world: int, readme: str, setup: tuple[str, int], load: tuple[str, int]) -> dict[str, Any]:
    """4 ranks (tp=4, no PP): zeroed parameters and an optimizer stepped with other gradients, then the
    example's set-up and ``dcp.load``. Returns the keys whose loaded values differ from this rank's
    TP=4 slices of what was saved (parameters and ``exp_avg``) and whether every ``step`` is 1."""
    model = TinyStage(range(LAYERS), LOAD_LAYOUT.tp, rank, zero=True)
    opt = adam_step(model, grad_of_param=False)
    ns: dict[str, Any] = {"model": model, "fqn_keyed_optimizer_state": flat_optimizer_state(model, opt)}
    run_snippet(*setup, readme, ns)
    run_snippet(*load, readme, ns)
    expected = _expected_after_save()
    optim = ns["state"]["optim"]
    wrong: list[str] = []
    for fqn, p in model.named_parameters():
        name = fqn.split(".", 2)[2]
        if not torch.equal(p.detach(), tp_slice(name, expected["param"][fqn], LOAD_LAYOUT.tp, rank)):
            wrong.append(fqn)
        if not torch.equal(
            optim[f"state.{fqn}.exp_avg"], tp_slice(name, expected["exp_avg"][fqn], LOAD_LAYOUT.tp, rank)
        ):
            wrong.append(f"state.{fqn}.exp_avg")
    steps = [float(v) for k, v in optim.items() if k.endswith(".step")]
    return {"wrong": wrong, "steps_one": len(steps) == 3 * LAYERS and all(s == 1.0 for s in steps)}


# -- block 2: the end-of-rank recipe ----------------------------------------------------------------------


def end_of_rank(rank: int, world: int, readme: str, recipe: tuple[str, int], root: str) -> dict[str, bool]:
    """An async save still in flight, then the recipe: the save must have committed and the group be gone."""
    torch.manual_seed(0)  # data-parallel replicas: identical on every rank
    model = nn.Linear(8, 4)
    future = smpckpt.save_checkpoint(root, "async", model=model, async_save=True, save_rng=False)
    assert future is not None  # an async save returns its future
    run_snippet(*recipe, readme, {"smpckpt": smpckpt, "dist": dist})
    return {
        "future_done": future.done() and future.exception() is None,
        "committed": os.path.exists(os.path.join(root, "async_partial", "smpckpt.manifest.json")),
        "group_gone": not dist.is_initialized(),
    }


# -- block 4: full checkpoints and Hugging Face -------------------------------------------------------------


def hf_helpers_importable() -> None:
    """Make ``tests/hf``'s helpers importable (only block 4's ranks need them, and transformers)."""
    path = os.path.join(HERE, "hf")
    if path not in sys.path:
        sys.path.insert(0, path)


def hf_example(
    rank: int, world: int, readme: str, example: tuple[str, int], root: str, hf_folder: str
) -> dict[str, Any]:
    """2 ranks (tp=2): each holds its TP pieces of a tiny Llama in our layout and runs the example. Returns
    the pieces that differ after its final resume and (rank 0) how the bf16 artifact's ``from_pretrained``
    weights and ``user_content.pt`` compare with the original."""
    hf_helpers_importable()
    from hf_e2e_workers import Holder
    from hf_reference import global_view, shard, tiny_config, tiny_model
    from transformers import AutoModelForCausalLM

    from smpckpt.model.specs import SpecRules

    layout = ParallelLayout(tp=2)
    hf_config = tiny_config("llama")
    original = tiny_model("llama", seed=LLAMA_SEED, dtype=torch.float32)
    specs = smpckpt.hf.llama.tp_specs(layout.tp, hf_config)
    rules = SpecRules(specs)
    mine = {}
    for key, tensor in global_view("llama", original).items():
        matched = rules.match(key)
        mine[key] = shard(key, tensor, None if matched is None else matched[0][0], layout.tp, rank)
    model = Holder({k: v.clone() for k, v in mine.items()})
    ns = {
        "smpckpt": smpckpt,
        "torch": torch,
        "AutoModelForCausalLM": AutoModelForCausalLM,
        "model": model,
        "layout": layout,
        "specs": specs,
        "hf_config": hf_config,
        "hf_folder": hf_folder,
        "step": 5,
    }
    run_snippet(*example, readme, ns)
    params = dict(model.named_parameters())
    out: dict[str, Any] = {
        "pieces_differ": sorted(k for k, v in mine.items() if not torch.equal(params[k].detach(), v))
    }
    if rank == 0:
        final = os.path.join(root, "final")
        hf = AutoModelForCausalLM.from_pretrained(final)
        got, want = hf.state_dict(), original.state_dict()
        out["artifact_dtypes"] = sorted({str(t.dtype) for t in got.values()})
        out["artifact_keys_differ"] = sorted(set(got) ^ set(want))
        out["artifact_values_differ"] = sorted(
            k for k in set(got) & set(want) if not torch.equal(got[k], want[k].to(torch.bfloat16))
        )
        out["user_content"] = torch.load(os.path.join(final, "user_content.pt"), weights_only=True)
    return out


def tiered_example(rank: int, world: int, readme: str, snippet: tuple[str, int], base: str) -> dict[str, Any]:
    """README's tiered block on this rank: 2 nodes x 2 ranks, the fast tier ``<base>/node<n>``."""
    import contextlib
    import io

    from smpckpt import ParallelLayout

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    node = os.path.join(base, f"node{rank // 2}")
    code, first_line = snippet
    assert '"/dev/shm/ckpt"' in code, "the README example no longer names /dev/shm/ckpt"
    code = code.replace('"/dev/shm/ckpt"', repr(node))
    torch.manual_seed(0)  # every rank the same model: pure data parallel
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    opt = adam_step(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ns: dict[str, Any] = {"model": model, "opt": opt, "step": 1, "layout": ParallelLayout(dp=world), "specs": {}}
    ns["s3"] = None
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run_snippet(code, first_line, readme, ns)
    from smpckpt.api._tiers import durable_key, job_folder

    job = job_folder(node, durable_key(os.path.join(base, "durable"), None))  # the test's durable root
    return {
        "printed": out.getvalue().split(),
        "same": all(torch.equal(model.state_dict()[k], v) for k, v in before.items()),
        "node_committed": os.path.exists(os.path.join(job, "step1_partial", "smpckpt.manifest.json")),
    }

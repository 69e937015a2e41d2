"""End-to-end resharding of a TP x PP x DP GPT through the real ``dcp.save``/``dcp.load`` (gloo, CPU).

The model (:mod:`demo_model` (examples/)) is saved once at (tp=2, pp=2, dp=2) on 8 ranks and then loaded:

* at the same layout (bit-exact logits, the fast path),
* at (tp=4, pp=1, dp=1) on 4 ranks (uneven vocabulary split 16/16/15/15),
* at tp=1 in this process, with no process group (the reference),
* into DTensors on a 2-D (dp, tp) CPU mesh; and DTensors saved with other placements load back into
  plain shards at (tp=2, pp=2, dp=1).

Parameters, Adam state and learning rates are compared as gathered global tensors with ``torch.equal``.
Logits and losses across TP degrees differ in the last bits (reduction order), so those are compared
with a tolerance, and bit-exactly only when the layout is unchanged.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_harness import run_world
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

from smpckpt import ParallelLayout, ShardSpec
from demo_model import (
    GPTConfig,
    ParallelContext,
    build_context,
    build_model,
    build_optimizer,
    checkpoint_shape,
    checkpoint_state,
    compare_states,
    gather_global_state,
    load_checkpoint,
    make_batch,
    make_layout,
    pipeline_logits,
    save_checkpoint,
    storage_reader,
    storage_writer,
    train_step,
)

pytestmark = pytest.mark.dist

CFG = GPTConfig()
TRAIN_STEPS = 3  #: steps before the save
CONTINUE_STEPS = 2  #: steps after a load; the second loss depends on the restored Adam state
EVAL_STEP = 1000  #: batch used for logits
LOAD_SEED = 777  #: destinations start from other weights, and lr=0, so a no-op load cannot pass
TOL = {"atol": 1e-4, "rtol": 1e-4}  #: across TP degrees (observed ~2e-6 here)

State = dict[str, torch.Tensor]


@dataclasses.dataclass
class RunResult:
    """What a world reports back (from rank 0)."""

    state: State  #: gathered global state right after save / after load
    logits: torch.Tensor  #: on the EVAL_STEP batch, before continuing
    losses: list[float]  #: of the CONTINUE_STEPS steps after the save / load
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def _quiet_threads() -> None:
    torch.set_num_threads(1)


def _fresh(layout: ParallelLayout) -> tuple[ParallelContext, torch.nn.Module, torch.optim.Optimizer]:
    ctx = build_context(layout)
    stage = build_model(CFG, ctx, seed=LOAD_SEED)
    return ctx, stage, build_optimizer(CFG, stage, lr=0.0)


def _continue(stage: torch.nn.Module, optim: torch.optim.Optimizer, ctx: ParallelContext) -> list[float]:
    return [train_step(CFG, stage, optim, ctx, TRAIN_STEPS + i) for i in range(CONTINUE_STEPS)]


def _eval_logits(stage: torch.nn.Module, ctx: ParallelContext) -> torch.Tensor:
    return pipeline_logits(CFG, stage, ctx, make_batch(CFG, EVAL_STEP)[0])


def _load_and_report(layout: ParallelLayout, path: str) -> RunResult:
    """Load ``path`` into a fresh model at ``layout``, gather, evaluate, train on (collective)."""
    ctx, stage, optim = _fresh(layout)
    load_checkpoint(CFG, stage, optim, ctx, path)
    state = gather_global_state(CFG, stage, optim, ctx)
    logits = _eval_logits(stage, ctx)
    return RunResult(state, logits, _continue(stage, optim, ctx))


# -- rank functions (module level: spawned ranks import them) --------------------------------------
def _save_world(rank: int, world: int, path: str) -> tuple[RunResult, RunResult] | None:
    """Train at (2, 2, 2), save; then reload at the same layout into a fresh model."""
    _quiet_threads()
    ctx = build_context(make_layout(CFG, tp=2, pp=2, dp=2))
    stage = build_model(CFG, ctx)
    optim = build_optimizer(CFG, stage)
    train_losses = [train_step(CFG, stage, optim, ctx, step) for step in range(TRAIN_STEPS)]
    state = gather_global_state(CFG, stage, optim, ctx)
    logits = _eval_logits(stage, ctx)
    save_checkpoint(CFG, stage, optim, ctx, path)
    saved = RunResult(state, logits, _continue(stage, optim, ctx), {"train_losses": train_losses})
    reloaded = _load_and_report(ctx.layout, path)
    return (saved, reloaded) if rank == 0 else None


def _load_world(rank: int, world: int, path: str, tp: int, pp: int, dp: int) -> RunResult | None:
    _quiet_threads()
    result = _load_and_report(make_layout(CFG, tp=tp, pp=pp, dp=dp), path)
    return result if rank == 0 else None


# -- DTensor state dicts ---------------------------------------------------------------------------
def _reference_structure() -> dict[str, Any]:
    """The single-process model's checkpoint state: natural global shapes, every optimizer key."""
    ctx = ParallelContext(make_layout(CFG), 0, make_layout(CFG).coords(0))
    stage = build_model(CFG, ctx)
    return checkpoint_state(stage, build_optimizer(CFG, stage))


def _param_name(section: str, key: str) -> str:
    return key if section == "model" else key.split(".", 1)[1].rsplit(".", 1)[0]


def _to_dtensors(values: State | None, mesh: Any, placements: Any) -> dict[str, Any]:
    """The checkpoint's structure as DTensors on ``mesh`` (``placements(name, tensor)``).

    Tensors come from ``values`` (gathered global state, natural shapes) or zeros; the Adam ``step``
    stays a plain replicated tensor; param_group objects are kept (or zeroed to prove they load).
    """
    from torch.distributed.tensor import distribute_tensor

    out: dict[str, Any] = {"model": {}, "optim": {}}
    for section, entries in _reference_structure().items():
        for key, ref in entries.items():
            flat = f"{section}.{key}"
            if not isinstance(ref, torch.Tensor):
                out[section][key] = ref if values is not None else (0.0 if key.endswith(".lr") else ref)
                continue
            tensor = values[flat] if values is not None else torch.zeros_like(ref)
            if key.endswith(".step"):
                out[section][key] = tensor.clone()
                continue
            name = _param_name(section, key)
            global_view = checkpoint_shape(CFG, name, tensor).contiguous()
            out[section][key] = distribute_tensor(global_view, mesh, placements(name, global_view))
    return out


def _from_dtensors(state: dict[str, Any]) -> State:
    """Gathered global state (keys and natural shapes as :func:`gather_global_state`) of a DTensor dict."""
    from torch.distributed.tensor import DTensor

    natural = _reference_structure()
    result: State = {}
    for section, entries in state.items():
        for key, value in entries.items():
            flat = f"{section}.{key}"
            if isinstance(value, DTensor):
                ref = natural[section][key]
                result[flat] = value.full_tensor().reshape(ref.shape)
            elif isinstance(value, torch.Tensor):
                result[flat] = value.clone()
            elif key.endswith(".lr"):
                result[f"optim.{key}"] = torch.tensor(float(value), dtype=torch.float64)
    return result


def _tp_placements(name: str, tensor: torch.Tensor) -> list[Any]:
    """2-D (dp, tp) mesh: Megatron-like — replicate over dp, shard over tp as the model does."""
    from torch.distributed.tensor import Replicate, Shard

    dims = {
        "qkv.weight": 1,
        "qkv.bias": 1,
        "proj.weight": 1,
        "fc1.weight": 0,
        "fc1.bias": 0,
        "fc2.weight": 1,
        "embed.weight": 0,
        "head.weight": 0,
    }
    dim = next((d for suffix, d in dims.items() if name.endswith(suffix)), None)
    return [Replicate(), Replicate() if dim is None else Shard(dim)]


def _fsdp_tp_placements(name: str, tensor: torch.Tensor) -> list[Any]:
    """2-D (dp, tp) mesh, FSDP-like: matrices sharded on dim 0 over dp and the last dim over tp."""
    from torch.distributed.tensor import Replicate, Shard

    if tensor.dim() >= 2:
        return [Shard(0), Shard(tensor.dim() - 1)]
    return [Shard(0), Replicate()]


def _dtensor_world(rank: int, world: int, plain_path: str, dtensor_path: str) -> dict[str, Any] | None:
    """Plain checkpoint -> DTensors (dp=2 x tp=2); DTensors (other placements) -> plain (tp=2, pp=2)."""
    from torch.distributed.device_mesh import init_device_mesh

    from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner

    _quiet_threads()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh_layout = ParallelLayout.from_device_mesh(mesh)

    dest = _to_dtensors(None, mesh, _tp_placements)
    dcp.load(dest, storage_reader=storage_reader(plain_path), planner=ParallelLoadPlanner(mesh_layout, rank=rank))
    loaded = _from_dtensors(dest)

    source = _to_dtensors(loaded, mesh, _fsdp_tp_placements)
    dcp.save(source, storage_writer=storage_writer(dtensor_path), planner=ParallelSavePlanner(mesh_layout, rank=rank))
    dist.barrier()
    back = _load_and_report(make_layout(CFG, tp=2, pp=2, dp=1), dtensor_path)
    return {"dtensor_loaded": loaded, "plain_from_dtensor": back} if rank == 0 else None


# -- the negative test's ranks ---------------------------------------------------------------------
def _same_name_shards(rank: int, world: int, root: str) -> dict[str, Any]:
    """Each TP rank holds a different row block of ``w`` under the same key ``w``."""
    from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner

    full = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4)
    local = full.chunk(world)[rank].clone()
    layout, specs = ParallelLayout(tp=world), {"w": ShardSpec(dim=0)}

    default_path, ours_path = os.path.join(root, "default"), os.path.join(root, "ours")
    dcp.save({"w": local}, storage_writer=storage_writer(default_path), planner=DefaultSavePlanner())
    default_dest = {"w": torch.zeros_like(local)}
    dcp.load(default_dest, storage_reader=storage_reader(default_path), planner=DefaultLoadPlanner())

    dcp.save({"w": local}, storage_writer=storage_writer(ours_path), planner=ParallelSavePlanner(layout, specs))
    ours_dest = {"w": torch.zeros_like(local)}
    dcp.load(ours_dest, storage_reader=storage_reader(ours_path), planner=ParallelLoadPlanner(layout, specs))
    return {"local": local, "default": default_dest["w"], "ours": ours_dest["w"]}


# -- fixtures --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, RunResult, RunResult]:
    """The (2, 2, 2) checkpoint, the saving world's results and its same-layout reload."""
    path = str(tmp_path_factory.mktemp("gpt") / "ckpt")
    result = run_world(_save_world, 8, path)[0]
    assert result is not None
    return path, result[0], result[1]


@pytest.fixture(scope="module")
def reference(saved: tuple[str, RunResult, RunResult]) -> RunResult:
    """The checkpoint loaded at tp=pp=dp=1 in this process, with no process group."""
    assert not dist.is_initialized()
    return _load_and_report(make_layout(CFG), saved[0])


def _assert_same_state(expected: State, actual: State) -> None:
    problems = compare_states(expected, actual)
    assert not problems, "\n".join(problems[:20])


# -- tests -----------------------------------------------------------------------------------------
def test_training_ran_and_state_is_complete(saved: tuple[str, RunResult, RunResult]) -> None:
    _, run, _ = saved
    losses = run.extra["train_losses"]
    assert losses[-1] < losses[0]
    n_params = len([k for k in run.state if k.startswith("model.")])
    assert n_params == 1 + 12 * CFG.n_layers + 2 + 1  # embed, layers, norm, head
    for suffix in ("exp_avg", "exp_avg_sq", "step"):
        assert len([k for k in run.state if k.endswith(f".{suffix}")]) == n_params
    assert all(float(v) == TRAIN_STEPS for k, v in run.state.items() if k.endswith(".step"))


def test_same_layout_reload_is_bitwise(saved: tuple[str, RunResult, RunResult]) -> None:
    _, run, reloaded = saved
    _assert_same_state(run.state, reloaded.state)
    assert torch.equal(run.logits, reloaded.logits)
    assert run.losses == reloaded.losses


def test_single_process_reference_matches(saved: tuple[str, RunResult, RunResult], reference: RunResult) -> None:
    _, run, _ = saved
    _assert_same_state(run.state, reference.state)
    torch.testing.assert_close(reference.logits, run.logits, **TOL)
    assert reference.losses == pytest.approx(run.losses, rel=1e-5)


def test_stock_dcp_loads_global_tensors(saved: tuple[str, RunResult, RunResult]) -> None:
    """Standard DCP metadata: the stock planner loads full tensors (fused QKV as [3, h, d])."""
    path, run, _ = saved
    expected = {k[len("model.") :]: v for k, v in run.state.items() if k.startswith("model.")}
    dest = {"model": {k: torch.zeros_like(checkpoint_shape(CFG, k, v)) for k, v in expected.items()}}
    dcp.load(dest, storage_reader=storage_reader(path), planner=DefaultLoadPlanner())
    for name, value in expected.items():
        assert torch.equal(dest["model"][name], checkpoint_shape(CFG, name, value)), name


def test_reshard_to_tp4_pp1_dp1(saved: tuple[str, RunResult, RunResult], reference: RunResult) -> None:
    path, run, _ = saved
    result = run_world(_load_world, 4, path, 4, 1, 1)[0]
    _assert_same_state(run.state, result.state)
    torch.testing.assert_close(result.logits, run.logits, **TOL)
    torch.testing.assert_close(result.logits, reference.logits, **TOL)
    assert result.losses == pytest.approx(reference.losses, rel=1e-5)


def test_dtensor_layouts_both_ways(saved: tuple[str, RunResult, RunResult], reference: RunResult) -> None:
    path, run, _ = saved
    dtensor_path = os.path.join(os.path.dirname(path), "dtensor-ckpt")
    result = run_world(_dtensor_world, 4, path, dtensor_path)[0]
    loaded = result["dtensor_loaded"]
    # gather_global_state also records each parameter's lr; the DTensor dict carries every param's.
    _assert_same_state(run.state, loaded)
    back: RunResult = result["plain_from_dtensor"]
    _assert_same_state(run.state, back.state)
    torch.testing.assert_close(back.logits, reference.logits, **TOL)
    assert back.losses == pytest.approx(reference.losses, rel=1e-5)


def test_default_planner_loses_same_name_shards_ours_does_not(tmp_path: Any) -> None:
    results = run_world(_same_name_shards, 2, str(tmp_path))
    locals_ = [r["local"] for r in results]
    assert not torch.equal(locals_[0], locals_[1])
    # DCP's default planner keeps one rank's block for the shared name: every rank loads the same
    # block, so at least one rank silently gets wrong values.
    defaults = [r["default"] for r in results]
    assert torch.equal(defaults[0], defaults[1])
    assert any(not torch.equal(d, loc) for d, loc in zip(defaults, locals_))
    default_meta = storage_reader(str(tmp_path / "default")).read_metadata().state_dict_metadata["w"]
    assert tuple(default_meta.size) == tuple(locals_[0].shape)  # the global tensor was never recorded
    # Ours: each rank gets its own block back, and the checkpoint holds the whole global tensor.
    for r in results:
        assert torch.equal(r["ours"], r["local"])
    full = {"w": torch.zeros(8, 4)}
    dcp.load(full, storage_reader=storage_reader(str(tmp_path / "ours")), planner=DefaultLoadPlanner())
    assert torch.equal(full["w"], torch.cat(locals_))

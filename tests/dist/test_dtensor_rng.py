"""A DTensor model's parallelism changing between save and resume is a layout change (real gloo ranks).

With no ``Sharding`` given, an all-DTensor model's layout is recorded as dp = world whatever its
meshes: FSDP over 4 ranks and FSDP x TP (2 x 2) record the same ``ParallelLayout``. The checkpoint also
records its DTensors' meshes and placements (``LayoutRecord.dtensors``); a resume whose own differ
reports ``layout_changed`` and keeps every rank's generators (RNG states do not map across
parallelisms: TP ranks share generator states where dropout runs on replicated activations).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from dist_harness import run_world
from torch import nn

import smpckpt
from smpckpt.model.layout import LayoutRecord

pytestmark = pytest.mark.dist


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 8)
        self.l2 = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)))


def _model(kind: str, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _Net()
    if kind == "extra":  # a head added under the same parallelism (resumed with strict=False)
        model.l3 = nn.Linear(6, 6)
    if kind in ("fsdp", "extra"):
        mesh = init_device_mesh("cpu", (world,))
    else:  # FSDP x TP: the same ranks, another parallelism
        mesh2d = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(
            model, mesh2d["tp"], {"l1": ColwiseParallel(use_local_output=False), "l2": RowwiseParallel()}
        )
        mesh = mesh2d["dp"]
    fully_shard(model.l1, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def _save(rank: int, world: int, root: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    model, opt = _model("fsdp", world)
    model(torch.ones(3, 6)).pow(2).mean().backward()
    opt.step()
    torch.manual_seed(100 + rank)  # each rank's own generator state, saved with the checkpoint
    with smpckpt.Checkpointer(root) as ckpt:
        ckpt.save("s", model, opt)
    return _full(model), torch.get_rng_state()


def _resume(rank: int, world: int, root: str, kind: str) -> tuple[Any, dict[str, torch.Tensor], Any, list[str]]:
    """ResumeInfo, parameters, the generator after the resume (or ``True``: kept as it was) and RNG warnings."""
    model, opt = _model(kind, world) if kind != "none" else (None, None)
    torch.manual_seed(7)
    before = torch.get_rng_state()
    with warnings.catch_warnings(record=True) as caught, smpckpt.Checkpointer(root) as ckpt:
        warnings.simplefilter("always")
        ckpt.resume("s", model=model, optimizer=opt, options=smpckpt.ResumeOptions(strict=kind != "extra"))
    after = torch.get_rng_state()
    return (
        ckpt.last_resume_info,
        _full(model) if model is not None else {},
        torch.equal(after, before) or after,
        [str(w.message) for w in caught if "RNG" in str(w.message)],
    )


def _resumes(rank: int, world: int, root: str, kinds: tuple[str, ...]) -> dict[str, Any]:
    """:func:`_resume` of each kind in turn, in one world (a world's set-up costs more than a resume): each
    builds its own model and meshes and seeds the generator anew, and the package keeps nothing between calls."""
    return {kind: _resume(rank, world, root, kind) for kind in kinds}


def test_dtensor_parallelism_change_is_a_layout_change(tmp_path: Any) -> None:
    root = str(tmp_path)
    saved = run_world(_save, 4, root)
    kinds = ("2d", "fsdp", "none", "extra")
    resumed = run_world(_resumes, 4, root, kinds)
    for rank, (info, params, kept, said) in enumerate(r["2d"] for r in resumed):
        assert info.layout == info.saved_layout  # dp=4 both times: only the placements tell
        assert info.resharded_tensors > 0
        assert info.layout_changed, info
        assert info.rng_restored == () and kept is True, rank
        assert all(torch.equal(params[k], v) for k, v in saved[0][0].items())
        assert (rank == 0) == bool(said) and all("DTensor placements changed" in s for s in said), said
    # the same parallelism: every rank gets its own saved generator back; also with no model (what a
    # resume(model=None) is for) and with a parameter added (rev63h F1, F2: both lost their RNG states)
    for kind in kinds[1:]:
        for rank, (info, params, kept, said) in enumerate(r[kind] for r in resumed):
            assert not info.layout_changed and info.rng_restored and not said, (kind, info)
            assert torch.equal(kept, saved[rank][1]), (kind, rank)
            assert all(torch.equal(params[k], v) for k, v in saved[rank][0].items() if params)
    # a record saved before the field existed reads as "no DTensor record" (today's behaviour)
    record = LayoutRecord.from_json({"version": 1, "layout": {"tp": 1, "pp": 1, "dp": 4}})
    assert record.dtensors is None and "dtensors" not in record.to_json()

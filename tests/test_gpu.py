"""CUDA tensors through the storage layer, the planners and the smp-style API, bit-exact (one process).

Marked ``gpu`` (tests/conftest.py skips them where CUDA is absent). ``SMPCKPT_TEST_DEVICE=cpu`` runs the
same tests on the CPU, unmarked, to check their logic on machines without a GPU; the default device is
``cuda`` (``cuda:0`` for explicit devices).
"""

from __future__ import annotations

import copy
import os
import random
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch
import torch.distributed.checkpoint as dcp
from sim import reset_dcp_caches, sim_load, sim_save
from torch import nn

from smpckpt import ParallelLayout, ShardSpec, last_resume_info, resume_from_checkpoint, save_checkpoint
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter

DEVICE = os.environ.get("SMPCKPT_TEST_DEVICE", "cuda")
if DEVICE == "cuda":
    DEVICE = "cuda:0"
ON_CUDA = DEVICE.startswith("cuda")
_F = TypeVar("_F", bound=Callable[..., Any])


def on_device(fn: _F) -> _F:
    """Marks a test ``gpu`` when it runs on a CUDA device (not when SMPCKPT_TEST_DEVICE=cpu)."""
    return pytest.mark.gpu(fn) if ON_CUDA else fn


def _on(t: torch.Tensor, device: str) -> bool:
    return t.device == torch.device(device)


def _state(device: str, seed: int = 0) -> dict[str, Any]:
    """Every dtype the writer handles, a non-contiguous view, an empty tensor, a 0-d tensor, one tensor
    of 2 MiB (above the reader's direct-read threshold) and plain objects."""
    g = torch.Generator().manual_seed(seed)
    cpu = {
        "big": torch.randn(512, 1024, generator=g),
        "bf16": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "half": torch.randn(5, 3, 2, generator=g).half(),
        "f64": torch.randn(7, generator=g, dtype=torch.float64),
        "i64": torch.randint(-(2**40), 2**40, (97,), generator=g),
        "u8": torch.randint(0, 256, (31,), generator=g, dtype=torch.uint8),
        "flag": torch.rand(12, generator=g) > 0.5,
        "scalar": torch.tensor(float(seed) + 0.25),
        "empty": torch.empty(0, 5),
        "transposed": torch.randn(6, 10, generator=g).t(),  # non-contiguous source
    }
    return {"model": {k: v.to(device) for k, v in cpu.items()}, "step": 100 + seed, "info": {"name": f"run-{seed}"}}


def _blank(sd: dict[str, Any], device: str) -> dict[str, Any]:
    """Destinations of the same structure on ``device`` (zeros; objects None)."""
    return {
        "model": {k: torch.zeros(v.shape, dtype=v.dtype, device=device) for k, v in sd["model"].items()},
        "step": None,
        "info": {"name": None},
    }


def _assert_loaded(expected: dict[str, Any], got: dict[str, Any], device: str) -> None:
    assert list(got) == ["model", "step", "info"] and list(got["model"]) == list(expected["model"])
    assert len(got["model"]) == 10
    for k, want in expected["model"].items():
        have = got["model"][k]
        assert _on(have, device), (k, have.device)
        assert have.dtype == want.dtype and have.shape == want.shape, k
        assert torch.equal(have.cpu(), want.cpu()), k
    assert got["step"] == expected["step"] and got["info"] == expected["info"]


@on_device
@pytest.mark.parametrize("fmt", ["raw", "torch_save"])
def test_dcp_roundtrip_on_device_bit_exact(tmp_path: Any, fmt: str) -> None:
    url = str(tmp_path / "ck")
    sd = _state(DEVICE)
    dcp.save(sd, storage_writer=FsspecStorageWriter(url, format=fmt))
    # the source is untouched and still on the device
    assert all(_on(v, DEVICE) for v in sd["model"].values())
    out = _blank(sd, DEVICE)
    assert not torch.equal(out["model"]["big"].cpu(), sd["model"]["big"].cpu())  # the check can fail
    dcp.load(out, storage_reader=FsspecStorageReader(url))
    _assert_loaded(sd, out, DEVICE)


@on_device
def test_device_save_loads_into_cpu_tensors(tmp_path: Any) -> None:
    url = str(tmp_path / "ck")
    sd = _state(DEVICE, seed=1)
    dcp.save(sd, storage_writer=FsspecStorageWriter(url))
    out = _blank(sd, "cpu")
    reader = FsspecStorageReader(url)
    dcp.load(out, storage_reader=reader)
    _assert_loaded(sd, out, "cpu")
    stats = reader.last_read_stats
    assert stats is not None and stats.bytes_needed == stats.bytes_read  # local, verified: whole blocks


@on_device
def test_cpu_save_loads_into_device_tensors(tmp_path: Any) -> None:
    url = str(tmp_path / "ck")
    sd = _state("cpu", seed=2)
    dcp.save(sd, storage_writer=FsspecStorageWriter(url))
    out = _blank(sd, DEVICE)
    dcp.load(out, storage_reader=FsspecStorageReader(url))
    _assert_loaded(sd, out, DEVICE)


# -- the smp-style API: model and Adam state on the device -------------------------------------------------
def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(16, 512), nn.Tanh(), nn.Linear(512, 1024), nn.Tanh(), nn.Linear(1024, 4)).to(DEVICE)
    return m, torch.optim.Adam(m.parameters(), lr=1e-3)


def _train(m: nn.Module, o: torch.optim.Optimizer, step: int) -> float:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, 16, generator=g).to(DEVICE)
    o.zero_grad()
    loss = m(x).pow(2).mean()
    loss.backward()
    o.step()
    return float(loss.detach())


def _assert_same_training_state(
    m: nn.Module, o: torch.optim.Optimizer, m2: nn.Module, o2: torch.optim.Optimizer
) -> None:
    p1, p2 = dict(m.named_parameters()), dict(m2.named_parameters())
    assert list(p1) == list(p2) and len(p1) == 6
    for name in p1:
        a, b = p1[name], p2[name]
        assert _on(b, DEVICE) and b.dtype == a.dtype and torch.equal(a.detach(), b.detach()), name
        s1, s2 = o.state[a], o2.state[b]
        assert set(s1) == set(s2) == {"step", "exp_avg", "exp_avg_sq"}, (name, set(s1), set(s2))
        for k in s1:
            # the resumed state sits where the optimizer keeps it (moments on the device, "step" where
            # Adam puts it for this device and its flags), bit-exact
            assert s2[k].device == s1[k].device and s2[k].dtype == s1[k].dtype, (name, k, s1[k].device, s2[k].device)
            assert torch.equal(s1[k].cpu(), s2[k].cpu()), (name, k)
        assert _on(s2["exp_avg"], DEVICE) and _on(s2["exp_avg_sq"], DEVICE)
    assert o2.param_groups[0]["lr"] == o.param_groups[0]["lr"]


@on_device
def test_save_checkpoint_resume_model_and_adam_on_device(tmp_path: Any) -> None:
    root = str(tmp_path)
    m, o = _model(0)
    for s in range(3):
        _train(m, o, s)
    save_checkpoint(root, "step3", model=m, optimizer=o, user_content={"step": 3})
    # the next draws of this process's generators, which resume must restore
    expect_dev = torch.rand(3, device=DEVICE)
    expect_cpu, expect_py = torch.rand(2), random.random()

    m2, o2 = _model(1)
    assert not torch.equal(m2[0].weight.detach().cpu(), m[0].weight.detach().cpu())  # the check can fail
    torch.manual_seed(777)  # disturb the generators
    assert resume_from_checkpoint(root, model=m2, optimizer=o2) == {"step": 3}
    info = last_resume_info()
    assert info is not None and info.tag == "step3" and info.path_taken == "fast" and not info.layout_changed
    assert not info.fell_back
    assert {"torch", "python"} <= set(info.rng_restored)
    if ON_CUDA:
        assert "cuda" in info.rng_restored
    assert torch.equal(torch.rand(3, device=DEVICE), expect_dev)
    assert torch.equal(torch.rand(2), expect_cpu) and random.random() == expect_py
    _assert_same_training_state(m, o, m2, o2)

    # training continues identically (same device, same inputs, same state)
    a, b = _train(m, o, 3), _train(m2, o2, 3)
    assert a == pytest.approx(b, rel=1e-6, abs=1e-7)
    for (n1, p), (n2, q) in zip(m.named_parameters(), m2.named_parameters(), strict=True):
        assert n1 == n2
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)


@on_device
@pytest.mark.parametrize("async_save", [False, True])
def test_tiered_save_resumes_from_each_tier_on_device(tmp_path: Any, async_save: bool) -> None:
    """``local_path=`` with device tensors (async: staged into pinned buffers), one node: the fast tier
    first, then (fast tier gone) the drained durable copy, both bit-exact on the device."""
    from smpckpt import wait_for_saves

    durable, local = str(tmp_path / "durable"), str(tmp_path / "fast")
    m, o = _model(0)
    _train(m, o, 0)
    fut = save_checkpoint(
        durable, "s1", model=m, optimizer=o, local_path=local, replicas=1, durable_every=1, async_save=async_save
    )
    if fut is not None:
        fut.result()
    wait_for_saves()
    for tier in ("fast", "durable"):
        if tier == "durable":
            os.rename(local, str(tmp_path / "lost"))
        m2, o2 = _model(1)
        resume_from_checkpoint(durable, model=m2, optimizer=o2, local_path=local)
        info = last_resume_info()
        assert info is not None and (info.tag, info.tier) == ("s1", tier)
        _assert_same_training_state(m, o, m2, o2)


@on_device
def test_device_checkpoint_resumes_into_cpu_model(tmp_path: Any) -> None:
    root = str(tmp_path)
    m, o = _model(0)
    for s in range(2):
        _train(m, o, s)
    save_checkpoint(root, "gpu", model=m, optimizer=o, user_content={"step": 2})
    torch.manual_seed(3)
    m_cpu = nn.Sequential(nn.Linear(16, 512), nn.Tanh(), nn.Linear(512, 1024), nn.Tanh(), nn.Linear(1024, 4))
    o_cpu = torch.optim.Adam(m_cpu.parameters(), lr=1e-3)
    assert resume_from_checkpoint(root, model=m_cpu, optimizer=o_cpu) == {"step": 2}
    p1, p2 = dict(m.named_parameters()), dict(m_cpu.named_parameters())
    assert list(p1) == list(p2) and len(p1) == 6
    for name in p1:
        assert _on(p2[name], "cpu") and torch.equal(p2[name].detach(), p1[name].detach().cpu()), name
        s1, s2 = o.state[p1[name]], o_cpu.state[p2[name]]
        assert set(s1) == set(s2) == {"step", "exp_avg", "exp_avg_sq"}, name
        for k in s1:
            assert _on(s2[k], "cpu") and torch.equal(s2[k], s1[k].cpu()), (name, k)


# -- reshard: TP=2 plain shards on the device (a simulated world in this process) <-> TP=1 ----------------
TP2 = ParallelLayout(tp=2)
SPECS = {
    "model.qkv.weight": ShardSpec(dim=1, view=(3, -1, 8)),  # fused QKV [3*h/tp, d] viewed [3, h/tp, d]
    "model.fc1.weight": ShardSpec(dim=0),  # column parallel
    "model.fc2.weight": ShardSpec(dim=1),  # row parallel
}


def _full(device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    cpu = {
        "model.qkv.weight": torch.randn(3 * 16, 8, generator=g),  # h = 16, d = 8
        "model.fc1.weight": torch.randn(64, 8, generator=g),
        "model.fc2.weight": torch.randn(8, 64, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(8, generator=g),  # replicated
    }
    return {k: v.to(device) for k, v in cpu.items()}


def _shard(full: dict[str, torch.Tensor], rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s pieces, cut independently of the planners: QKV per q/k/v block, fc1 rows, fc2 columns."""
    qkv = full["model.qkv.weight"].view(3, 16, 8).chunk(tp, dim=1)[rank].reshape(-1, 8)
    return {
        "model.qkv.weight": qkv.clone(),
        "model.fc1.weight": full["model.fc1.weight"].chunk(tp, dim=0)[rank].clone(),
        "model.fc2.weight": full["model.fc2.weight"].chunk(tp, dim=1)[rank].clone(),
        "model.norm.weight": full["model.norm.weight"].clone(),
    }


def _assert_pieces(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], device: str) -> None:
    assert list(got) == list(expected) and len(got) == 4
    for k, want in expected.items():
        assert _on(got[k], device) and got[k].dtype == want.dtype and got[k].shape == want.shape, k
        assert torch.equal(got[k].cpu(), want.cpu()), k


@on_device
def test_tp2_device_shards_reshard_to_tp1_and_back(tmp_path: Any) -> None:
    reset_dcp_caches()
    full = _full(DEVICE)
    url = str(tmp_path / "tp2")
    ranks = [_shard(full, r, 2) for r in range(2)]
    assert not torch.equal(ranks[0]["model.qkv.weight"].cpu(), ranks[1]["model.qkv.weight"].cpu())
    sim_save(
        ranks, [ParallelSavePlanner(TP2, SPECS, rank=r) for r in range(2)], [FsspecStorageWriter(url) for _ in range(2)]
    )

    # TP=1 in this process through the real dcp.load: the full tensors, on the device and on the CPU
    for device in (DEVICE, "cpu"):
        out = {k: torch.zeros_like(v, device=device) for k, v in full.items()}
        planner = ParallelLoadPlanner(ParallelLayout(), SPECS)
        dcp.load(out, storage_reader=FsspecStorageReader(url), planner=planner)
        _assert_pieces(full, out, device)
        assert planner.report.saved_layout == TP2
        # the sharded tensors are assembled from both ranks' chunks; the replica is one saved chunk
        assert set(planner.report.resharded) == {"model.qkv.weight", "model.fc1.weight", "model.fc2.weight"}
        assert planner.report.fast_path == 1

    # and back: the TP=1 checkpoint of the device tensors loads as TP=2 pieces on the device
    url1 = str(tmp_path / "tp1")
    dcp.save(full, storage_writer=FsspecStorageWriter(url1), planner=ParallelSavePlanner(ParallelLayout(), SPECS))
    blanks = [{k: torch.zeros_like(v) for k, v in _shard(full, r, 2).items()} for r in range(2)]
    sim_load(
        blanks,
        [ParallelLoadPlanner(TP2, SPECS, rank=r) for r in range(2)],
        [FsspecStorageReader(url1) for _ in range(2)],
    )
    for r in range(2):
        _assert_pieces(_shard(full, r, 2), blanks[r], DEVICE)


# -- a GPU-saved object holding a device tensor, resumed where no GPU exists ---------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="simulates a CPU-only machine")
def test_user_content_saved_on_gpu_resumes_without_cuda(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.serialization

    m = nn.Linear(2, 2)
    with monkeypatch.context() as patch:
        # torch.save records each storage's device through location_tag: "cuda:0" is what a GPU save writes
        patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        save_checkpoint(str(tmp_path), "a", model=m, user_content={"scale": torch.ones(2)})
    uc = resume_from_checkpoint(str(tmp_path), model=copy.deepcopy(m))
    assert set(uc) == {"scale"} and torch.equal(uc["scale"], torch.ones(2))


# -- the CUDA stage itself: pinned pool, side stream, events (the CPU stand-in: tests/storage/test_staging.py)
@pytest.mark.gpu
def test_cuda_saves_and_loads_stage_through_a_small_pinned_pool(tmp_path: Any) -> None:
    from smpckpt.storage.format._staging import MIN_STAGING_BYTES
    from smpckpt.storage.tools import verify_checkpoint

    g = torch.Generator(device="cuda:0").manual_seed(0)
    x = torch.randn(1024, 1024, device="cuda:0", generator=g)
    sd = {
        "made_just_now": x * 2 + 1,  # queued on the current stream: the side stream must wait for it
        "wide": torch.randn(96, 4096, device="cuda:0", generator=g),
        "transposed": torch.randn(700, 300, device="cuda:0", generator=g).t(),
        "bf16": torch.randn(333, 129, device="cuda:0", generator=g).to(torch.bfloat16),
        "small": [torch.randn(3 + i, device="cuda:0", generator=g) for i in range(40)],
    }
    expected = {k: [t.cpu() for t in v] if isinstance(v, list) else v.cpu() for k, v in sd.items()}
    writer = FsspecStorageWriter(str(tmp_path), staging_bytes=MIN_STAGING_BYTES)
    pools = []
    real = writer._stages

    def stages() -> Any:
        s = real()
        pools.append(s.pool)
        return s

    writer._stages = stages  # type: ignore[method-assign]
    dcp.save(sd, storage_writer=writer)
    assert pools and 0 < pools[0].peak_in_use <= pools[0].count
    verify_checkpoint(str(tmp_path)).raise_if_failed()
    out = {k: [torch.zeros_like(t) for t in v] if isinstance(v, list) else torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=FsspecStorageReader(str(tmp_path), staging_bytes=MIN_STAGING_BYTES))
    for k, want in expected.items():
        got = out[k]
        if isinstance(want, list):
            assert all(torch.equal(a.cpu(), b) and a.is_cuda for a, b in zip(got, want)), k
        else:
            assert got.is_cuda and torch.equal(got.cpu(), want), k


@pytest.mark.gpu
def test_cuda_full_export_stages_boxes_with_the_cast(tmp_path: Any) -> None:
    from safetensors.torch import load_file

    from smpckpt.storage import FullArtifactWriter, FullOptions
    from smpckpt.storage.format._staging import MIN_STAGING_BYTES

    sd = {"model": {"w": torch.randn(1024, 1024, device="cuda:0"), "t": torch.randn(300, 600, device="cuda:0").t()}}
    writer = FullArtifactWriter(
        str(tmp_path / "full"), full=FullOptions(dtype=torch.bfloat16), staging_bytes=MIN_STAGING_BYTES
    )
    dcp.save(sd, storage_writer=writer, planner=ParallelSavePlanner(ParallelLayout(), rank=0))
    got = load_file(str(tmp_path / "full" / "model.safetensors"))
    for k in ("w", "t"):
        assert torch.equal(got[f"model.{k}"], sd["model"][k].to(torch.bfloat16).cpu()), k


@pytest.mark.gpu
def test_cuda_views_made_just_before_the_copy_and_large_conjugate_views_keep_their_values(tmp_path: Any) -> None:
    """Two ways the side-stream copy could read the wrong bytes, each with a checksum that matches them:
    small strided views are made contiguous on the writer thread's stream just before their copy (the
    side stream must wait for that kernel, not only for the producer's work at the first copy), and a
    non-blocking device-to-host copy of a conjugate view conjugates the host buffer before the transfer
    lands (pytorch/pytorch#146286), so large conjugate views are resolved on the device first."""
    from smpckpt.storage.format._staging import MIN_STAGING_BYTES
    from smpckpt.storage.tools import verify_checkpoint

    g = torch.Generator(device="cuda:0").manual_seed(1)
    big = torch.randn(2048, 2048, device="cuda:0", generator=g)
    sd = {
        # each a matmul queued just now, then a transposed (strided) view: packed, made contiguous first
        "small_t": [
            (torch.randn(64, 40 + i, device="cuda:0", generator=g) @ big[: 40 + i, :96]).t() for i in range(24)
        ],
        "conj": torch.randn(1024, 1024, dtype=torch.complex64, device="cuda:0", generator=g).conj(),  # 8 MiB
        "neg": torch._neg_view(torch.randn(1024, 1024, device="cuda:0", generator=g)),
    }
    expected = {
        k: [t.resolve_conj().resolve_neg().cpu() for t in v]
        if isinstance(v, list)
        else v.resolve_conj().resolve_neg().cpu()
        for k, v in sd.items()
    }
    dcp.save(sd, storage_writer=FsspecStorageWriter(str(tmp_path), staging_bytes=MIN_STAGING_BYTES))
    verify_checkpoint(str(tmp_path)).raise_if_failed()
    out = {
        k: [torch.zeros_like(t) for t in v] if isinstance(v, list) else torch.zeros_like(v) for k, v in expected.items()
    }
    dcp.load(out, storage_reader=FsspecStorageReader(str(tmp_path)))
    for k, want in expected.items():
        got = out[k]
        pairs = zip(got, want) if isinstance(want, list) else [(got, want)]
        assert all(torch.equal(a, b) for a, b in pairs), k


@on_device
def test_value_digests_of_device_tensors_equal_their_cpu_copies() -> None:
    """The replica value check samples a device tensor where it lies (the sample index is moved to the
    tensor's own device, of whatever type): contiguous, strided, conjugate and float8 ones digest as
    their CPU copies do."""
    from smpckpt.planners._replica_values import value_digests

    base = torch.randn(300, 70, generator=torch.Generator().manual_seed(5))
    cpu = [
        base,
        base.t(),
        base[:, ::3],
        torch.randn(50, 50, dtype=torch.complex64).conj(),
        base.to(torch.float8_e4m3fn),
    ]
    device = [t.to(DEVICE) for t in cpu]
    assert value_digests(device) == value_digests(cpu)

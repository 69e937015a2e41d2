"""Replicas checked by value: ranks that hold the same piece of a tensor under one key must hold the same
bytes, or the save fails naming the keys and ranks -- a TP shard whose spec was forgotten, per-rank
values under a shared key, and two pipeline stages holding one global key are otherwise stored as one
rank's piece, silently."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dist_harness import run_world
from hypothesis import given, settings
from hypothesis import strategies as st
from sim import sim_load, sim_save

from smpckpt import ParallelLayout, ShardSpec
from smpckpt.errors import ReplicaMismatch, SpecError
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner
from smpckpt.planners._replica_values import SAMPLES, value_digests
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter


def _save(tmp: Path, sds: list[dict[str, Any]], layout: ParallelLayout, specs: Any = None, **kw: Any) -> Any:
    return sim_save(
        sds,
        [ParallelSavePlanner(layout, specs, rank=r, **kw) for r in range(len(sds))],
        [FsspecStorageWriter(str(tmp)) for _ in range(len(sds))],
    )


def test_digests_see_every_sampled_element_and_the_size() -> None:
    t = torch.randn(1000)
    base = value_digests([t])
    assert len(base) == 4 and value_digests([t.clone()]) == base
    changed = t.clone()
    changed[-1] += 1  # the last element is always sampled
    assert value_digests([changed]) != base
    assert value_digests([torch.zeros(3)]) != value_digests([torch.zeros(4)])  # the element count counts
    assert value_digests([torch.zeros(0), torch.zeros(2, 0)]) == value_digests([torch.zeros(0), torch.zeros(0)])
    mixed = [torch.randn(5, dtype=torch.bfloat16), torch.tensor([True, False]), torch.arange(SAMPLES * 3)]
    assert len(value_digests(mixed)) == 12


def test_a_forgotten_tp_spec_fails_naming_key_ranks_and_cause(tmp_path: Path) -> None:
    full = torch.randn(16, 16)
    sds = [{"model": {"fc1.weight": full.chunk(2)[r].clone(), "norm": torch.ones(16)}} for r in range(2)]
    with pytest.raises(
        ReplicaMismatch, match=r"stage 0: ranks 0 and 1 hold different values of 'model\.fc1\.weight'.*ShardSpec"
    ):
        _save(tmp_path / "a", sds, ParallelLayout(tp=2))
    # the same save with the spec is fine, and loads back whole
    _save(tmp_path / "b", sds, ParallelLayout(tp=2), {"model.fc1.weight": ShardSpec(0)})
    dest = [{"model": {"fc1.weight": torch.zeros(16, 16), "norm": torch.zeros(16)}}]
    sim_load(dest, [ParallelLoadPlanner(ParallelLayout(), rank=0)], [FsspecStorageReader(str(tmp_path / "b"))])
    assert torch.equal(dest[0]["model"]["fc1.weight"], full)


def test_rules_that_do_not_match_the_key_are_caught_by_value(tmp_path: Path) -> None:
    """A rule for another name matches some key (so the rule check passes) but not the sharded one."""
    full = torch.randn(8, 4)
    sds = [{"model": {"a.weight": full.chunk(2)[r].clone(), "b.weight": full.chunk(2)[r].clone()}} for r in range(2)]
    with pytest.raises(ReplicaMismatch, match=r"'model\.b\.weight'"):
        _save(tmp_path, sds, ParallelLayout(tp=2), {"model.a.weight": ShardSpec(0)})


def test_data_parallel_drift_is_named_as_such(tmp_path: Path) -> None:
    w = torch.randn(6, 3)
    sds = [{"model": {"w": w.clone()}}, {"model": {"w": w + 1e-3}}]
    with pytest.raises(ReplicaMismatch, match=r"ranks 0 and 1 .* data-parallel replicas hold different values"):
        _save(tmp_path, sds, ParallelLayout(dp=2))


def test_tp_shards_are_compared_across_dp_only(tmp_path: Path) -> None:
    """tp=2 x dp=2: a TP-split tensor's pieces differ across tp (as they should) and must agree across dp."""
    full = torch.randn(8, 4)
    layout, specs = ParallelLayout(tp=2, dp=2), {"model.w": ShardSpec(0)}
    sds = [{"model": {"w": full.chunk(2)[r % 2].clone()}} for r in range(4)]
    _save(tmp_path / "ok", sds, layout, specs)
    sds[3]["model"]["w"] = sds[3]["model"]["w"] * 2  # dp rank 1's copy of tp piece 1 drifted
    with pytest.raises(ReplicaMismatch, match=r"ranks 1 and 3 hold different values of 'model\.w'.*drifted"):
        _save(tmp_path / "bad", sds, layout, specs)


def test_two_stages_with_one_global_key(tmp_path: Path) -> None:
    """Stage-local transformer.h.0 on both stages without a name_map: only layers.<i> is renumbered."""
    layout = ParallelLayout(pp=2, pp_layers=(1, 1))
    sds = [{"model": {"transformer.h.0.attn.w": torch.full((4, 4), float(s))}} for s in range(2)]
    with pytest.raises(
        ReplicaMismatch,
        match=r"pipeline stages 0 and 1 .* 'model\.transformer\.h\.0\.attn\.w'.*name_map.*not all-reduced",
    ):
        _save(tmp_path / "a", sds, layout)
    # with the name map each stage's layer keeps its own global name
    renamed = [ParallelSavePlanner(layout, rank=r, name_map=_renumber(r)) for r in range(2)]
    metadata = sim_save(sds, renamed, [FsspecStorageWriter(str(tmp_path / "b")) for _ in range(2)])
    assert {"model.transformer.h.0.attn.w", "model.transformer.h.1.attn.w"} <= set(metadata.state_dict_metadata)


def _renumber(stage: int) -> Any:
    return lambda key: key.replace("transformer.h.0.", f"transformer.h.{stage}.")


def test_the_opt_out_saves_one_replica(tmp_path: Path) -> None:
    sds = [{"model": {"w": torch.full((3,), float(r))}} for r in range(2)]
    _save(tmp_path, sds, ParallelLayout(dp=2), verify_replicas=False, replica_owner="lowest")
    dest = [{"model": {"w": torch.zeros(3)}}]
    sim_load(dest, [ParallelLoadPlanner(ParallelLayout(), rank=0)], [FsspecStorageReader(str(tmp_path))])
    assert torch.equal(dest[0]["model"]["w"], torch.zeros(3))  # rank 0's, as asked


@pytest.mark.parametrize("scope", ["global", "local"])
def test_values_are_checked_again_when_a_cached_plan_is_reused(tmp_path: Path, scope: str) -> None:
    """The plan caches reuse the structure, never the values: the second save's drift is still caught."""
    layout = ParallelLayout(dp=2)
    planners = [ParallelSavePlanner(layout, rank=r, cache_scope=scope) for r in range(2)]
    w = torch.randn(5)
    sds = [{"model": {"w": w.clone()}} for _ in range(2)]
    sim_save(sds, planners, [FsspecStorageWriter(str(tmp_path / "1")) for _ in range(2)])
    sim_save(sds, planners, [FsspecStorageWriter(str(tmp_path / "2")) for _ in range(2)])  # a cache hit
    sds[1]["model"]["w"] = w + 1
    with pytest.raises(ReplicaMismatch, match="'model.w'"):
        sim_save(sds, planners, [FsspecStorageWriter(str(tmp_path / "3")) for _ in range(2)])


@pytest.mark.dist
def test_the_api_refuses_a_forgotten_spec_on_every_rank(tmp_path: Path) -> None:
    from replica_workers import forgotten_spec

    results = run_world(forgotten_spec, 2, str(tmp_path))
    for r in results:
        assert r["error"] is not None and r["error"][0] == "ReplicaMismatch", r
        assert "'model.fc1.weight'" in r["error"][1] and "ShardSpec" in r["error"][1]
        assert not r["committed"]
    from torch import nn

    from smpckpt import resume_from_checkpoint

    whole = nn.Linear(16, 16, bias=False)
    resume_from_checkpoint(str(tmp_path), "spec", model=_Holder(whole))
    assert torch.equal(whole.weight, torch.arange(256, dtype=torch.float32).reshape(16, 16))
    half = nn.Linear(16, 8, bias=False)  # the opt-out stored one rank's piece as the whole tensor, as asked
    resume_from_checkpoint(str(tmp_path), "optout", model=_Holder(half))
    assert torch.equal(half.weight, torch.arange(128, dtype=torch.float32).reshape(8, 16))


class _Holder(torch.nn.Module):
    def __init__(self, fc1: torch.nn.Module) -> None:
        super().__init__()
        self.fc1 = fc1


@pytest.mark.dist
def test_dtensor_replicas_are_checked_by_piece(tmp_path: Path) -> None:
    """DTensor Replicate placements, alone and over one mesh dim of a Shard/Replicate mix: ranks that hold
    the same piece must hold the same values, or dcp.save fails on every rank naming the key and ranks."""
    from replica_workers import dtensor_replicas

    from smpckpt.planners import ParallelLoadPlanner

    results = run_world(dtensor_replicas, 4, str(tmp_path))
    for r in results:
        assert "ReplicaMismatch" in r["replicate"] and "ranks 0 and 3" in r["replicate"], r["replicate"]
        assert "DTensor 'w' piece at offsets (0,)" in r["replicate"], r["replicate"]
        assert "ranks 1 and 3" in r["mixed"] and "DTensor 'w' piece at offsets (4,)" in r["mixed"], r["mixed"]
        assert "'ok'" not in r["mixed"]  # its tp pieces differ, its dp replicas agree
        assert r["fine"] is None
        assert r["kept"][:2] == [None, None] and "ranks 0 and 2" in r["kept"][2] and "'z'" in r["kept"][2], r["kept"]
    for name in ("rep", "mix"):
        assert not (tmp_path / name / ".metadata").exists()
    dest = {"w": torch.zeros(8), "z": torch.ones(3)}
    sim_load([dest], [ParallelLoadPlanner(ParallelLayout(), rank=0)], [FsspecStorageReader(str(tmp_path / "fine"))])
    assert torch.equal(dest["w"], torch.arange(8, dtype=torch.float32))
    assert torch.equal(dest["z"], torch.tensor([0.0, 1.0, 2.0]))  # either zero: equal values


def test_signed_zeros_and_nans_are_values_not_bit_patterns(tmp_path: Path) -> None:
    """-0.0 and +0.0 are one value, and so are NaNs of any sign and payload; replicas holding them agree.
    Integers stay bit-exact, and a real difference next to them is still caught."""
    a = torch.tensor([0.0, 1.0, float("nan"), -2.5])
    b = a.clone()
    b[0] = -0.0
    b.view(torch.int32)[2] = -1  # a negative NaN with another payload (x86 writes 0/0 so)
    assert torch.isnan(b[2]) and b[0].item() == 0.0
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn):
        assert value_digests([torch.tensor([0.0, 1.0]).to(dtype)]) == value_digests(
            [torch.tensor([-0.0, 1.0]).to(dtype)]
        )
    assert value_digests([torch.tensor([complex(-0.0, 1.0)])]) == value_digests([torch.tensor([complex(0.0, 1.0)])])
    assert value_digests([a]) == value_digests([b])
    assert value_digests([torch.tensor([0, 1])]) != value_digests([torch.tensor([0, 2])])
    sds = [{"model": {"w": a.clone(), "big": torch.zeros(100)}}, {"model": {"w": b.clone(), "big": -torch.zeros(100)}}]
    _save(tmp_path / "ok", sds, ParallelLayout(dp=2))
    sds[1]["model"]["big"][-1] = 1e-30
    with pytest.raises(ReplicaMismatch, match=r"ranks 0 and 1 hold different values of 'model\.big'"):
        _save(tmp_path / "bad", sds, ParallelLayout(dp=2))


def _local_plans(layout: ParallelLayout, sds: list[dict[str, Any]], specs: Any = None) -> list[Any]:
    plans = []
    for r, sd in enumerate(sds):
        p = ParallelSavePlanner(layout, specs, rank=r)
        p.set_up_planner(sd, None, r == 0)
        plans.append(p.create_local_plan())
    return plans


def test_only_the_first_two_ranks_of_a_group_send_per_key_digests() -> None:
    """tp=2 x dp=4: a replicated key (compared over the stage) and a TP shard (compared across dp).
    Every rank sends its three 4-byte summaries; per-key digests come only from the first two ranks of
    each group -- ranks 0 and 1 for the replicated key, dp 0 and 1 for the shard -- so the bytes
    gathered stop growing with the data-parallel degree."""
    layout, specs = ParallelLayout(tp=2, dp=4), {"model.w": ShardSpec(0)}
    full = torch.randn(8, 4)
    sds = [{"model": {"w": full.chunk(2)[r % 2].clone(), "norm": torch.ones(4)}} for r in range(8)]
    sizes = [len(p.planner_data["values"]) for p in _local_plans(layout, sds, specs)]
    assert sizes == [12 + 8, 12 + 8, 12 + 4, 12 + 4, 12, 12, 12, 12]


def test_a_rank_no_other_rank_shares_a_piece_with_sends_no_digests() -> None:
    one = _local_plans(ParallelLayout(), [{"model": {"w": torch.randn(5), "b": torch.zeros(2)}}])
    assert one[0].planner_data["values"] is None and "value_keys" not in one[0].planner_data
    # tp=2 at dp=1: the TP shard has no replica (not digested); the replicated key is
    sds = [{"model": {"w": torch.randn(4, 4), "norm": torch.ones(4)}} for _ in range(2)]
    plans = _local_plans(ParallelLayout(tp=2), sds, {"model.w": ShardSpec(0)})
    assert plans[0].planner_data["value_keys"][0] == ("model.norm",)
    assert [len(p.planner_data["values"]) for p in plans] == [12 + 4, 12 + 4]


def test_a_later_replica_that_drifted_is_named_by_its_ranks(tmp_path: Path) -> None:
    """dp=4: rank 3 sends a summary only; its difference from rank 0 is caught and named by rank."""
    w = torch.randn(6, 3)
    sds = [{"model": {"w": w.clone(), "v": w.clone()}} for _ in range(4)]
    sds[3]["model"]["v"] = w + 1
    with pytest.raises(
        ReplicaMismatch,
        match=r"stage 0: ranks 0 and 3 hold different values of some of the 2 tensors replicated over the stage",
    ):
        _save(tmp_path, sds, ParallelLayout(dp=4))
    sds[3]["model"]["v"] = w.clone()
    sds[1]["model"]["v"] = w + 1  # between the first two: named by key
    with pytest.raises(ReplicaMismatch, match=r"ranks 0 and 1 hold different values of 'model\.v'"):
        _save(tmp_path / "b", sds, ParallelLayout(dp=4))


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.bool]


@settings(max_examples=80, deadline=None, derandomize=True)
@given(data=st.data())
def test_contiguous_and_strided_tensors_of_equal_values_have_one_digest(data: st.DataObject) -> None:
    """Plain contiguous CPU tensors are sampled straight from memory, others with ``take``: one digest
    for equal values either way, and a changed sampled element changes it."""
    dtype = data.draw(st.sampled_from(_DTYPES))
    shape = tuple(data.draw(st.lists(st.integers(1, 9), min_size=0, max_size=3)))
    t = (torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape) * 1.25 - 7).to(dtype)
    wide = torch.zeros(*shape, 3, dtype=dtype)
    wide[..., 1] = t
    strided = wide[..., 1]
    assert strided.is_contiguous() == (t.numel() <= 1)
    assert value_digests([t, t.clone()]) == value_digests([strided, t]) == value_digests([t, strided])
    changed = t.clone().reshape(-1)
    changed[-1] = (changed[-1] == 0).to(dtype) if dtype == torch.bool else -changed[-1] - 1
    assert value_digests([changed.reshape(shape)]) != value_digests([t])


_FLOATS_BY_BITS = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex32]


@pytest.mark.parametrize("dtype", [*_FLOATS_BY_BITS, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz])
def test_samples_are_canonicalised_on_their_bits_as_values(dtype: torch.dtype) -> None:
    """The digests canonicalise samples on their bits in numpy: two bit patterns give one word exactly
    when they are one value (torch compares them, widened to float64; every NaN is one value) -- signed
    zeros, NaNs of any sign and payload, infinities, subnormals. Float8 dtypes with one encoding per value
    are their bits."""
    from smpckpt.planners import _value_digests as vd

    real = dtype.to_real() if dtype.is_complex else dtype  # complex: each part on its own
    part = torch.finfo(real).bits
    gen = torch.Generator().manual_seed(5)
    raw = torch.arange(256, dtype=torch.uint8) if part == 8 else torch.randint(0, 256, (500 * part,), generator=gen)
    special = torch.tensor([0.0, -0.0, float("nan"), -float("nan"), float("inf"), -float("inf"), 5e-324]).to(real)
    raw = torch.cat([special.view(torch.uint8).reshape(-1), raw.to(torch.uint8)])
    if dtype in vd._FLOAT_BITS:
        word, *bits = vd._FLOAT_BITS[dtype]
        words = torch.from_numpy(vd._canonical_bits(raw.numpy().view(word).copy(), word, *bits).astype(np.int64))
    else:  # one encoding per value: its bits
        words = raw.to(torch.int64)
    values = raw.view(real).double()
    same_value = (values[:, None] == values[None, :]) | (values.isnan()[:, None] & values.isnan()[None, :])
    assert torch.equal(words[:, None] == words[None, :], same_value)


def test_tensors_at_odd_addresses_digest_as_aligned_ones() -> None:
    """Samples are gathered as words where the tensors of a dtype lie at multiples of their size from
    each other, else as bytes: a tensor at an odd address (``frombuffer`` at offset 1) digests alike."""
    t = torch.randn(1000, dtype=torch.float64)
    odd = torch.frombuffer(bytearray(b"\0" + t.numpy().tobytes()), dtype=torch.float64, offset=1)
    assert odd.data_ptr() % 8 and torch.equal(odd, t)
    other = torch.randn(70, dtype=torch.float64)
    assert value_digests([t, other, odd]) == value_digests([t, other, t]) == value_digests([odd, other, odd])


def test_a_rank_digests_only_what_it_sends(monkeypatch: pytest.MonkeyPatch) -> None:
    """pp=2 x tp=2 (dp=1): every replicated key is on the stage's key list (compared across stages by
    the stages' first ranks), but a TP shard has no replica within its stage, so rank 1 (not its
    stage's first) neither summarises nor sends it: it digests the replicated keys alone, and sends
    what digests of every key would give. The stage's first rank digests every key."""
    import numpy as np
    import xxhash

    from smpckpt.planners import _replica_values as rv

    layout = ParallelLayout(tp=2, pp=2)
    tensors = [torch.randn(40) for _ in range(5)]
    codes = bytes([0, 1, 1, 0, 1])  # replicated over the stage, or split over tp
    seen: list[int] = []
    real = rv.value_digests

    def counting(ts: list[torch.Tensor]) -> bytes:
        seen.append(len(ts))
        return real(ts)

    monkeypatch.setattr(rv, "value_digests", counting)
    sent = rv.rank_values(layout, 1, tensors, codes)
    assert seen == [2]
    digests = np.frombuffer(real(tensors), dtype="<u4")
    code_of = np.frombuffer(codes, dtype=np.uint8)
    summaries = np.zeros(3, dtype="<u4")
    for code in (0, 2):  # the codes the stage's ranks share at tp=2, dp=1
        summaries[code] = xxhash.xxh3_64_intdigest(digests[code_of == code].tobytes()) & 0xFFFFFFFF
    assert sent == summaries.tobytes() + digests[code_of == 0].tobytes()
    seen.clear()
    rv.rank_values(layout, 0, tensors, codes)
    assert seen == [5]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64])
def test_strided_tensors_of_dtypes_take_has_no_kernel_for_digest_as_contiguous_ones(dtype: torch.dtype) -> None:
    """``torch.take`` (the strided path) has no float8 or uint16-64 kernel: such a transposed or sliced
    tensor failed the save; now it is sampled through an integer view of its bits, digesting as its
    contiguous copy does, and a change of every value shows."""
    src = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))
    base = src.to(dtype) if dtype.is_floating_point else (src.abs() * 1000).to(torch.int64).to(dtype)
    for t in (base.t(), base[:, 1:40]):
        assert not t.is_contiguous() and t.numel() > SAMPLES
        assert value_digests([t]) == value_digests([t.contiguous()])
    changed = base.clone()
    changed.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]).add_(1)
    assert value_digests([changed.t()]) != value_digests([base.t()])


def test_replicated_complex32_is_checked_and_undigestable_dtypes_are_refused_by_key(tmp_path: Path) -> None:
    """complex32 has no ``torch.take`` kernel: a replicated one failed every save with the check on, with
    torch's bare error; now it is sampled through its bits (a drift is still caught), as packed float4 is (a
    byte an element). A quantized one is refused before the check."""
    c = torch.randn(40, 40, dtype=torch.complex64).to(torch.complex32)
    _save(tmp_path / "same", [{"model": {"c": c.clone()}} for _ in range(2)], ParallelLayout(dp=2))
    drifted = c.clone()
    drifted.view(torch.int32).add_(1)
    with pytest.raises(ReplicaMismatch, match=r"'model\.c'"):
        _save(tmp_path / "drift", [{"model": {"c": c}}, {"model": {"c": drifted}}], ParallelLayout(dp=2))
    # packed float4 (two values a byte, one element each) is sampled by its bytes: a replicated one saved only with
    # 16 elements or fewer (hunt71d: 40x40 failed "cannot sample", take has no kernel), and a drift is still caught
    q = torch.randint(0, 256, (40, 40), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    for i, view in enumerate((q, q.t(), q[:, 3:30])):
        _save(
            tmp_path / f"q{i}",
            [{"model": {"q": view.clone(), "w": torch.ones(3)}} for _ in range(2)],
            ParallelLayout(dp=2),
        )
    assert value_digests([q.t()]) == value_digests([q.t().contiguous()])
    drifted = q.clone()
    drifted.view(torch.uint8)[39, 39] ^= 0x11  # the last element, one of the sampled ones
    with pytest.raises(ReplicaMismatch, match=r"'model\.q'"):
        _save(tmp_path / "qd", [{"model": {"q": q}}, {"model": {"q": drifted}}], ParallelLayout(dp=2))
    # replicas differing only by a zero's sign (-0.0 is +0.0, per nibble: 0x8 a negative zero) are equal values
    # (rev71d L4: refused as drift), sampled (the last element) or small (every element); another nibble still counts
    for n in (1600, 8):
        pos = torch.randint(0, 256, (n,), dtype=torch.uint8)
        pos[-3:] = torch.tensor([0x00, 0x30, 0x03], dtype=torch.uint8)
        neg = pos.clone()
        neg[-3:] = torch.tensor([0x88, 0x38, 0x83], dtype=torch.uint8)
        a, b = pos.view(torch.float4_e2m1fn_x2), neg.view(torch.float4_e2m1fn_x2)
        _save(tmp_path / f"z{n}", [{"model": {"q": a}}, {"model": {"q": b}}], ParallelLayout(dp=2))
        neg[-1] = 0x13
        assert value_digests([a]) != value_digests([b]), n
    # a quantized one is refused before the check (its scale would not be saved: tests/test_planner_inputs.py)
    q = torch.quantize_per_tensor(torch.randn(40, 40), 0.1, 0, torch.quint8)
    with pytest.raises(SpecError, match=r"model\.q: a quantized tensor \(torch\.quint8"):
        _save(tmp_path / "q", [{"model": {"q": q.clone(), "w": torch.ones(3)}} for _ in range(2)], ParallelLayout(dp=2))


def test_a_rank_local_key_several_ranks_hold_is_refused_not_dropped(tmp_path: Path) -> None:
    """The global plan keeps one writer per chunk: a rank-local key two ranks hold lost one rank's value
    silently (its RNG state, say); refused naming the key. ``rank_local`` as one string became the globs
    of its characters ('*' among them: every key rank-local, the replica check skipped); refused."""
    sds = [{"model": {"w": torch.ones(3)}, "rng": torch.tensor([r])} for r in range(2)]
    with pytest.raises(ReplicaMismatch, match=r"rng: ranks \[0, 1\] each hold it as rank-local"):
        _save(tmp_path / "rl", sds, ParallelLayout(dp=2), rank_local=["rng"])
    unique = [{"model": {"w": torch.ones(3)}, f"rng{r}": torch.tensor([r])} for r in range(2)]
    metadata = _save(tmp_path / "ok", unique, ParallelLayout(dp=2), rank_local=["rng*"])
    assert {"rng0", "rng1"} <= set(metadata.state_dict_metadata)
    with pytest.raises(TypeError, match=r"rank_local must be a list of globs, not a single string"):
        ParallelSavePlanner(ParallelLayout(dp=2), rank_local="rng*")


def test_keys_split_over_dp_that_two_stages_hold_are_compared_by_piece(tmp_path: Path) -> None:
    """A key split over DP (alone or with TP) that two pipeline stages hold under one global key (a
    stage-local name saved without a name map) lost one stage's values silently: a piece split over both
    has no replica in its stage, and comparing the stages' first ranks misses a ZeRO-style key whose DP
    rank 0 piece is empty. Pieces are compared where two stages hold the same one. The legitimate twin
    -- a tied tensor's sharded optimizer state, equal on both stages, even placed on different DP ranks
    per stage -- still saves, its one copy bit-exact."""
    layout = ParallelLayout(tp=2, dp=2, pp=2, pp_layers=(1, 1))
    base = torch.arange(32.0).reshape(8, 4)

    def sd(rank: int, full: torch.Tensor, owner: int | None) -> dict[str, Any]:
        """``owner``: the DP rank holding the whole TP piece (ZeRO-style); ``None``: split evenly over DP."""
        c = layout.coords(rank)
        tp_piece = full.chunk(2)[c.tp]
        m = tp_piece.chunk(2)[c.dp] if owner is None else tp_piece if c.dp == owner else tp_piece[:0]
        return {"model": {"layers.0.w": torch.ones(2) * c.pp}, "optim": {"state": {"m": m.clone()}}}

    def planners(owners: dict[int, int | None]) -> list[ParallelSavePlanner]:
        out = []
        for r in range(8):
            owner = owners[layout.coords(r).pp]
            dp = ShardSpec(0, axis="dp", sizes=None if owner is None else ((4, 0) if owner == 0 else (0, 4)))
            out.append(ParallelSavePlanner(layout, {"optim.state.m": (ShardSpec(0), dp)}, rank=r))
        return out

    def save(name: str, owners: dict[int, int | None], differ: bool) -> Any:
        sds = [
            sd(r, base + (100 * layout.coords(r).pp if differ else 0), owners[layout.coords(r).pp]) for r in range(8)
        ]
        return sim_save(sds, planners(owners), [FsspecStorageWriter(str(tmp_path / name)) for _ in range(8)])

    stage_key = r"pipeline stages 0 and 1 \(ranks \d and \d\) both hold 'optim\.state\.m' piece at offsets"
    with pytest.raises(ReplicaMismatch, match=stage_key):
        save("even", {0: None, 1: None}, differ=True)
    with pytest.raises(ReplicaMismatch, match=stage_key):  # DP rank 0's pieces are empty on both stages
        save("zero", {0: 1, 1: 1}, differ=True)
    for name, owners in (("tied", {0: None, 1: None}), ("moved", {0: 1, 1: 0})):
        metadata = save(name, owners, differ=False)
        assert len(metadata.state_dict_metadata["optim.state.m"].chunks) == (4 if owners[0] is None else 2)
        loaded = {
            "model": {"layers.0.w": torch.zeros(2), "layers.1.w": torch.zeros(2)},
            "optim": {"state": {"m": torch.zeros(8, 4)}},
        }
        sim_load([loaded], [ParallelLoadPlanner(ParallelLayout(), rank=0)], [FsspecStorageReader(str(tmp_path / name))])
        assert torch.equal(loaded["optim"]["state"]["m"], base)


def test_keys_split_over_tp_that_two_stages_hold_are_compared_by_piece(tmp_path: Path) -> None:
    """A shared embedding (the first and last stage both hold the vocab-parallel embedding under one key, as
    Megatron ties it) differing between the stages on one TP rank only: the stages' first ranks (TP rank 0)
    agreed, so the last stage's other piece was dropped in silence (hunt62a); compared by piece now."""
    layout = ParallelLayout(tp=2, dp=2, pp=2, pp_layers=(1, 1))
    base = torch.arange(44.0).reshape(11, 4)
    specs = {"model.embed": ShardSpec(0, sizes=(6, 5))}

    def save(name: str, differ: bool) -> Any:
        sds = []
        for r in range(8):
            c = layout.coords(r)
            piece = (base[:6] if c.tp == 0 else base[6:]) + (100 if differ and c.pp == 1 and c.tp == 1 else 0)
            sds.append({"model": {"layers.0.w": torch.ones(2) * c.pp, "embed": piece.clone()}})
        planners = [ParallelSavePlanner(layout, specs, rank=r) for r in range(8)]
        return sim_save(sds, planners, [FsspecStorageWriter(str(tmp_path / name)) for _ in range(8)])

    stage_key = r"pipeline stages 0 and 1 \(ranks 1 and 5\) both hold 'model\.embed' piece at offsets \(6, 0\)"
    stage_key += r".*or two copies of one shared tensor .* drifted apart \(their gradients not all-reduced\)"
    with pytest.raises(ReplicaMismatch, match=stage_key):
        save("differ", differ=True)
    save("same", differ=False)
    loaded = {"model": {"layers.0.w": torch.zeros(2), "layers.1.w": torch.zeros(2), "embed": torch.zeros(11, 4)}}
    sim_load([loaded], [ParallelLoadPlanner(ParallelLayout(), rank=0)], [FsspecStorageReader(str(tmp_path / "same"))])
    assert torch.equal(loaded["model"]["embed"], base)


def test_only_pieces_another_stage_may_hold_are_sent() -> None:
    """What the cross-stage piece check costs: a key the ``layers.<i>`` rule renumbers is its stage's own
    (not sent, stage 0's unchanged names included), a key split over DP alone is sent by TP rank 0 only,
    one split over TP alone by DP rank 0 only (rev62e R4), and empty pieces never."""
    layout = ParallelLayout(tp=2, dp=2, pp=2, pp_layers=(1, 1))
    specs = {
        "*.both": (ShardSpec(0), ShardSpec(0, axis="dp")),
        "*.dp_only": ShardSpec(0, axis="dp"),
        "*.empty_on_dp0": (ShardSpec(0), ShardSpec(0, axis="dp", sizes=(0, 4))),
        "*.tp_only": ShardSpec(0),
    }

    def sd(rank: int) -> dict[str, Any]:
        c = layout.coords(rank)
        return {
            "layers.0.both": torch.ones(2, 2),
            "embed.both": torch.ones(2, 2),
            "embed.dp_only": torch.ones(4, 2),
            "embed.empty_on_dp0": torch.ones(0 if c.dp == 0 else 4, 2),
            "embed.tp_only": torch.ones(2, 2),
        }

    plans = _local_plans(layout, [sd(r) for r in range(8)], specs)
    sent = [len(p.planner_data["stage_values"] or b"") // 12 for p in plans]
    # rank (tp, dp): embed.both always; embed.dp_only on tp 0; embed.tp_only on dp 0; embed.empty_on_dp0 on dp 1
    assert sent == [3, 2, 3, 2] * 2


def test_a_replicated_zero_tensor_is_sampled_as_zeros(tmp_path: Path) -> None:
    """A ZeroTensor (``torch._efficientzerotensor``: no memory, data pointer 0) failed the save with the
    check on (numpy's "data is NULL"); it digests as the zeros it stands for, and a drift is still seen.
    Two of them are not one tied tensor (both at address 0)."""
    zero = torch._efficientzerotensor((300, 7))
    assert value_digests([zero, torch.ones(3)]) == value_digests([torch.zeros(300, 7), torch.ones(3)])
    _save(tmp_path / "same", [{"model": {"z": zero}}, {"model": {"z": torch.zeros(300, 7)}}], ParallelLayout(dp=2))
    zeros = {"model": {"a": torch._efficientzerotensor((3, 3)), "b": torch._efficientzerotensor((3, 3))}}
    planner = ParallelSavePlanner(ParallelLayout(), rank=0)
    planner.set_up_planner(zeros, None, True)
    assert planner.tied == {}
    # a rank holding ZeroTensors and one holding zeros agree (they did not: the ZeroTensors looked tied)
    _save(tmp_path / "two", [zeros, {"model": {"a": torch.zeros(3, 3), "b": torch.zeros(3, 3)}}], ParallelLayout(dp=2))
    with pytest.raises(ReplicaMismatch, match=r"'model\.z'"):
        _save(tmp_path / "drift", [{"model": {"z": zero}}, {"model": {"z": torch.ones(300, 7)}}], ParallelLayout(dp=2))


def test_replica_differences_name_keys_per_stage_with_at_most_eight_ranks() -> None:
    """rev62b F3: the refusal of a diverging replica listed every rank of a view (a 512-rank job printed lists
    of 512); ranks holding equal key lists share one list (each distinct list crosses the wire once)."""
    from smpckpt.planners._replica_values import replica_differences

    good, bad = {"a": "torch.float32 (4,)", "b": "torch.float32 (2,)"}, {"a": "torch.float64 (4,)"}
    said = replica_differences(ParallelLayout(dp=12), [good] * 11 + [bad])
    assert said == (
        "Differing: 'a': torch.float32 (4,) on ranks [0, 1, 2, 3, 4, 5, 6, 7] (and 3 more), torch.float64 (4,) "
        "on ranks [11]; 'b': torch.float32 (2,) on ranks [0, 1, 2, 3, 4, 5, 6, 7] (and 3 more), absent on "
        "ranks [11]."
    ), said
    assert replica_differences(ParallelLayout(dp=12), [good] * 12) == ""
    # pp=2 (ranks 0-1 stage 0): the stages' lists differ (other keys), no divergence; rank 3 diverges
    later = {"c": "torch.float32 (3,)"}
    said = replica_differences(ParallelLayout(dp=2, pp=2), [good, good, later, dict(later, c="torch.int8 (3,)")])
    assert "'c'" in said and "'a'" not in said, said

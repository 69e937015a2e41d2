"""Property test: any layout reloads into any other through the real storage writer and reader, bit-exact,
for the dtypes the planners' property test leaves out (fp8, bool, complex, 1- and 2-byte integers) and
non-contiguous (permuted) source and destination tensors. ``tests/test_reshard_property.py`` runs the
planners over an in-memory store; here the raw (and ``torch_save``) records, their block checksums,
in-place fills and strided reads take part too (hunt70e: a differential run of over 1,000 such worlds found
nothing; this keeps a few of them in CI)."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sim import reset_dcp_caches, sim_load, sim_save
from world_gen import (
    Model,
    assert_ranks_equal,
    draw_partition,
    global_keys,
    layouts,
    models,
    rank_state,
    specs_for,
)

from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

CI = settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
ODD_DTYPES = (torch.float8_e4m3fn, torch.bool, torch.complex64, torch.uint8, torch.int16, torch.float16, torch.float64)


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random values using every bit pattern a byte-sized float can hold (NaNs included: compared as bytes)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype)
    if dtype.is_floating_point and dtype.itemsize == 1:
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(0, 100, shape, generator=gen).to(dtype)


def _values(model: Model) -> dict[str, torch.Tensor]:
    """As world_gen.global_values: each tensor, its exp_avg (same dtype) and a 0-d step."""
    gen = torch.Generator().manual_seed(model.seed)
    values: dict[str, torch.Tensor] = {}
    for key, d in global_keys(model):
        values[key] = _random(d.shape, d.dtype, gen)
        values[key + ".exp_avg"] = _random(d.shape, d.dtype, gen)
        values[key + ".step"] = torch.tensor(float(len(values)))
    return values


def _permuted(t: torch.Tensor, rnd: random.Random, fill: bool) -> torch.Tensor:
    """``t``'s values (or a sentinel: ``fill``) in a tensor whose memory holds the dims in a random order."""
    perm = list(range(t.dim()))
    rnd.shuffle(perm)
    out = torch.empty([t.shape[p] for p in perm], dtype=t.dtype).permute([perm.index(i) for i in range(t.dim())])
    if not fill:
        return out.copy_(t)
    return out.copy_(~t if t.dtype == torch.bool else torch.full(t.shape, 3).to(t.dtype))


def _odd(sd: Any, rnd: random.Random, fill: bool) -> Any:
    if isinstance(sd, dict):
        return {k: _odd(v, rnd, fill) for k, v in sd.items()}
    return _permuted(sd, rnd, fill) if isinstance(sd, torch.Tensor) else sd


@CI
@given(st.data())
def test_odd_dtypes_and_strides_reshard_through_the_storage_bit_exact(
    tmp_path_factory: Any, data: st.DataObject
) -> None:
    reset_dcp_caches()
    drawn = data.draw(models(), label="model")
    defs = tuple(dataclasses.replace(d, dtype=data.draw(st.sampled_from(ODD_DTYPES))) for d in drawn.defs)
    model = dataclasses.replace(drawn, defs=defs)
    values = _values(model)
    save_layout = data.draw(layouts(model.layers, 8), label="save")
    load_layout = data.draw(layouts(model.layers, 8), label="load")
    save_parts = draw_partition(model, save_layout, data.draw)
    load_parts = draw_partition(model, load_layout, data.draw)
    fmt = data.draw(st.sampled_from(["raw", "torch_save"]), label="format")
    rnd = random.Random(data.draw(st.integers(0, 1000), label="strides"))
    folder = str(tmp_path_factory.mktemp("odd") / "ck")

    sds = [
        _odd(rank_state(model, values, save_layout, r, save_parts), rnd, False) for r in range(save_layout.world_size)
    ]
    specs = specs_for(model, save_parts)
    sim_save(
        sds,
        [ParallelSavePlanner(save_layout, specs, rank=r) for r in range(save_layout.world_size)],
        [FsspecStorageWriter(folder, format=fmt, sync_files=False) for _ in sds],
    )
    world = load_layout.world_size
    dests = [_odd(rank_state(model, values, load_layout, r, load_parts), rnd, True) for r in range(world)]
    load_specs = specs_for(model, load_parts)
    sim_load(
        dests,
        [ParallelLoadPlanner(load_layout, load_specs, rank=r) for r in range(world)],
        [FsspecStorageReader(folder) for _ in range(world)],
    )
    assert_ranks_equal(model, values, load_layout, load_parts, dests)

"""Property tests of full (consolidated) artifacts in a simulated world (tier 1).

A random model is saved as one safetensors artifact under a random layout A (sometimes cut into
several ``model-0000i-of-0000N`` files), then

* the artifact, read with the stock ``safetensors`` reader, holds every global tensor full-size under
  its flattened global key (fused tensors in their original ``[3h, d]`` shape), bit-exact;
* the reader loads it into a random layout B, every rank bit-exact (non-tensor values included);
* under the same layout, each rank reads exactly the bytes it needs from the tensor files.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from sim import reset_dcp_caches, sim_load, sim_save
from world_gen import (
    Model,
    TensorDef,
    assert_ranks_equal,
    draw_partition,
    flat_tensors,
    global_keys,
    global_values,
    layouts,
    models,
    rank_state,
    specs_for,
)

from smpckpt import LayoutMismatch, ParallelLayout
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner
from smpckpt.storage import FsspecStorageReader, FullArtifactWriter, FullOptions
from smpckpt.storage.format._columns import REQUEST_COST_BYTES

CI = settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

MANIFEST = "smpckpt.manifest.json"
MARKER = "smpckpt.writing"
#: key prefix -> artifact routings the tests draw from (the default, the API's, a nested longest-prefix one)
ROUTINGS: tuple[dict[str, str], ...] = (
    {"": "model"},
    {"model.": "model", "optim.state.": "optimizer"},
    {"": "all", "optim.state.": "opt", "optim.state.layers.": "optlayers"},
)
NON_TENSOR = {"extra.lr": 0.25, "extra.name": "gpt"}


# -- the oracle: which artifact key holds which global value ------------------------------------------
def state_key(value_key: str) -> str:
    """The flattened global state-dict key of a :func:`global_values` key.

    ``model.X`` is a parameter; its optimizer state ``model.X.exp_avg``/``model.X.step`` lives under
    ``optim.state.X.exp_avg``/``optim.state.X.step`` in the state dict."""
    for suffix in (".exp_avg", ".step"):
        if value_key.endswith(suffix):
            return "optim.state." + value_key[len("model.") :]
    return value_key


def route(key: str, artifacts: Mapping[str, str]) -> tuple[str, str]:
    """(artifact stem, key inside it): the longest matching prefix, stripped."""
    prefix = max((p for p in artifacts if key.startswith(p)), key=len)
    return artifacts[prefix], key[len(prefix) :]


def expected_artifacts(
    model: Model, values: Mapping[str, torch.Tensor], artifacts: Mapping[str, str], dtype: torch.dtype | None = None
) -> dict[str, dict[str, torch.Tensor]]:
    """artifact stem -> {key: tensor} as the artifact must hold them (fused: the original [3h, d] shape)."""
    defs = {k: d for k, d in global_keys(model)}
    out: dict[str, dict[str, torch.Tensor]] = {}
    for vkey, value in values.items():
        base = vkey.removesuffix(".exp_avg").removesuffix(".step")
        d: TensorDef = defs[base]
        want = value
        if d.kind == "fused" and not vkey.endswith(".step"):
            want = value.reshape(d.shape[0] * d.shape[1], d.shape[2])
        if dtype is not None and want.dtype.is_floating_point and want.dim() > 0:
            want = want.to(dtype)  # scalars (step counters) are kept: a narrow float rounds them
        art, key = route(state_key(vkey), artifacts)
        assert key not in out.setdefault(art, {}), key
        out[art][key] = want
    return out


def read_artifact(folder: str, stem: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Every tensor of one artifact read with the stock safetensors reader (through its index when
    sharded), and the artifact's safetensors file names."""
    index_path = os.path.join(folder, f"{stem}.safetensors.index.json")
    single = os.path.join(folder, f"{stem}.safetensors")
    if not os.path.exists(index_path):
        return load_file(single), [f"{stem}.safetensors"]
    assert not os.path.exists(single), f"{stem}: both a single file and an index"
    with open(index_path) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n >= 2
    assert files == [f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    got: dict[str, torch.Tensor] = {}
    for name in files:
        part = load_file(os.path.join(folder, name))
        assert part, f"{name} holds no tensor"
        for key, t in part.items():
            assert key not in got, f"{key} in two files"
            assert index["weight_map"][key] == name, key
            got[key] = t
    assert set(got) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    return got, files


# -- worlds -------------------------------------------------------------------------------------------
def save_full(
    folder: str, model: Model, values: dict[str, torch.Tensor], layout: ParallelLayout, parts: Any, opts: FullOptions
) -> None:
    reset_dcp_caches()
    specs = specs_for(model, parts)
    world = layout.world_size
    sds = [rank_state(model, values, layout, r, parts) for r in range(world)]
    planners = [ParallelSavePlanner(layout, specs, rank=r) for r in range(world)]
    writers = [FullArtifactWriter(folder, full=opts, sync_files=False) for _ in range(world)]
    sim_save(sds, planners, writers)


def load_full(
    folder: str,
    model: Model,
    values: dict[str, torch.Tensor],
    layout: ParallelLayout,
    parts: Any,
    request_cost_bytes: int = REQUEST_COST_BYTES,
    **planner_kw: Any,
) -> tuple[list[dict[str, Any]], list[FsspecStorageReader]]:
    """Every rank of ``layout`` loads ``folder``; ``request_cost_bytes=0`` reads column shards a request
    per row (exactly their bytes) instead of streaming rows close together."""
    reset_dcp_caches()
    specs = specs_for(model, parts)
    world = layout.world_size
    blanks = [rank_state(model, values, layout, r, parts, blank=True) for r in range(world)]
    planners = [ParallelLoadPlanner(layout, specs, rank=r, **planner_kw) for r in range(world)]
    readers = [FsspecStorageReader(folder, request_cost_bytes=request_cost_bytes) for _ in range(world)]
    sim_load(blanks, planners, readers)
    return blanks, readers


def tensor_bytes(sd: Mapping[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in flat_tensors(sd).values() if isinstance(v, torch.Tensor))


# -- properties ---------------------------------------------------------------------------------------
@CI
@given(st.data())
def test_full_artifact_is_the_global_model_and_loads_into_any_layout(data: st.DataObject) -> None:
    model = data.draw(models(), label="model")
    values = global_values(model)
    save_layout = data.draw(layouts(model.layers, 16), label="save layout")
    save_parts = draw_partition(model, save_layout, data.draw)
    artifacts = data.draw(st.sampled_from(ROUTINGS), label="artifacts")
    max_shard = data.draw(st.sampled_from(["5GB", 1, 200, 700, 2000]), label="max_shard_size")
    check_block = data.draw(st.sampled_from([4096, 1 << 20]), label="check_block")
    same = data.draw(st.booleans(), label="load under the save layout")
    if same:
        load_layout, load_parts = save_layout, save_parts
    else:
        load_layout = data.draw(layouts(model.layers, 16), label="load layout")
        load_parts = draw_partition(model, load_layout, data.draw)
    opts = FullOptions(max_shard_size=max_shard, artifacts=artifacts, check_block=check_block)

    with tempfile.TemporaryDirectory(prefix="smpckpt-full-prop-") as tmp:
        folder = os.path.join(tmp, "full")
        save_full(folder, model, values, save_layout, save_parts, opts)

        # (a) the artifact, read by the stock safetensors reader, is the global model
        names = set(os.listdir(folder))
        assert MANIFEST in names and MARKER not in names
        with open(os.path.join(folder, MANIFEST)) as f:
            manifest = json.load(f)
        assert manifest["kind"] == "full"
        expected = expected_artifacts(model, values, artifacts)
        tensor_files: list[str] = []
        for stem, want in expected.items():
            got, files = read_artifact(folder, stem)
            tensor_files += files
            assert set(got) == set(want), stem
            for key, w in want.items():
                g = got[key]
                assert g.dtype == w.dtype, (stem, key, g.dtype, w.dtype)
                assert g.shape == w.shape, (stem, key, g.shape, w.shape)
                assert torch.equal(g, w), (stem, key)
            if len(files) > 1:  # cut at max_shard_size: a file holds more than the limit only with one tensor
                limit = 5 * 10**9 if max_shard == "5GB" else max_shard
                for name in files:
                    part = load_file(os.path.join(folder, name))
                    size = sum(t.numel() * t.element_size() for t in part.values())
                    assert size <= limit or len(part) == 1, (name, size, limit)
        event(f"{len(tensor_files)} tensor file(s)")
        event("same layout" if same else "other layout")
        # no stray tensor files, and every file of the folder is listed in the manifest
        assert {n for n in names if n.endswith(".safetensors")} == set(tensor_files)
        listed = {rec["name"] for rec in manifest["files"]}
        assert names - {MANIFEST, manifest["metadata"]["name"]} == listed
        for key, value in NON_TENSOR.items():
            with open(os.path.join(folder, f"{key}.pt"), "rb") as f:
                assert torch.load(f, weights_only=True) == value

        # (b) any layout B, bit-exact on every rank
        # at the save layout a request per row (request_cost_bytes=0), so (c) below can say no byte beyond
        # the shards is read; at another layout the cost model's default (short rows stream)
        loaded, readers = load_full(folder, model, values, load_layout, load_parts, 0 if same else REQUEST_COST_BYTES)
        assert_ranks_equal(model, values, load_layout, load_parts, loaded)

        # each rank asked the tensor files for exactly its own tensors' bytes
        for rank, reader in enumerate(readers):
            stats = reader.last_read_stats
            assert stats is not None
            per_tensor_file = {n: v for n, v in stats.per_file.items() if n.endswith(".safetensors")}
            assert set(per_tensor_file) <= set(tensor_files)
            needed = sum(n for n, _ in per_tensor_file.values())
            assert needed == tensor_bytes(loaded[rank]), rank
            for name, (need, read) in per_tensor_file.items():
                assert read >= need, (rank, name)
                # (c) the save layout reads no byte beyond what it needs
                if same:
                    assert read == need, (rank, name, need, read)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_cast_on_export_keeps_integers(tmp_path: Any, dtype: torch.dtype) -> None:
    model = Model(
        (
            TensorDef("qkv", (3, 4, 6), torch.float32, "fused", dim=1),
            TensorDef("w", (8, 6), torch.float32, "tp", dim=1),
            TensorDef("ids", (5, 3), torch.int64, "tp", dim=0, uneven=True),
            TensorDef("b", (8,), torch.bfloat16, "repl", where="first"),
        ),
        layers=2,
        seed=3,
    )
    values = global_values(model)
    layout = ParallelLayout(tp=2, pp=2, dp=1, pp_layers=(1, 1))
    parts = draw_partition(model, layout, None)
    folder = str(tmp_path / "cast")
    save_full(folder, model, values, layout, parts, FullOptions(dtype=dtype))

    got = load_file(os.path.join(folder, "model.safetensors"))
    want = expected_artifacts(model, values, {"": "model"}, dtype=dtype)["model"]
    assert set(got) == set(want)
    for key, w in want.items():
        assert got[key].dtype == w.dtype and torch.equal(got[key], w), key
    assert got["model.layers.0.ids"].dtype == torch.int64
    assert got["model.layers.0.w"].dtype == dtype and got["optim.state.layers.1.qkv.step"].dtype == torch.float32
    # the exact bytes of the cast: torch's round-to-nearest-even, not a truncation
    assert torch.equal(got["model.layers.1.w"], values["model.layers.1.w"].to(dtype))

    # the stored dtype is the artifact's: loading it into fp32 tensors needs allow_dtype_cast
    with pytest.raises(
        LayoutMismatch, match=r"saved as torch\.(bfloat16|float16) but the destination is torch\.float32"
    ):
        load_full(folder, model, values, ParallelLayout(tp=4), draw_partition(model, ParallelLayout(tp=4), None))
    load_layout = ParallelLayout(tp=3, dp=2)
    load_parts = draw_partition(model, load_layout, None)
    loaded, _ = load_full(folder, model, values, load_layout, load_parts, allow_dtype_cast=True)
    rounded = {k: v.to(dtype).to(v.dtype) if v.dtype.is_floating_point else v for k, v in values.items()}
    assert_ranks_equal(model, rounded, load_layout, load_parts, loaded)
    # the cast really happened (a value that does not survive the round trip exists)
    assert any(not torch.equal(rounded[k], values[k]) for k in values if values[k].dtype == torch.float32)


def test_shard_files_respect_max_shard_size(tmp_path: Any) -> None:
    """Nine tensors (six of 4 KiB, three scalars) under a 9000-byte limit: at least four files, none over it."""
    model = Model((TensorDef("w", (32, 32), torch.float32, "tp", dim=0),), layers=3, seed=1)
    values = global_values(model)
    layout = ParallelLayout(tp=2, dp=2)
    parts = draw_partition(model, layout, None)
    folder = str(tmp_path / "sharded")
    save_full(folder, model, values, layout, parts, FullOptions(max_shard_size=9000))
    assert not os.path.exists(os.path.join(folder, "model.safetensors"))
    got, files = read_artifact(folder, "model")
    n_bytes = sum(v.numel() * v.element_size() for v in values.values())
    assert len(files) >= math.ceil(n_bytes / 9000)
    for name in files:
        part = load_file(os.path.join(folder, name))
        assert sum(t.numel() * t.element_size() for t in part.values()) <= 9000, name
    want = expected_artifacts(model, values, {"": "model"})["model"]
    assert set(got) == set(want)
    for key, w in want.items():
        assert torch.equal(got[key], w), key


def _fused_artifact_shape(tmp: Any, shape: tuple[int, int, int], tp: int) -> tuple[int, ...]:
    model = Model((TensorDef("qkv", shape, torch.float32, "fused", dim=1),), layers=1, seed=0)
    values = global_values(model)
    layout = ParallelLayout(tp=tp)
    folder = os.path.join(str(tmp), "fused")
    save_full(folder, model, values, layout, draw_partition(model, layout, None), FullOptions())
    got = load_file(os.path.join(folder, "model.safetensors"))["model.layers.0.qkv"]
    assert torch.equal(got.reshape(shape), values["model.layers.0.qkv"])  # the bytes are right either way
    return tuple(got.shape)


@pytest.mark.parametrize(("shape", "tp"), [((3, 4, 2), 2), ((3, 6, 5), 3), ((3, 1, 4), 1)])
def test_fused_tensor_is_stored_in_its_original_shape(tmp_path: Any, shape: tuple[int, int, int], tp: int) -> None:
    assert _fused_artifact_shape(tmp_path, shape, tp) == (shape[0] * shape[1], shape[2])


@pytest.mark.parametrize(("shape", "tp"), [((3, 2, 4), 2), ((3, 4, 4), 4)])
def test_fused_original_shape_with_one_row_per_rank(tmp_path: Any, shape: tuple[int, int, int], tp: int) -> None:
    assert _fused_artifact_shape(tmp_path, shape, tp) == (shape[0] * shape[1], shape[2])


def test_fused_original_shape_with_unit_last_dim(tmp_path: Any) -> None:
    assert _fused_artifact_shape(tmp_path, (3, 4, 1), 2) == (12, 1)


# -- plain Hugging Face folders -------------------------------------------------------------------------
def _write_hf_folder(folder: str, tensors: dict[str, torch.Tensor], groups: int) -> list[str]:
    """A folder as ``save_pretrained`` writes it: one ``model.safetensors``, or an index and shards."""
    os.makedirs(folder)
    keys = list(tensors)
    if groups <= 1:
        save_file(tensors, os.path.join(folder, "model.safetensors"))
        return ["model.safetensors"]
    n = min(groups, len(keys))
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {k: names[i % n] for i, k in enumerate(keys)}
    for name in names:
        save_file({k: tensors[k] for k in keys if weight_map[k] == name}, os.path.join(folder, name))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return names


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_huggingface_folder_loads_into_any_layout_reading_only_own_bytes(data: st.DataObject) -> None:
    model = data.draw(models(), label="model")
    # a plain folder has no view information: fused tensors are plain 3-D TP tensors here
    model = dataclasses.replace(
        model, defs=tuple(dataclasses.replace(d, kind="tp") if d.kind == "fused" else d for d in model.defs)
    )
    values = global_values(model)
    params = {k.removeprefix("model."): values[k].contiguous() for k, _ in global_keys(model)}
    layout = data.draw(layouts(model.layers, 16), label="layout")
    parts = draw_partition(model, layout, data.draw)
    groups = data.draw(st.integers(1, 4), label="files")
    specs = specs_for(model, parts)
    with tempfile.TemporaryDirectory(prefix="smpckpt-hf-prop-") as tmp:
        folder = os.path.join(tmp, "hf")
        files = _write_hf_folder(folder, params, groups)
        reset_dcp_caches()
        world = layout.world_size
        blanks = [{"model": rank_state(model, values, layout, r, parts, blank=True)["model"]} for r in range(world)]
        planners = [ParallelLoadPlanner(layout, specs, rank=r) for r in range(world)]
        # a request per row (request_cost_bytes=0): short column rows would stream, gaps included
        readers = [FsspecStorageReader(folder, hf_prefix="model.", request_cost_bytes=0) for _ in range(world)]
        sim_load(blanks, planners, readers)
        for rank in range(world):
            want = rank_state(model, values, layout, rank, parts)["model"]
            got = blanks[rank]["model"]
            assert want.keys() == got.keys()
            for key, w in want.items():
                assert got[key].dtype == w.dtype and torch.equal(got[key], w), (rank, key)
            reader = readers[rank]
            assert reader.state == "huggingface"
            stats = reader.last_read_stats
            assert stats is not None and set(stats.per_file) <= set(files)
            own = sum(v.numel() * v.element_size() for v in want.values())
            assert stats.bytes_needed == stats.bytes_read == own, rank  # unverified: exactly its own bytes


def test_artifact_without_its_manifest_loads_back_into_a_fused_layout(tmp_path: Any) -> None:
    model = Model((TensorDef("qkv", (3, 4, 6), torch.float32, "fused", dim=1),), layers=2, seed=5)
    values = global_values(model)
    layout = ParallelLayout(tp=2)
    parts = draw_partition(model, layout, None)
    folder = str(tmp_path / "full")
    save_full(folder, model, values, layout, parts, FullOptions(artifacts={"model.": "model", "optim.": "optim"}))
    plain = tmp_path / "plain"  # what a user copies to the Hub: the weights, not our manifest
    plain.mkdir()
    shutil.copy(os.path.join(folder, "model.safetensors"), plain / "model.safetensors")
    assert load_file(str(plain / "model.safetensors"))["layers.0.qkv"].shape == (12, 6)
    reset_dcp_caches()
    specs = specs_for(model, parts)
    blanks = [{"model": rank_state(model, values, layout, r, parts, blank=True)["model"]} for r in range(2)]
    planners = [ParallelLoadPlanner(layout, specs, rank=r) for r in range(2)]
    sim_load(blanks, planners, [FsspecStorageReader(str(plain), hf_prefix="model.") for _ in range(2)])
    for rank in range(2):
        want = rank_state(model, values, layout, rank, parts)["model"]
        for key, w in want.items():
            assert torch.equal(blanks[rank]["model"][key], w), (rank, key)

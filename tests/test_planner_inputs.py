"""Planner inputs refused by name in a simulated world: tensors that cannot be saved or loaded as they are (sparse,
quantized, nested, meta) and options that could mean two things (flags, glob lists, ranks)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
from planner_sim import load, save
from sim import reset_dcp_caches

from smpckpt import CheckpointNotFound, LayoutMismatch, ParallelLayout, SpecError
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner


def setup_function():
    reset_dcp_caches()


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_tensors_are_refused_naming_the_key(tmp_path):
    """Planners and our writer (under DCP's own planner) alike: a clear SpecError, not torch's internals."""
    for sparse in (torch.eye(4).to_sparse(), torch.eye(4).to_sparse_csr()):
        with pytest.raises(SpecError, match=rf"emb: a {sparse.layout} tensor \(shape \(4, 4\)\) cannot be saved"):
            save([{"emb": sparse, "b": torch.ones(4)}], ParallelLayout())
    store, _ = save([{"emb": torch.eye(4)}], ParallelLayout())
    with pytest.raises(SpecError, match=r"emb: a torch.sparse_coo tensor .*\.to_dense\(\)"):
        load([{"emb": torch.eye(4).to_sparse()}], ParallelLayout(), store)

    from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter

    with pytest.raises(
        BaseException, match=r"emb: a torch.sparse_coo tensor \(shape \(4, 4\)\) cannot be saved"
    ) as info:
        dcp.save({"emb": torch.eye(4).to_sparse()}, storage_writer=FsspecStorageWriter(tmp_path), no_dist=True)
    assert "SpecError" in str(info.value)
    with pytest.raises(CheckpointNotFound):  # nothing committed
        FsspecStorageReader(tmp_path).read_metadata()


def _quantized() -> dict[str, torch.Tensor]:
    values = torch.tensor([[1.0, 2.0, -3.0, 0.5], [0.25, -1.0, 0.0, 4.0]])
    scales, zero_points = torch.tensor([0.5, 0.25]), torch.zeros(2, dtype=torch.long)
    return {
        "per_tensor": torch.quantize_per_tensor(values, 0.5, 3, torch.qint8),
        "per_channel": torch.quantize_per_channel(values, scales, zero_points, 0, torch.quint8),
        "packed": torch.quantize_per_tensor(values, 0.5, 1, torch.quint4x2),
    }


_QUANTIZED = r"{}: a quantized tensor \({}, {}, shape \(2, 4\)\) cannot be saved or loaded: its scale and zero-point"


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.parametrize("key", ["per_tensor", "per_channel", "packed"])
def test_quantized_tensors_are_refused_naming_the_key(tmp_path, key):
    """hunt69a F1: only a quantized tensor's integers were saved, and a load copied them into the destination's
    own scale and zero-point (saved [1, 2, -3, 0.5] loaded as [1.4, 3.4, -6.6, 0.4]): refused by name, at the
    save, at the load (a quantized destination), and by our writer under DCP's own planner, as sparse ones are."""
    q = _quantized()[key]
    said = _QUANTIZED.format(key, re.escape(str(q.dtype)), q.qscheme())
    with pytest.raises(SpecError, match=said + r".*\.dequantize\(\)"):
        save([{key: q, "b": torch.ones(4)}], ParallelLayout())
    store, _ = save([{key: q.dequantize()}], ParallelLayout())
    with pytest.raises(SpecError, match=said):
        load([{key: _quantized()[key]}], ParallelLayout(), store)

    from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter

    with pytest.raises(BaseException, match=said) as info:
        dcp.save({key: q}, storage_writer=FsspecStorageWriter(tmp_path), no_dist=True)
    assert "SpecError" in str(info.value)
    with pytest.raises(CheckpointNotFound):  # nothing committed
        FsspecStorageReader(tmp_path).read_metadata()
    # our reader under DCP's own load planner (which checks no destination)
    dcp.save({key: q.dequantize()}, storage_writer=FsspecStorageWriter(tmp_path / "f"), no_dist=True)
    with pytest.raises(BaseException, match=said) as info:
        dcp.load({key: _quantized()[key]}, storage_reader=FsspecStorageReader(tmp_path / "f"), no_dist=True)
    assert "SpecError" in str(info.value)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("how", [{"allow_partial_load": True}, {"optional": ["extra.*"]}])
def test_a_destination_not_plain_the_checkpoint_lacks_is_missing_not_refused(how):
    """rev69f F3: a quantized or nested destination key the checkpoint does not hold is never read: a partial
    load (optional= too) skipped it before the not-plain refusal, then refused it; one it holds stays refused."""
    store, _ = save([{"w": torch.arange(4.0)}], ParallelLayout())
    quantized = torch.quantize_per_tensor(torch.ones(4), 0.5, 0, torch.qint8)
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    state = {"w": torch.zeros(4), "extra": {"q": quantized, "n": nested}}
    planner = load([state], ParallelLayout(), store, **how)[0]
    assert torch.equal(state["w"], torch.arange(4.0)) and torch.equal(
        state["extra"]["q"].int_repr(), torch.full((4,), 2, dtype=torch.int8)
    )
    assert planner.report is not None
    assert set(planner.report.missing_keys + planner.report.skipped_optional) == {"extra.q", "extra.n"}
    with pytest.raises(SpecError, match=r"w: a quantized tensor"):
        load([{"w": quantized}], ParallelLayout(), store, allow_partial_load=True)


def test_a_quantized_tensor_without_a_quantizer_is_refused_by_name():
    """rev69f F6: ``torch.empty(3, dtype=torch.qint8)`` has no quantizer: the refusal's ``qscheme()`` raised
    torch's internal assert instead of it."""
    with pytest.raises(SpecError, match=r"q: a quantized tensor \(torch\.qint8, shape \(3,\)\) cannot be saved"):
        save([{"q": torch.empty(3, dtype=torch.qint8)}], ParallelLayout())


@pytest.mark.filterwarnings("ignore:torch.quantize_per_channel")
def test_a_quantized_model_is_refused_by_key_and_its_state_in_user_content_resumes_exactly(tmp_path):
    """A converted quantized Conv2d (per-channel qint8 weight) resumed into a fresh one had other weights and
    outputs, silently; refused naming the key, and its state_dict() in user_content comes back exact."""
    import torch.ao.nn.quantized as nnq

    import smpckpt

    torch.manual_seed(0)
    src = nnq.Conv2d(2, 3, 3)
    scales, zero_points = torch.tensor([0.01, 0.02, 0.03]), torch.zeros(3, dtype=torch.long)
    src.set_weight_bias(torch.quantize_per_channel(torch.randn(3, 2, 3, 3), scales, zero_points, 0, torch.qint8), None)
    options = smpckpt.SaveOptions(save_rng=False)
    with pytest.raises(SpecError, match=r"model\.weight: a quantized tensor \(torch\.qint8, torch\.per_channel_affine"):
        smpckpt.save_checkpoint(str(tmp_path), "t", model=src, options=options)
    smpckpt.save_checkpoint(str(tmp_path), "u", user_content={"conv": src.state_dict()}, options=options)
    dst = nnq.Conv2d(2, 3, 3)
    dst.load_state_dict(smpckpt.resume_from_checkpoint(str(tmp_path), "u")["conv"])
    assert torch.equal(dst.weight().int_repr(), src.weight().int_repr())
    assert torch.equal(dst.weight().q_per_channel_scales(), scales)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_nested_tensors_are_refused_naming_the_key(layout):
    """hunt69a F5: a (strided) nested tensor failed in torch's words, naming no key."""
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=layout)
    said = rf"n: a nested tensor \({layout}\) cannot be saved or loaded.*\.unbind\(\)"
    with pytest.raises(SpecError, match=said):
        save([{"n": nested, "b": torch.ones(4)}], ParallelLayout())
    store, _ = save([{"n": torch.ones(5)}], ParallelLayout())
    with pytest.raises(SpecError, match=said):
        load([{"n": nested}], ParallelLayout(), store)


@pytest.mark.parametrize("how", ["ours", "full", "full under DCP's planner"])
def test_a_meta_tensor_reaching_a_writer_is_refused_naming_the_key(tmp_path, how):
    """Planners plan meta tensors (the planning benchmarks do); a writer given one failed in torch's words
    ("Cannot copy out of meta tensor"), naming no key (hunt69a F5)."""
    from smpckpt.storage import FsspecStorageWriter, FullArtifactWriter, FullOptions

    state = {"ok": torch.ones(2), "m": torch.empty(3, 2, device="meta")}
    if how == "ours":
        writer = FsspecStorageWriter(tmp_path)
    else:
        writer = FullArtifactWriter(str(tmp_path / "f"), full=FullOptions(format="torch_save"))
    planner = ParallelSavePlanner(ParallelLayout()) if how != "full under DCP's planner" else None
    with pytest.raises(BaseException, match=r"m: a meta tensor \(shape \(3, 2\), torch\.float32\) has no data") as info:
        dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
    assert "SpecError" in str(info.value)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_a_checkpoint_saved_with_quantized_tensors_still_loads_their_integers():
    """rev69f F2: tests/data/quantized_v0 (smpckpt 55b1992 stored a quantized tensor's integers under its
    quantized dtype) became unreadable once quantized tensors were refused: a destination of the matching
    integer dtype reads them bit-exact; a quantized or float destination is refused saying how."""
    import pathlib

    from smpckpt.storage import FsspecStorageReader

    folder = str(pathlib.Path(__file__).parent / "data" / "quantized_v0" / "t_partial")
    # make_quantized_conj_v0.py's buffers' int_repr()
    want = {"model.q8": [-3, 4, 7, 18], "model.qu8": [28, 42, 48, 70], "model.q32": [-13, -6, -3, 8]}
    state = {
        "model.q8": torch.zeros(4, dtype=torch.int8),
        "model.qu8": torch.zeros(4, dtype=torch.uint8),
        "model.q32": torch.zeros(4, dtype=torch.int32),
    }
    planner = ParallelLoadPlanner(ParallelLayout(), allow_partial_load=True)
    dcp.load(state, storage_reader=FsspecStorageReader(folder), planner=planner, no_dist=True)
    for key, value in state.items():
        assert torch.equal(value, torch.tensor(want[key], dtype=value.dtype)), key
    said = r"model\.q8: the checkpoint holds a quantized tensor's integers \(torch\.qint8.*into a torch\.int8 tensor"
    for dest in (torch.zeros(4), torch.quantize_per_tensor(torch.zeros(4), 0.5, 3, torch.qint8)):
        planner = ParallelLoadPlanner(ParallelLayout(), allow_partial_load=True, allow_dtype_cast=True)
        with pytest.raises(BaseException, match=said):
            dcp.load({"model.q8": dest}, storage_reader=FsspecStorageReader(folder), planner=planner, no_dist=True)


@pytest.mark.parametrize(
    "planner, kw",
    [
        (ParallelLoadPlanner, {"allow_partial_load": "False"}),
        (ParallelLoadPlanner, {"allow_dtype_cast": "no"}),
        (ParallelLoadPlanner, {"allow_pickle": 0}),
        (ParallelLoadPlanner, {"optional": "rng.*"}),
        (ParallelLoadPlanner, {"optional": ["rng.*", 3]}),
        (ParallelLoadPlanner, {"keep_tied": "model.lm_head.weight"}),
        (ParallelSavePlanner, {"dedup_tied": "False"}),
        (ParallelSavePlanner, {"verify_replicas": None}),
        (ParallelSavePlanner, {"enable_plan_caching": "off"}),
        (ParallelSavePlanner, {"rank": True}),
        (ParallelLoadPlanner, {"rank": 1.0}),
    ],
)
def test_a_planner_option_that_could_mean_two_things_is_refused_by_name(planner, kw):
    # hunt73c F1/F2 (older): a truthy string took the unsafe reading silently -- allow_partial_load="False" made
    # every key optional, and one string of optional= globs was a glob per character, its '*' matching every key
    with pytest.raises(TypeError, match=next(iter(kw))):
        planner(ParallelLayout(), **kw)


@pytest.mark.parametrize("name", ["rank_local", "held_by_some"])
@pytest.mark.parametrize("planner", [ParallelSavePlanner, ParallelLoadPlanner])
@pytest.mark.parametrize("globs", [[1], ["rng.*", None], 7])
def test_glob_options_holding_a_non_string_are_refused_by_name(planner, name, globs):
    # rev73d 2: rank_local=[1] said "globs must be a list ..." and held_by_some=[1] "spec rule keys are glob
    # strings": neither named the option (rank_local=7: "'int' object is not iterable", no name at all)
    with pytest.raises(TypeError, match=rf"^{name} must be a list of key globs \(str\), got "):
        planner(ParallelLayout(), **{name: globs})


def test_a_strict_load_given_the_string_false_does_not_skip_a_missing_key():
    # before: both loads passed, 'b' (absent from the checkpoint) silently left at its old value
    store, _ = save([{"w": torch.ones(2)}], ParallelLayout())
    for kw in ({"allow_partial_load": "False"}, {"optional": "rng.*"}):  # meant: strict, rng.* alone optional
        with pytest.raises(TypeError, match=next(iter(kw))):
            load([{"w": torch.zeros(2), "b": torch.zeros(1)}], ParallelLayout(), store, **kw)
    dest = {"w": torch.zeros(2), "rng.x": torch.zeros(1)}
    load([dest], ParallelLayout(), store, optional=["rng.*"])
    assert torch.equal(dest["w"], torch.ones(2)) and torch.equal(dest["rng.x"], torch.zeros(1))
    with pytest.raises(LayoutMismatch, match="not in the checkpoint: b "):
        load([{"w": torch.zeros(2), "b": torch.zeros(1)}], ParallelLayout(), store, optional=("rng.*",))

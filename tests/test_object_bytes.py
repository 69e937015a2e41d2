"""Object values (an optimizer's hyper-parameters: 11 objects a parameter in torch's flattened format) are
torch.save'd once per distinct value and torch.load'ed once per distinct blob, bit-exactly, and stay what
stock DCP writes and reads (``dcp.load`` through ``FileSystemReader`` of our checkpoints, and back)."""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from smpckpt import SaveOptions, resume_from_checkpoint, save_checkpoint
from smpckpt.planners._entries import decode_object, encode_object
from smpckpt.tools.convert import convert_checkpoint

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
#: hyper-parameter values a round trip must keep bit for bit (type, sign of zero, NaN, big ints, nesting)
VALUES: list[Any] = [
    0.001,
    1,
    1.0,
    True,
    False,
    None,
    "adamw",
    (0.9, 0.999),
    -0.0,
    0.0,
    math.nan,
    -math.inf,
    2**70,
    1 + 2j,
    b"\x00\xff",
    [1, (2.5, None), "x"],
    {"a": [1, 2], 3: ("b", -0.0)},
    (),
]


def _same(a: Any, b: Any) -> bool:
    """Bit-exact: the same pickle (type, -0.0 vs 0.0, NaN payload, nesting)."""
    return pickle.dumps(a, 2) == pickle.dumps(b, 2)


def _torch_save(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def test_encoded_objects_are_torch_saves_bytes_and_decode_bit_exactly() -> None:
    saved: dict[bytes, bytes] = {}
    loaded: dict[bytes, Any] = {}
    for _ in range(2):  # the second round is served by both memos
        for value in VALUES:
            raw = encode_object(value, saved)
            assert raw == _torch_save(value), value  # what stock dcp.save writes
            assert _same(torch.load(io.BytesIO(raw), weights_only=True), value), value  # what stock dcp.load reads
            assert _same(decode_object(raw, loaded, weights_only=True), value), value
    # equal but different values never share bytes: 1, 1.0, True; 0.0 and -0.0
    assert len({encode_object(v, saved) for v in (1, 1.0, True, 0.0, -0.0)}) == 5
    # a mutable result is never shared between keys (a caller may change one)
    raw = encode_object([1, 2], saved)
    first, second = decode_object(raw, loaded, weights_only=True), decode_object(raw, loaded, weights_only=True)
    assert first == second and first is not second


def test_an_object_nested_deeper_than_the_walk_is_saved_unshared() -> None:
    """rev63h F5: a list nested 400 deep (torch.save takes it) failed the save with RecursionError."""
    deep: list[Any] = []
    for _ in range(400):
        deep = [deep]
    buf = io.BytesIO()
    torch.save(deep, buf)
    assert encode_object(deep, {}) == buf.getvalue()


def test_a_decode_memo_keeps_only_what_the_weights_only_load_accepted() -> None:
    """The memo is keyed by the exact bytes: refused bytes stay refused, however often they come."""

    class Evil:
        def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
            return (print, ("ran",))

    memo: dict[bytes, Any] = {}
    raw = _torch_save(Evil())
    for _ in range(2):
        with pytest.raises(pickle.UnpicklingError):
            decode_object(raw, memo, weights_only=True)
    assert memo == {}


class _Many(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.full((2,), float(i))) for i in range(n))


def _stepped(n: int, seed: int = 0) -> tuple[_Many, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = _Many(n)
    half = n // 2
    groups = [
        {"params": list(m.ps)[:half], "name": "first", "nested": {"k": [1, (2.0, None)]}, "neg": -0.0},
        {"params": list(m.ps)[half:], "lr": 0.5, "betas": (0.8, 0.9), "inf": -math.inf, "big": 2**70, "nan": math.nan},
    ]
    opt = torch.optim.Adam(groups)
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return m, opt


def _check_groups(got: torch.optim.Optimizer, want: torch.optim.Optimizer) -> None:
    for g, w in zip(got.param_groups, want.param_groups, strict=True):
        assert set(g) == set(w)
        for k in w:
            if k != "params":
                assert _same(g[k], w[k]), (k, g[k], w[k])


def _counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    calls = [0]
    real = getattr(torch, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, name, counted)
    return calls


def test_save_resume_and_convert_serialise_each_distinct_object_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """obj63: 40 parameters with Adam are 40 x 14 hyper-parameter objects (11 of Adam's + 3 of the groups'),
    ~20 distinct values: a torch.save and a torch.load each (two loads in convert) was ~200-500 us an object
    (4.5 of 9.9 s of a 30k-key save, 10.3 of 19.5 s of its resume). A NaN hyper-parameter resumes: the
    group check found 'nan' saved different from itself (LayoutMismatch)."""
    n = 40
    m, opt = _stepped(n)
    saves = _counting(monkeypatch, "save")
    save_checkpoint(str(tmp_path), "t", model=m, optimizer=opt, options=SaveOptions(save_rng=False))
    assert saves[0] < 4 * n, f"{saves[0]} torch.save calls for {n} parameters' objects"
    m2, opt2 = _stepped(n, seed=1)
    for g in opt2.param_groups:
        g["lr"] = 9.0
    loads = _counting(monkeypatch, "load")
    resume_from_checkpoint(str(tmp_path), "t", model=m2, optimizer=opt2)
    assert loads[0] < 4 * n, f"{loads[0]} torch.load calls for {n} parameters' objects"
    _check_groups(opt2, opt)
    for k, v in opt.state_dict()["state"].items():
        for name, t in v.items():
            assert torch.equal(opt2.state_dict()["state"][k][name], t), (k, name)
    loads[0] = 0
    convert_checkpoint(tmp_path / "t_partial", tmp_path / "full.pt")
    assert loads[0] < 4 * n, f"{loads[0]} torch.load calls converting {n} parameters' objects"
    flat = torch.load(tmp_path / "full.pt", weights_only=True)
    groups = opt.state_dict()["param_groups"]
    for i in range(n):
        for k, v in groups[0 if i < n // 2 else 1].items():
            if k != "params":
                assert _same(flat["optim"][f"param_groups.ps.{i}.{k}"], v), (i, k)
    nested = [flat["optim"][f"param_groups.ps.{i}.nested"] for i in (0, 1)]
    assert nested[0] is not nested[1]  # a mutable value is never shared between keys


def test_stock_dcp_reads_our_optimizer_objects_as_it_reads_its_own(tmp_path: Path) -> None:
    """Differential: the same optimizer state saved by stock dcp.save and by save_checkpoint (torch_save
    format) loads through stock dcp.load (FileSystemReader, DefaultLoadPlanner) to the same values, bit for
    bit, and into an optimizer equal to the saved one."""
    m, opt = _stepped(6)
    ours, stock = tmp_path / "ours", tmp_path / "stock"
    save_checkpoint(str(ours), "t", model=m, optimizer=opt, options=SaveOptions(format="torch_save", save_rng=False))
    dcp.save({"optim": get_optimizer_state_dict(m, opt, options=FLAT)}, storage_writer=FileSystemWriter(stock))
    loaded = []
    for path in (ours / "t_partial", stock):
        m2, opt2 = _stepped(6, seed=1)
        state = {"optim": get_optimizer_state_dict(m2, opt2, options=FLAT)}
        dcp.load(state, storage_reader=FileSystemReader(path), planner=DefaultLoadPlanner())
        set_optimizer_state_dict(m2, opt2, state["optim"], options=FLAT)
        _check_groups(opt2, opt)
        loaded.append(state["optim"])
    a, b = loaded
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else _same(a[k], b[k]), k
    # our checkpoint's object records are stock's, byte for byte: the planners wrote the same torch.save bytes
    ours_md, stock_md = FileSystemReader(ours / "t_partial").read_metadata(), FileSystemReader(stock).read_metadata()
    assert {k for k in stock_md.state_dict_metadata if ".param_groups." in k} <= set(ours_md.state_dict_metadata)


class Unsafe:
    """Unpickling it needs this class: weights-only loading refuses it."""

    def __init__(self, x: int) -> None:
        self.x = x


def test_unsafe_objects_repeated_are_refused_each_load_and_decoded_once_each_with_allow_pickle(tmp_path: Path) -> None:
    """The per-blob memos never pass bytes the weights-only check refused: a convert refuses them (naming the
    key) without allow_pickle; with it every key gets its own object (a mutable value is not shared)."""
    from sim import sim_save

    from smpckpt import ParallelLayout, UnsafeCheckpoint
    from smpckpt.planners import ParallelSavePlanner
    from smpckpt.storage import FsspecStorageWriter

    state = {"w": torch.arange(4.0), "hp": {"a": 0.5, "b": 0.5, "u": Unsafe(3), "v": Unsafe(3)}}
    with pytest.warns(UserWarning, match=r"2 saved objects .*allow_pickle.*hp\.u \(test_object_bytes\.Unsafe\), hp\.v"):
        sim_save([state], [ParallelSavePlanner(ParallelLayout())], [FsspecStorageWriter(str(tmp_path / "c"))])
    for _ in range(2):
        with pytest.raises(UnsafeCheckpoint, match=r"hp\.[uv]"):
            convert_checkpoint(tmp_path / "c", tmp_path / "out.pt", overwrite=True)
    convert_checkpoint(tmp_path / "c", tmp_path / "out.pt", allow_pickle=True, overwrite=True)
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    assert torch.equal(out["w"], state["w"]) and out["hp"]["a"] == out["hp"]["b"] == 0.5
    assert out["hp"]["u"].x == out["hp"]["v"].x == 3 and out["hp"]["u"] is not out["hp"]["v"]


class _ExtraState(nn.Linear):
    """A module whose extra state is a BytesIO (as TransformerEngine's older modules return): stock DCP stores it."""

    def get_extra_state(self) -> io.BytesIO:
        buf = io.BytesIO()
        torch.save({"amax": torch.full((3,), 5.0)}, buf)
        return buf

    def set_extra_state(self, state: Any) -> None:
        self.loaded = state


def test_a_save_names_the_objects_its_resume_loads_only_with_allow_pickle(tmp_path: Path) -> None:
    """An lr set from a numpy schedule (``np.float64``) and a BytesIO extra state are saved as stock DCP saves
    them, and a resume refuses them without ``allow_pickle`` (weights-only): the save says so, naming the keys,
    instead of the restart finding out. Plain values and a tensor lr (weights-only-safe) save without a word."""
    import warnings

    import numpy as np

    from smpckpt import ResumeOptions, UnsafeCheckpoint

    model = _ExtraState(2, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    opt.param_groups[0]["lr"] = np.linspace(0.1, 0.01, 4)[1]
    with pytest.warns(UserWarning, match="allow_pickle") as record:
        save_checkpoint(tmp_path, "odd", model=model, optimizer=opt)
    text = " ".join(str(w.message) for w in record)
    assert "model._extra_state" in text and "optim.param_groups.weight.lr" in text and "numpy.float64" in text
    fresh = _ExtraState(2, 2)
    with pytest.raises(UnsafeCheckpoint):
        resume_from_checkpoint(tmp_path, "odd", model=fresh, optimizer=torch.optim.Adam(fresh.parameters()))
    resume_from_checkpoint(tmp_path, "odd", model=fresh, options=ResumeOptions(allow_pickle=True, strict=False))
    fresh.loaded.seek(0)
    assert torch.equal(torch.load(fresh.loaded)["amax"], torch.full((3,), 5.0))
    plain = nn.Linear(2, 2)
    for lr in (0.05, torch.tensor(0.05)):
        opt = torch.optim.Adam(plain.parameters(), lr=lr)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            save_checkpoint(tmp_path, "plain", model=plain, optimizer=opt, options=SaveOptions(overwrite=True))


def test_an_object_bytes_record_loads_back_as_object_bytes_and_saves_again_as_it_is(tmp_path: Path) -> None:
    """rev68g F1: through the planners, an ``ObjectBytes`` record came back as plain ``bytes`` (fix68b, to
    spare a resume's user_content a copy): saved again it was pickled as an object (its record then decoded
    to ``bytes``), and a second load into the same state unpickled it."""
    from smpckpt import ParallelLayout
    from smpckpt.planners import ObjectBytes, ParallelLoadPlanner, ParallelSavePlanner

    buf = io.BytesIO()
    torch.save({"ema": torch.arange(5.0)}, buf)
    record, layout = ObjectBytes(buf.getvalue()), ParallelLayout()
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    dcp.save(
        {"blob": record}, storage_writer=FileSystemWriter(first), planner=ParallelSavePlanner(layout), no_dist=True
    )
    state: dict[str, Any] = {"blob": ObjectBytes(b"")}
    for _ in range(2):  # the second load into the same state: the bytes again, not the object
        dcp.load(state, storage_reader=FileSystemReader(first), planner=ParallelLoadPlanner(layout), no_dist=True)
        assert type(state["blob"]) is ObjectBytes and state["blob"] == record
    dcp.save(dict(state), storage_writer=FileSystemWriter(second), planner=ParallelSavePlanner(layout), no_dist=True)
    again: dict[str, Any] = {"blob": ObjectBytes(b"")}
    dcp.load(again, storage_reader=FileSystemReader(second), planner=ParallelLoadPlanner(layout), no_dist=True)
    assert again["blob"] == record


def test_a_large_object_record_is_unpickled_from_the_read_buffer_it_landed_in(tmp_path: Path) -> None:
    """The reader copied every object record into a ``bytes`` before handing it over (``bytes(data)``): a
    resume's 512 MiB ``user_content`` spent 0.23 s on that copy, and held the read buffer and the copy at
    once. Now a record over 4 KiB is unpickled from the read buffer itself (``ViewFile``), which a
    resume keeps as its ``user_content`` record until it decodes it. Counted with tracemalloc, which sees
    Python's buffers (the read buffer, a copy) but not torch's storages (the decoded tensor)."""
    import tracemalloc

    want = torch.arange(8 << 20, dtype=torch.int32)  # 32 MiB
    save_checkpoint(str(tmp_path), "t", model=nn.Linear(2, 2), user_content={"big": want})
    model = nn.Linear(2, 2)
    tracemalloc.start()
    try:
        got = resume_from_checkpoint(str(tmp_path), "t", model=model)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert torch.equal(got["big"], want)
    # the read buffer (32 MiB and the record's header, rounded up to 1 MiB); with the copy, 66 MiB
    assert peak < 48 << 20, f"{peak >> 20} MiB of Python buffers at once for a 32 MiB user_content"


def test_large_objects_pass_the_weights_only_check_and_stock_planners_from_the_read_buffer(tmp_path: Path) -> None:
    """Through DCP's own planner (``torch.load(value, weights_only=False)``) and the reader's weights-only
    check before it: a large object read from the buffer is bit-exact, and one that needs arbitrary code is
    still refused, naming its key."""
    from torch.distributed.checkpoint.api import CheckpointException

    from smpckpt.errors import UnsafeCheckpoint
    from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter

    big = {"t": torch.arange(1 << 20, dtype=torch.int64), "s": "x" * 100000}
    dcp.save(big, storage_writer=FsspecStorageWriter(str(tmp_path / "ok")), no_dist=True)
    out: dict[str, Any] = {"t": torch.empty(1 << 20, dtype=torch.int64), "s": None}
    dcp.load(out, storage_reader=FsspecStorageReader(str(tmp_path / "ok")), planner=DefaultLoadPlanner(), no_dist=True)
    assert torch.equal(out["t"], big["t"]) and out["s"] == big["s"]
    bad = {"obj": (math.gcd, "x" * 100000)}  # a function: weights-only loading refuses it
    with pytest.warns(UserWarning):
        dcp.save(bad, storage_writer=FsspecStorageWriter(str(tmp_path / "bad")), no_dist=True)
    with pytest.raises(CheckpointException) as info:
        dcp.load(
            {"obj": None},
            storage_reader=FsspecStorageReader(str(tmp_path / "bad")),
            planner=DefaultLoadPlanner(),
            no_dist=True,
        )
    (err, _tb), *_ = info.value.failures.values()  # DCP's per-rank failures
    assert isinstance(err, UnsafeCheckpoint) and "key 'obj'" in str(err), repr(err)


def test_a_view_file_refuses_an_unknown_whence() -> None:
    """rev69b: ``ViewFile.seek(0, 7)`` raised ``KeyError: 7``; a file object raises ``ValueError``."""
    from smpckpt.storage.format._safe_pickle import ViewFile

    f = ViewFile(memoryview(b"abc"))
    with pytest.raises(ValueError, match="invalid whence"):
        f.seek(0, 7)
    assert f.seek(-1, 2) == 2 and f.read() == b"c"

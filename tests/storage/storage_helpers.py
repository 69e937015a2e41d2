"""Shared test helpers: state dicts, bit-exact comparison, save/load wrappers, error unwrapping."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter

# (no module-level warning filters: pyproject.toml's filterwarnings already ignores DCP's
# "torch.distributed is disabled" UserWarning for single-process saves and loads)


def make_state(seed: int = 0, scale: int = 1) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(256 * scale, 64, generator=g),
            "bf16": torch.randn(33, 17, generator=g).to(torch.bfloat16),
            "i64": torch.randint(-(2**40), 2**40, (97,), generator=g),
            "flag": torch.rand(12, generator=g) > 0.5,
            "scalar": torch.tensor(float(seed) + 0.25),
            "empty": torch.empty(0, 5),
            "half": torch.randn(5, 3, 2, generator=g).half(),
        },
        "step": 100 + seed,
        "info": {"name": f"run-{seed}", "lrs": [0.1, 0.01]},
    }


def zeros_like_state(sd: dict[str, Any]) -> dict[str, Any]:
    def z(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        if isinstance(v, dict):
            return {k: z(x) for k, x in v.items()}
        return None

    return z(sd)


def assert_state_equal(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), path
        for k in a:
            assert_state_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_state_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def save(sd: dict[str, Any], url: str, opts: dict[str, Any] | None = None, **kw: Any) -> FsspecStorageWriter:
    planner = kw.pop("planner", None)
    w = FsspecStorageWriter(url, storage_options=opts, **kw)
    dcp.save(sd, storage_writer=w, planner=planner)
    return w


def load(template: dict[str, Any], url: str, opts: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    out = copy.deepcopy(template)
    dcp.load(out, storage_reader=FsspecStorageReader(url, storage_options=opts, **kw))
    return out


def roundtrip_load(sd: dict[str, Any], url: str, opts: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    return load(zeros_like_state(sd), url, opts, **kw)


def load_error(sd: dict[str, Any], url: str, opts: dict[str, Any] | None = None, **kw: Any) -> BaseException:
    """The error a load of ``url`` fails with, unwrapped from DCP (including its read_metadata wrapping)."""
    reader = FsspecStorageReader(url, storage_options=opts, **kw)
    try:
        dcp.load(zeros_like_state(sd), storage_reader=reader)
    except CheckpointException as exc:
        if reader.metadata_error is not None:
            return reader.metadata_error
        return unwrap(exc)
    raise AssertionError(f"loading {url} did not fail")


def root_causes(exc: BaseException) -> list[BaseException]:
    """The per-rank exceptions inside a DCP CheckpointException (or the exception itself)."""
    if isinstance(exc, CheckpointException):
        return [e for e, _tb in exc.failures.values()]
    return [exc]


def unwrap(exc: BaseException) -> BaseException:
    return root_causes(exc)[0]

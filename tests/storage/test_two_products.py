"""The two products have their own classes: ``FsspecStorageWriter``/``FsspecStorageReader`` (partial
checkpoints) and ``FullArtifactWriter``/``FullArtifactReader`` (the full artifact). Each writer refuses
the other's options by name; the deprecated ``FsspecStorageWriter(mode="full")`` still writes the same
artifact (with a ``DeprecationWarning``); ``FsspecStorageReader`` still opens a full artifact."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.api import CheckpointException

from smpckpt.storage import (
    FsspecStorageReader,
    FsspecStorageWriter,
    FullArtifactReader,
    FullArtifactWriter,
    FullOptions,
    read_manifest,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

PARTIAL_ONLY = {
    "overwrite": True,
    "format": "torch_save",
    "block_size": 3 << 20,
    "object_file_size": 0,
    "prefix_strategy": "hex",
    "hash_beside": True,
}


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(64, 48, generator=g), "b": torch.randn(48, generator=g).to(torch.bfloat16)}


def test_the_partial_writer_refuses_full_only_options_by_name(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match=r"full= is an option of the full artifact's writer.*FullArtifactWriter"):
        FsspecStorageWriter(tmp_path / "p", full=FullOptions())
    with pytest.raises(ValueError, match="mode must be 'partial' or 'full'"):
        FsspecStorageWriter(tmp_path / "p", mode="whole")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(PARTIAL_ONLY))
def test_the_full_writer_refuses_partial_only_options_by_name(tmp_path: Any, name: str) -> None:
    with pytest.raises(TypeError, match=name):
        FullArtifactWriter(tmp_path / "f", **{name: PARTIAL_ONLY[name]})
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=f"{name}= applies to partial"):
        FsspecStorageWriter(tmp_path / "f", mode="full", **{name: PARTIAL_ONLY[name]})  # type: ignore[arg-type]


def test_deprecated_full_mode_writes_the_same_artifact(tmp_path: Any) -> None:
    state = _state()
    opts = FullOptions(dtype=torch.float16)
    with pytest.warns(DeprecationWarning, match="FullArtifactWriter"):
        old = FsspecStorageWriter(tmp_path / "old", mode="full", full=opts, sync_files=False)
    assert isinstance(old, FullArtifactWriter) and old.full is opts and not old.sync_files
    dcp.save(state, storage_writer=old, no_dist=True)
    dcp.save(state, storage_writer=FullArtifactWriter(tmp_path / "new", full=opts), no_dist=True)
    a, b = (load_file(os.path.join(tmp_path, d, "model.safetensors")) for d in ("old", "new"))
    assert a.keys() == b.keys() == state.keys()
    for k in state:
        assert a[k].dtype == torch.float16 and torch.equal(a[k], b[k])
        assert torch.equal(a[k], state[k].to(torch.float16))
    assert read_manifest(str(tmp_path / "old")).kind == "full"


def test_a_subclass_of_the_partial_writer_cannot_ask_for_full_mode(tmp_path: Any) -> None:
    class Mine(FsspecStorageWriter):
        pass

    with pytest.raises(TypeError, match="subclass smpckpt.storage.FullArtifactWriter"):
        Mine(tmp_path / "f", mode="full")


def test_each_reader_reads_its_product_and_the_partial_reader_opens_both(tmp_path: Any) -> None:
    state = _state()
    dcp.save(state, storage_writer=FullArtifactWriter(tmp_path / "full"), no_dist=True)
    dcp.save(state, storage_writer=FsspecStorageWriter(tmp_path / "part"), no_dist=True)
    for reader in (FullArtifactReader(tmp_path / "full"), FsspecStorageReader(tmp_path / "full")):
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(out, storage_reader=reader, no_dist=True)
        assert reader.state == "committed" and reader.manifest is not None and reader.manifest.kind == "full"
        assert reader.last_read_stats is not None and reader.last_read_stats.items == len(state)
        assert all(torch.equal(out[k], state[k]) for k in state)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(out, storage_reader=FsspecStorageReader(tmp_path / "part"), no_dist=True)
    assert all(torch.equal(out[k], state[k]) for k in state)
    reader = FullArtifactReader(tmp_path / "part")
    with pytest.raises(CheckpointException, match="not a full artifact"):
        dcp.load(out, storage_reader=reader, no_dist=True)
    assert "FsspecStorageReader" in str(reader.metadata_error)


def test_the_full_reader_used_before_read_metadata_says_so(tmp_path: Any) -> None:
    """rev61b F1: after the readers became one class, ``read_data`` on a FullArtifactReader whose metadata
    was never read fell through to the partial path and called a healthy artifact damaged (or, with an
    empty plan, read nothing in silence)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import LoadPlan

    from smpckpt.errors import CheckpointError

    dcp.save(_state(), storage_writer=FullArtifactWriter(tmp_path / "full"), no_dist=True)
    with pytest.raises(CheckpointError, match=r"read_data\(\) called before read_metadata\(\)"):
        FullArtifactReader(tmp_path / "full").read_data(LoadPlan([]), DefaultLoadPlanner())

"""A partial save into a folder an unfinished full save left (its marker, no manifest): the full save's
fixed-name files go before the partial save writes, other saves' files stay, and a full save still
running there cannot commit over it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from storage_helpers import assert_state_equal, roundtrip_load, unwrap
from torch.distributed.checkpoint.api import CheckpointException

from smpckpt import ParallelLayout
from smpckpt.errors import CheckpointExists
from smpckpt.planners import ParallelSavePlanner
from smpckpt.storage import FsspecStorageWriter, open_fs, read_manifest
from smpckpt.storage._full_commit import clear_unfinished_full_save

Backend = tuple[str, dict[str, Any]]
MARKER = "smpckpt.writing"
MANIFEST = "smpckpt.manifest.json"
# what a killed partial save left: a data file at the top and one in a prefix folder (object stores)
OTHER_PARTIAL = ("a1b2_r0_0.19abcdef00112233.smp.distcp", "7/c3d4_r1_0.19abcdef00112233.smp.distcp")


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g).to(torch.bfloat16)}


def _listing(url: str, opts: dict[str, Any]) -> set[str]:
    fs, path = open_fs(url, opts)
    return {p[len(path) + 1 :] for p in fs.find(path)} if fs.exists(path) else set()


def _killed_full_save(url: str, opts: dict[str, Any]) -> str:
    """A full save's folder as a kill before its commit leaves it (and a killed partial save's files
    beside it); the full save's id."""
    planner = ParallelSavePlanner(ParallelLayout(), {})
    dcp.save(
        {"m": _model(0)}, storage_writer=FsspecStorageWriter(url, storage_options=opts, mode="full"), planner=planner
    )
    save_id = read_manifest(url, opts).save_id
    fs, path = open_fs(url, opts)
    fs.rm_file(f"{path}/{MANIFEST}")
    fs.pipe_file(f"{path}/{MARKER}", save_id.encode())
    for name in OTHER_PARTIAL:
        fs.makedirs(f"{path}/{name}".rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(f"{path}/{name}", b"another save's bytes")
    return save_id


def test_partial_save_removes_an_unfinished_full_saves_files(backend: Backend) -> None:
    base, opts = backend
    url = f"{base}/mixed"
    full_id = _killed_full_save(url, opts)
    assert {"model.safetensors", MARKER, f".metadata.{full_id}"} <= _listing(url, opts)
    state = {"model": _model(1), "step": 7}
    dcp.save(state, storage_writer=FsspecStorageWriter(url, storage_options=opts))
    left = _listing(url, opts)
    assert not left & {"model.safetensors", MARKER, f".metadata.{full_id}"}, left
    assert set(OTHER_PARTIAL) <= left  # unique names of another save: left to stale clean-up
    manifest = read_manifest(url, opts)
    assert manifest.kind == "partial" and left == {
        *OTHER_PARTIAL,
        *(f.name for f in manifest.files),
        manifest.metadata.name,
        ".metadata",
        MANIFEST,
    }
    assert_state_equal(state, roundtrip_load(state, url, opts))


def test_a_full_save_loses_its_folder_to_a_partial_one(tmp_path: Any) -> None:
    """The partial save removed the marker while the full save wrote: the full save must not commit."""

    class ClearedMeanwhile(FsspecStorageWriter):
        def _write_metadata(self, gen_name: str, md_bytes: bytes) -> None:
            clear_unfinished_full_save(self.fs, self.path, self.url)  # what a partial save's start does
            super()._write_metadata(gen_name, md_bytes)

    url = str(tmp_path / "raced")
    planner = ParallelSavePlanner(ParallelLayout(), {})
    with pytest.raises(CheckpointException) as info:
        dcp.save({"m": _model(0)}, storage_writer=ClearedMeanwhile(url, mode="full"), planner=planner)
    err = unwrap(info.value)
    assert isinstance(err, CheckpointExists) and "another save took this folder over" in str(err), err
    assert MANIFEST not in _listing(url, {})


def test_no_marker_no_removal(tmp_path: Any) -> None:
    """Without the marker nothing in the folder is the full save's to remove (a Hugging Face model, say)."""
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"someone's model")
    fs, path = open_fs(str(folder))
    clear_unfinished_full_save(fs, path, str(folder))
    assert (folder / "model.safetensors").read_bytes() == b"someone's model"


def test_full_save_refuses_a_partial_saves_files_by_name(backend: Backend) -> None:
    """A full save cannot tell a killed partial save from a running one, so it leaves the files and says
    what they are (not "a Hugging Face model?")."""
    base, opts = backend
    url = f"{base}/partial-debris"
    fs, path = open_fs(url, opts)
    for name in OTHER_PARTIAL:
        fs.makedirs(f"{path}/{name}".rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(f"{path}/{name}", b"another save's bytes")
    writer = FsspecStorageWriter(url, storage_options=opts, mode="full")
    with pytest.raises(CheckpointException) as info:
        dcp.save({"m": _model(0)}, storage_writer=writer, planner=ParallelSavePlanner(ParallelLayout(), {}))
    err = unwrap(info.value)
    assert isinstance(err, CheckpointExists) and "files of an uncommitted partial save" in str(err), err
    assert _listing(url, opts) == set(OTHER_PARTIAL)

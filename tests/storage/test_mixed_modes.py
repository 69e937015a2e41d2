"""Full and partial saves (``dcp.save`` with our writer) pointed at one folder: each refuses what the
other left unfinished there, since a killed save cannot be told from a running one; a full save
clears only its own kind's debris, never a checkpoint that committed meanwhile."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from storage_helpers import unwrap
from torch.distributed.checkpoint.api import CheckpointException

from smpckpt import ParallelLayout
from smpckpt.errors import CheckpointExists
from smpckpt.planners import ParallelSavePlanner
from smpckpt.storage import FsspecStorageWriter, FullArtifactWriter, open_fs, read_manifest

Backend = tuple[str, dict[str, Any]]
MARKER = "smpckpt.writing"
MANIFEST = "smpckpt.manifest.json"
# what a killed partial save left: a data file at the top and one in a prefix folder (object stores)
OTHER_PARTIAL = ("a1b2_r0_0.19abcdef00112233.smp.distcp", "7/c3d4_r1_0.19abcdef00112233.smp.distcp")


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g).to(torch.bfloat16)}


def _planner() -> ParallelSavePlanner:
    return ParallelSavePlanner(ParallelLayout(), {})


def _listing(url: str, opts: dict[str, Any]) -> set[str]:
    fs, path = open_fs(url, opts)
    return {p[len(path) + 1 :] for p in fs.find(path)} if fs.exists(path) else set()


def _other_partial_save(fs: Any, path: str) -> None:
    for name in OTHER_PARTIAL:
        fs.makedirs(f"{path}/{name}".rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(f"{path}/{name}", b"another save's bytes")


def _killed_full_save(url: str, opts: dict[str, Any]) -> str:
    """A full save's folder as a kill before its commit leaves it (and a killed partial save's files
    beside it); the full save's id."""
    writer = FullArtifactWriter(url, storage_options=opts)
    dcp.save({"m": _model(0)}, storage_writer=writer, planner=_planner())
    save_id = read_manifest(url, opts).save_id
    fs, path = open_fs(url, opts)
    fs.rm_file(f"{path}/{MANIFEST}")
    fs.pipe_file(f"{path}/{MARKER}", save_id.encode())
    _other_partial_save(fs, path)
    return save_id


def test_partial_save_refuses_an_unfinished_full_save(backend: Backend) -> None:
    base, opts = backend
    url = f"{base}/mixed"
    full_id = _killed_full_save(url, opts)
    before = _listing(url, opts)
    assert {"model.safetensors", MARKER, f".metadata.{full_id}"} <= before
    with pytest.raises(CheckpointException) as info:
        dcp.save({"model": _model(1)}, storage_writer=FsspecStorageWriter(url, storage_options=opts))
    err = unwrap(info.value)
    assert isinstance(err, CheckpointExists) and "holds an unfinished full save" in str(err), err
    assert full_id in str(err)
    assert _listing(url, opts) == before  # nothing written, nothing removed


def test_full_save_never_removes_a_manifest_that_appeared(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The unfinished full save commits between the probe and the listing: its checkpoint stays."""
    import smpckpt.storage.full._commit as full_commit
    from smpckpt.storage.format.manifest import Probe

    url = str(tmp_path / "committed-meanwhile")
    dcp.save({"m": _model(0)}, storage_writer=FullArtifactWriter(url), planner=_planner())
    (tmp_path / "committed-meanwhile" / MARKER).write_text("x")  # listed while its marker was still there
    before = _listing(url, {})
    monkeypatch.setattr(full_commit, "probe", lambda *a, **k: Probe("missing"))  # what it saw a moment earlier
    with pytest.raises(CheckpointException) as info:
        dcp.save({"m": _model(1)}, storage_writer=FullArtifactWriter(url), planner=_planner())
    assert isinstance(unwrap(info.value), CheckpointExists), unwrap(info.value)
    assert _listing(url, {}) == before and MANIFEST in before


def test_full_save_refuses_a_partial_saves_files_by_name(backend: Backend) -> None:
    """A full save cannot tell a killed partial save from a running one, so it leaves the files and says
    what they are (not "a Hugging Face model?")."""
    base, opts = backend
    url = f"{base}/partial-debris"
    fs, path = open_fs(url, opts)
    _other_partial_save(fs, path)
    writer = FullArtifactWriter(url, storage_options=opts)
    with pytest.raises(CheckpointException) as info:
        dcp.save({"m": _model(0)}, storage_writer=writer, planner=_planner())
    err = unwrap(info.value)
    assert isinstance(err, CheckpointExists) and "files of an uncommitted partial save" in str(err), err
    assert _listing(url, opts) == set(OTHER_PARTIAL)

"""Nothing is read or deleted through a symbolic link leading out of a checkpoint folder: a linked
prefix folder (or data file) makes the checkpoint unsafe to every reader, and deletes (overwrite,
retention, failed-save clean-up) leave what the link points at alone. A checkpoint root that is itself
reached through links (``/fsx`` -> ``/mnt/fsx``) is fine."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from smpckpt import UnsafeCheckpoint, resume_from_checkpoint, save_checkpoint
from smpckpt.catalog.root import scan_root
from smpckpt.storage import FsspecStorageWriter, checkpoint_state

MANIFEST = "smpckpt.manifest.json"


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(8, 4)


def _victims(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.bin").write_bytes(b"keep me")
    return outside


def _prefixed_save(root: Path, tag: str) -> Path:
    """A checkpoint whose data files sit in a prefix folder (as on object stores)."""
    folder = root / f"{tag}_partial"
    from torch.distributed.checkpoint import save

    save({"model": _model().state_dict()}, storage_writer=FsspecStorageWriter(str(folder), prefix_strategy="hex"))
    return folder


def test_a_linked_prefix_folder_makes_the_checkpoint_unsafe_and_is_never_deleted_through(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    folder = _prefixed_save(root, "t")
    outside = _victims(tmp_path)
    manifest = json.loads((folder / MANIFEST).read_text())
    prefixes = sorted({f["name"].split("/")[0] for f in manifest["files"] if "/" in f["name"]})
    assert prefixes, manifest["files"]
    # an attacker (or a careless sync) swaps a prefix folder for a link to another folder holding a file
    # of the same name as a data file
    victim_name = next(f["name"] for f in manifest["files"] if f["name"].startswith(prefixes[0] + "/"))
    (outside / os.path.basename(victim_name)).write_bytes(b"another folder's file")
    for p in (folder / prefixes[0]).iterdir():
        p.unlink()
    (folder / prefixes[0]).rmdir()
    os.symlink(outside, folder / prefixes[0])
    with pytest.raises(UnsafeCheckpoint, match="symbolic link leading out of the checkpoint folder"):
        checkpoint_state(str(folder))
    with pytest.raises(UnsafeCheckpoint):
        resume_from_checkpoint(str(root), "t", model=_model(1))
    assert {r.tag: r.state for r in scan_root(str(root))}["t"] == "unsafe"
    # an overwrite refuses too, before deleting anything it lists
    with pytest.raises(Exception):  # noqa: B017 - refused in dcp.save: the wrapped error is checked below
        save_checkpoint(str(root), "t", model=_model(2), overwrite=True)
    assert (outside / os.path.basename(victim_name)).read_bytes() == b"another folder's file"
    assert (outside / "precious.bin").read_bytes() == b"keep me"


def test_removing_a_checkpoint_removes_links_not_their_targets(tmp_path: Path) -> None:
    from smpckpt.storage import remove_checkpoint

    root = tmp_path / "root"
    root.mkdir()
    folder = _prefixed_save(root, "t")
    outside = _victims(tmp_path)
    os.symlink(outside, folder / "extra-link")  # something linked into the folder
    remove_checkpoint(str(folder))
    assert not folder.exists()
    assert (outside / "precious.bin").read_bytes() == b"keep me"


def test_a_root_reached_through_links_is_fine(tmp_path: Path) -> None:
    real = tmp_path / "mnt" / "fsx"
    real.mkdir(parents=True)
    os.symlink(real, tmp_path / "fsx")
    root = str(tmp_path / "fsx" / "run")
    m = _model(3)
    save_checkpoint(root, "a", model=m)
    save_checkpoint(root, "a", model=_model(4), overwrite=True)
    back = _model(5)
    resume_from_checkpoint(root, "a", model=back)
    assert torch.equal(back.weight, _model(4).weight)

"""A full save that fails removes what it laid out, and only that (``discard_failed_save``)."""

from __future__ import annotations

import errno
import os
from typing import Any

import pytest
from full_models import assert_models_equal, trained_model

from smpckpt import CheckpointError, resume_from_checkpoint, save_checkpoint
from smpckpt.storage import FullArtifactWriter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _DiskFullAtCommit(FullArtifactWriter):
    """Every artifact file is written (into the save's staging folder); the metadata copy hits a full disk
    (a failure, not a kill). ``case``: "intruder" -- another job's file appeared at the target meanwhile."""

    case = "plain"

    def _write_metadata(self, gen_name: str, md_bytes: bytes) -> None:
        if self.case == "intruder":
            os.makedirs(self.path, exist_ok=True)
            with open(os.path.join(self.path, "other.smp.distcp"), "wb") as f:
                f.write(b"another job's data")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), gen_name)


@pytest.mark.parametrize("case", ["plain", "intruder"])
def test_failed_full_save_removes_its_artifact_only(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    import smpckpt.api._save as full_api

    root = str(tmp_path)
    m, o = trained_model(0)
    monkeypatch.setattr(_DiskFullAtCommit, "case", case)
    with monkeypatch.context() as patch:
        patch.setattr(full_api, "FullArtifactWriter", _DiskFullAtCommit)
        with pytest.raises(CheckpointError, match=os.strerror(errno.ENOSPC)):
            save_checkpoint(root, "t", partial=False, model=m, optimizer=o, include_optimizer=True)
    folder = os.path.join(root, "t")
    # the save's staging folder went whole; the target was never its to write
    assert not [n for n in os.listdir(root) if n.startswith(".smpckpt-staging.")], os.listdir(root)
    if case == "intruder":  # another job's file at the target is not this save's to remove
        assert os.listdir(folder) == ["other.smp.distcp"]
        os.remove(os.path.join(folder, "other.smp.distcp"))
    else:
        assert not os.path.exists(folder)
    save_checkpoint(root, "t", partial=False, model=m, optimizer=o, include_optimizer=True, user_content=5)
    m2, o2 = trained_model(1)
    assert resume_from_checkpoint(root, "t", partial=False, model=m2, optimizer=o2) == 5
    assert_models_equal(m, m2)


def test_a_full_commit_that_landed_is_never_discarded(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The staged artifact is renamed into place, then the root's fsync fails: the save reports the error,
    and the committed artifact must survive the clean-up."""
    import smpckpt.storage.full._commit as full_commit

    real = full_commit.publish_staged

    def landed_then_failed(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        raise OSError(errno.EIO, "fsync of the folder failed")

    root = str(tmp_path)
    m, o = trained_model(0)
    with monkeypatch.context() as patch:
        patch.setattr(full_commit, "publish_staged", landed_then_failed)
        with pytest.raises(CheckpointError, match="fsync of the folder failed"):
            save_checkpoint(root, "t", partial=False, model=m, optimizer=o, include_optimizer=True, user_content=3)
    assert "model.safetensors" in os.listdir(os.path.join(root, "t"))
    m2, o2 = trained_model(1)
    assert resume_from_checkpoint(root, "t", partial=False, model=m2, optimizer=o2) == 3
    assert_models_equal(m, m2)


@pytest.mark.parametrize("how", ["removal interrupted", "manifest lost"])
def test_a_full_checkpoint_without_its_manifest_is_refused(tmp_path: Any, how: str) -> None:
    """A full checkpoint whose manifest is gone -- a removal interrupted after deleting it (marker, then
    manifest, then the rest), or lost -- is not a Hugging Face folder: read as one it would load
    without its checksums, so a flipped byte came back as a wrong value. It is refused."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from smpckpt.storage import MANIFEST_NAME, FsspecStorageReader, checkpoint_state
    from smpckpt.storage.format.manifest import REMOVING_NAME

    path = str(tmp_path / "full")
    state = {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64)}
    dcp.save(state, storage_writer=FullArtifactWriter(path), no_dist=True)
    if how == "removal interrupted":
        with open(os.path.join(path, REMOVING_NAME), "w") as f:
            f.write("removing\n")
    os.remove(os.path.join(path, MANIFEST_NAME))
    assert checkpoint_state(path) == "uncommitted"
    with pytest.raises(CheckpointException, match="uncommitted"):
        dcp.load({"w": torch.zeros(64, 64)}, storage_reader=FsspecStorageReader(path), no_dist=True)
    # the same artifact alone (a Hugging Face folder) still loads, exactly
    for name in os.listdir(path):
        if name != "model.safetensors":
            os.remove(os.path.join(path, name))
    out = {"w": torch.zeros(64, 64)}
    reader = FsspecStorageReader(path)
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert reader.state == "huggingface" and torch.equal(out["w"], state["w"])

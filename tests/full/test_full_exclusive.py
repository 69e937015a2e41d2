"""At most one full save writes a folder: two full saves of one tag cannot both write its fixed-name
files (the one that committed could hold the other's bytes). The folder belongs to the save whose
marker is created first, kept alive while it runs; a later save is refused while the marker changes,
and takes over the debris of a save whose marker stopped changing (killed)."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch
from full_models import MARKER, assert_models_equal, trained_model
from safetensors.torch import load_file

import smpckpt.api._full as full_api
from smpckpt import CheckpointExists, resume_from_checkpoint, save_checkpoint
from smpckpt.storage import FullArtifactWriter, verify_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Paused(FullArtifactWriter):
    """A full save that stops before its commit until released (a long save, seen from outside)."""

    started = threading.Event()
    release = threading.Event()

    def finish(self, *args: Any, **kwargs: Any) -> None:
        type(self).started.set()
        assert type(self).release.wait(30)
        super().finish(*args, **kwargs)


def test_a_second_full_save_of_a_tag_is_refused_while_the_first_runs(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = str(tmp_path)
    a, _ = trained_model(0)
    b, _ = trained_model(1)
    monkeypatch.setattr(full_api, "FullArtifactWriter", _Paused)
    errors: list[BaseException] = []

    def first() -> None:
        try:
            save_checkpoint(root, "t", partial=False, model=a)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    thread = threading.Thread(target=first)
    thread.start()
    assert _Paused.started.wait(30)
    monkeypatch.setattr(full_api, "FullArtifactWriter", FullArtifactWriter)
    with pytest.raises(CheckpointExists, match=r"another full save .* is writing this folder"):
        save_checkpoint(root, "t", partial=False, model=b)  # its marker changes while watched: alive
    _Paused.release.set()
    thread.join(30)
    assert not errors, errors
    # what committed is the first save, whole
    assert verify_checkpoint(os.path.join(root, "t")).ok
    stored = load_file(os.path.join(root, "t", "model.safetensors"))
    assert all(torch.equal(stored[k], v) for k, v in a.state_dict().items())
    assert MARKER not in os.listdir(os.path.join(root, "t"))  # the refresh stopped before the commit
    back, _ = trained_model(2)
    resume_from_checkpoint(root, "t", partial=False, model=back)
    assert_models_equal(a, back)


def test_two_saves_creating_the_marker_at_once_one_wins(tmp_path: Any) -> None:
    from smpckpt.storage.backends._fs import open_fs
    from smpckpt.storage.full._marker import create_marker

    fs, path = open_fs(str(tmp_path / "f"))
    os.makedirs(path)
    create_marker(fs, path, "f", "save-a", sync=False)
    with pytest.raises(CheckpointExists, match="started writing here at the same moment"):
        create_marker(fs, path, "f", "save-b", sync=False)
    assert open(os.path.join(path, MARKER), "rb").read() == b"save-a\n0"


def test_a_stopped_saves_debris_is_taken_over(tmp_path: Any) -> None:
    """A killed save's marker no longer changes: after the watch its files go and the new save commits."""
    folder = tmp_path / "t"
    folder.mkdir()
    (folder / MARKER).write_bytes(b"killed-save\n7")
    (folder / "model.safetensors").write_bytes(b"\0" * 100)
    m, _ = trained_model(3)
    save_checkpoint(str(tmp_path), "t", partial=False, model=m)
    assert verify_checkpoint(str(folder)).ok and MARKER not in os.listdir(folder)

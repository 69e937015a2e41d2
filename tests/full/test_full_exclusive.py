"""At most one full save's bytes ever reach a folder (issue 42, rows 1, 2, 5 and 6 of its table).

A full artifact has fixed names (``model.safetensors``...): two saves of one tag would write the same
files. The one commit protocol (``storage/format/commit.py``) keeps them apart without a liveness watch:
on POSIX each save writes a staging folder of its own and the commit renames it into place, replacing
nothing; on object stores every object is created only if absent. A save stopped mid-way and woken
after another committed the tag fails, and the committed checkpoint keeps every byte it committed.
Races are driven by hooks (a save held at a chosen step in a thread), never by sleeping."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch
from full_models import MANIFEST, MARKER, assert_models_equal, trained_model
from safetensors.torch import load, load_file

import smpckpt.api._save as full_api
import smpckpt.storage.full._commit as full_commit
from smpckpt import CheckpointError, CheckpointExists, resume_from_checkpoint, save_checkpoint
from smpckpt.storage import FullArtifactWriter, open_fs, verify_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Held(FullArtifactWriter):
    """A full save held at ``at`` ("write": after planning, before any rank writes; "commit": before its
    commit) until released: a save stopped (SIGSTOP, a long GC, a lost node) and woken later."""

    at = "write"
    reached = threading.Event()
    release = threading.Event()

    def _hold(self, where: str) -> None:
        if type(self).at == where:
            type(self).reached.set()
            if not type(self).release.wait(60):
                raise TimeoutError("never released")

    def write_data(self, *args: Any, **kwargs: Any) -> Any:
        self._hold("write")
        return super().write_data(*args, **kwargs)

    def finish(self, *args: Any, **kwargs: Any) -> None:
        self._hold("commit")
        super().finish(*args, **kwargs)


def _held_save(monkeypatch: pytest.MonkeyPatch, at: str, root: str, model: Any, **kw: Any) -> tuple[Any, list[Any]]:
    """Start a full save of tag ``t`` in a thread, held at ``at``; returns (thread, its errors)."""
    monkeypatch.setattr(_Held, "at", at)
    monkeypatch.setattr(_Held, "reached", threading.Event())
    monkeypatch.setattr(_Held, "release", threading.Event())
    errors: list[BaseException] = []

    def run() -> None:
        try:
            save_checkpoint(root, "t", partial=False, model=model, **kw)
        except BaseException as exc:  # noqa: BLE001 - asserted by the caller
            errors.append(exc)

    monkeypatch.setattr(full_api, "FullArtifactWriter", _Held)
    thread = threading.Thread(target=run)
    thread.start()
    assert _Held.reached.wait(60)
    monkeypatch.setattr(full_api, "FullArtifactWriter", FullArtifactWriter)
    return thread, errors


@pytest.mark.parametrize("at", ["write", "commit"])
def test_a_stalled_full_save_never_writes_into_the_save_that_took_the_tag(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, at: str
) -> None:
    """Row 1 (local disk): save A stops after planning (or before its commit); save B of the same tag
    runs and commits without waiting for A; A wakes and fails. B's checkpoint holds B's bytes, verified,
    and A left nothing behind."""
    root = str(tmp_path)
    a, _ = trained_model(0)
    b, _ = trained_model(1)
    thread, errors = _held_save(monkeypatch, at, root, a, user_content="A")
    save_checkpoint(root, "t", partial=False, model=b, user_content="B")  # no wait, no watch
    before = {n: (tmp_path / "t" / n).read_bytes() for n in os.listdir(tmp_path / "t")}
    _Held.release.set()
    thread.join(60)
    assert len(errors) == 1 and isinstance(errors[0], CheckpointExists), errors
    assert "another save committed here" in str(errors[0])
    # B's checkpoint is byte for byte what B committed, and verifies
    assert {n: (tmp_path / "t" / n).read_bytes() for n in os.listdir(tmp_path / "t")} == before
    assert verify_checkpoint(str(tmp_path / "t")).ok
    stored = load_file(str(tmp_path / "t" / "model.safetensors"))
    assert all(torch.equal(stored[k], v) for k, v in b.state_dict().items())
    back, _ = trained_model(2)
    assert resume_from_checkpoint(root, "t", partial=False, model=back) == "B"
    assert_models_equal(b, back)
    assert sorted(os.listdir(root)) == ["t"]  # A's staging folder is gone


def test_a_stalled_full_save_on_s3_fails_at_its_first_write(
    moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row 1 (S3): A stops after planning (its marker created); B takes the tag over at once (A's marker
    and files go: nothing tells a stalled save from a killed one, and nothing needs to), writes, commits.
    A wakes: its first object is refused (``If-None-Match: *``: B created it), so A fails without a byte
    of it in B's checkpoint."""
    from s3_env import reset_moto, s3_options

    reset_moto(moto_endpoint, "full-stall")
    opts = s3_options(moto_endpoint)
    root = "s3://full-stall/run"
    a, _ = trained_model(0)
    b, _ = trained_model(1)
    thread, errors = _held_save(monkeypatch, "write", root, a, storage_options=opts, user_content="A")
    save_checkpoint(root, "t", partial=False, model=b, storage_options=opts, user_content="B")
    fs, path = open_fs(f"{root}/t", opts)
    before = {p: fs.cat_file(p) for p in fs.find(path)}
    _Held.release.set()
    thread.join(60)
    assert len(errors) == 1 and isinstance(errors[0], CheckpointError), errors
    assert "exists" in str(errors[0]).lower() or "412" in str(errors[0]), errors[0]
    fs.invalidate_cache()
    assert {p: fs.cat_file(p) for p in fs.find(path)} == before
    assert verify_checkpoint(f"{root}/t", opts).ok
    stored = load(fs.cat_file(f"{path}/model.safetensors"))
    assert all(torch.equal(stored[k], v) for k, v in b.state_dict().items())


def test_a_link_planted_at_an_artifact_name_is_never_written_through(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row 2: links planted where the artifact's files go -- in the save's own folder before its files
    are created, or at the tag once the save has started -- fail the save; the files they point at are
    untouched, and nothing is written outside the root."""
    root = tmp_path / "root"
    root.mkdir()
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"keep me")
    m, _ = trained_model(0)

    real = full_commit.create_files

    def plant_then_create(folder: Any, files: Any, *, sync: bool) -> None:
        os.symlink(victim, os.path.join(folder.path, "model.safetensors"))
        real(folder, files, sync=sync)

    monkeypatch.setattr(full_commit, "create_files", plant_then_create)
    with pytest.raises(CheckpointError, match="exists"):
        save_checkpoint(str(root), "t", partial=False, model=m)
    monkeypatch.setattr(full_commit, "create_files", real)
    assert victim.read_bytes() == b"keep me"
    assert sorted(os.listdir(root)) == []  # the failed save's staging folder (with the link) is gone

    # the tag's folder appears with a link in it while the save writes: the rename into place refuses
    thread, errors = _held_save(monkeypatch, "commit", str(root), m)
    (root / "t").mkdir()
    os.symlink(victim, root / "t" / "model.safetensors")
    _Held.release.set()
    thread.join(60)
    assert len(errors) == 1 and isinstance(errors[0], CheckpointExists), errors
    assert victim.read_bytes() == b"keep me"
    assert os.readlink(root / "t" / "model.safetensors") == str(victim)


def test_a_killed_saves_marker_temp_file_never_blocks_its_tag(tmp_path: Any) -> None:
    """Row 5: a kill between an older version's marker temp file and its link left a folder holding only
    ``smpckpt.writing.tmp.*``; the next full save of the tag takes it over and commits."""
    folder = tmp_path / "t"
    folder.mkdir()
    (folder / f"{MARKER}.tmp.123.abcd1234").write_bytes(b"killed-save\n0")
    m, _ = trained_model(3)
    save_checkpoint(str(tmp_path), "t", partial=False, model=m)
    assert verify_checkpoint(str(folder)).ok
    assert not any(n.startswith(MARKER) for n in os.listdir(folder))
    back, _ = trained_model(2)
    resume_from_checkpoint(str(tmp_path), "t", partial=False, model=back)
    assert_models_equal(m, back)


def test_an_older_versions_killed_save_is_taken_over_at_once(tmp_path: Any) -> None:
    """A killed save's marker and files (what an older version or an object store leaves): removed before
    the new save commits, without any watch."""
    folder = tmp_path / "t"
    folder.mkdir()
    (folder / MARKER).write_bytes(b"killed-save\n7")
    (folder / "model.safetensors").write_bytes(b"\0" * 100)
    m, _ = trained_model(3)
    save_checkpoint(str(tmp_path), "t", partial=False, model=m)
    assert verify_checkpoint(str(folder)).ok and MARKER not in os.listdir(folder)


def test_a_side_file_removed_before_the_commit_fails_the_save(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Row 6: ``user_content.pt`` disappears before the commit: the commit's listing finds it missing and
    refuses; nothing is committed (before: the save returned OK and the checkpoint could not be loaded)."""
    root = str(tmp_path)
    m, _ = trained_model(0)

    class _LosesUserContent(FullArtifactWriter):
        def finish(self, *args: Any, **kwargs: Any) -> None:
            staging = full_commit.staging_path(self.path, self._save_id or "")
            os.remove(os.path.join(staging, "user_content.pt"))
            super().finish(*args, **kwargs)

    monkeypatch.setattr(full_api, "FullArtifactWriter", _LosesUserContent)
    with pytest.raises(CheckpointError, match=r"missing or cut short at the commit.*user_content\.pt"):
        save_checkpoint(root, "t", partial=False, model=m, user_content={"step": 1})
    assert os.listdir(root) == []  # nothing published, the staging folder removed
    monkeypatch.setattr(full_api, "FullArtifactWriter", FullArtifactWriter)
    save_checkpoint(root, "t", partial=False, model=m, user_content={"step": 1})
    back, _ = trained_model(2)
    assert resume_from_checkpoint(root, "t", partial=False, model=back) == {"step": 1}
    assert MANIFEST in os.listdir(os.path.join(root, "t"))


def test_a_prune_taking_a_staging_folder_away_fails_the_save_publishing_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``prune --uncommitted-older-than 0`` while a full save is about to commit: the prune renames the
    save's staging folder away before deleting it, so the save's own rename into place finds nothing and
    the save fails; nothing is published half-deleted, and nothing is left."""
    from smpckpt.catalog.root import apply_retention

    root = str(tmp_path)
    m, _ = trained_model(0)
    thread, errors = _held_save(monkeypatch, "commit", root, m)
    result = apply_retention(root, None, uncommitted_older_than=0)
    assert len(result.removed_debris) == 1 and ".smpckpt-staging." in result.removed_debris[0]
    _Held.release.set()
    thread.join(60)
    assert len(errors) == 1 and isinstance(errors[0], CheckpointError), errors
    assert os.listdir(root) == []

"""The one commit protocol (issue 42): create-only writes, deletes that never follow links, a commit that
no concurrent prune can empty, overwrites that replace exactly what they saw, part sizes honoured.

Each race is driven by a hook at the exact step (a writer seam, or a wrapped call), never by sleeping:
rows 3, 4, 8 and 9 of the issue's table, and the partial-save form of row 2 (rows 1, 2, 5, 6 of full
saves: tests/full/test_full_exclusive.py; row 7: tests/api/test_api_reliability.py)."""

from __future__ import annotations

import errno
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from storage_helpers import assert_state_equal, make_state, roundtrip_load, unwrap
from torch.distributed.checkpoint.api import CheckpointException

import smpckpt.storage.format.commit as commit_mod
from smpckpt.catalog import root as catalog
from smpckpt.catalog.root import scan_root
from smpckpt.errors import CheckpointError, CheckpointExists, UnsafeCheckpoint
from smpckpt.storage import FsspecStorageWriter, checkpoint_state, read_manifest, verify_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _outside(tmp_path: Path, names: list[str]) -> Path:
    """A folder outside every root, holding files under ``names`` (what a link would lead deletes to)."""
    out = tmp_path / "outside"
    out.mkdir(exist_ok=True)
    for n in names:
        (out / n).write_bytes(b"not yours")
    return out


def _exists(url: str, name: str, opts: dict[str, Any]) -> bool:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **opts)
    fs.invalidate_cache(path)
    return bool(fs.exists(f"{path}/{name}"))


def _start(out: dict[str, Any], name: str, fn: Any) -> threading.Thread:
    """Run ``fn`` on a thread named ``name``; its result, or what it raised, lands in ``out[name]``."""

    def body() -> None:
        try:
            out[name] = fn()
        except BaseException as exc:  # noqa: BLE001 - the tests assert it
            out[name] = exc

    thread = threading.Thread(target=body, name=name)
    thread.start()
    return thread


def _intact(out: Path, names: list[str]) -> None:
    assert sorted(p.name for p in out.iterdir()) == sorted(names)
    assert all((out / n).read_bytes() == b"not yours" for n in names)


# -- row 2, partial saves: a link planted under a data file's name ---------------------------------------
def test_a_link_planted_at_a_data_files_name_is_never_written_through(tmp_path: Path) -> None:
    victim = _outside(tmp_path, ["victim.bin"]) / "victim.bin"

    class Planted(FsspecStorageWriter):
        def _open_sink(self, name: str) -> Any:
            os.symlink(victim, os.path.join(self.path, name))  # the moment before the file is created
            return super()._open_sink(name)

    url = str(tmp_path / "root" / "t_partial")
    with pytest.raises(CheckpointException) as info:
        dcp.save(make_state(), storage_writer=Planted(url, thread_count=1))
    assert isinstance(unwrap(info.value), FileExistsError), info.value
    _intact(victim.parent, ["victim.bin"])
    assert checkpoint_state(url) != "committed"


# -- row 3: a prune while the folder it removes is swapped for a link ------------------------------------
@pytest.mark.parametrize("when", ["before the removal", "inside the removal"])
def test_prune_never_deletes_through_a_folder_swapped_for_a_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """``prune --uncommitted-older-than 0`` picks ``x_partial``; an attacker swaps it for a link to a
    folder of another job's files, before its removal starts, or inside it: the moment the removal first
    opens or lists anything by the folder's name, after every check it made. The link goes at most; what it
    points at stays (before: 205-587 files outside the root deleted)."""
    root = tmp_path / "root"
    root.mkdir()
    x = root / "x_partial"
    x.mkdir()
    (x / "0123_r0_0.18c1f00000000000.smp.distcp").write_bytes(b"debris")
    names = [f"file{i}.bin" for i in range(20)]
    out = _outside(tmp_path, names)
    removing = threading.Event()

    def swap() -> None:
        if not x.is_symlink():
            x.rename(root / "moved_away")
            os.symlink(out, x)

    real_remove = catalog.remove_checkpoint

    def swapping_remove(*args: Any, **kwargs: Any) -> Any:
        if when == "before the removal":
            swap()
        removing.set()
        return real_remove(*args, **kwargs)

    def first_look(real: Any) -> Any:
        def look(path: Any, *args: Any, **kwargs: Any) -> Any:
            if when == "inside the removal" and removing.is_set() and "x_partial" in str(path):
                swap()
            return real(path, *args, **kwargs)

        return look

    monkeypatch.setattr(catalog, "remove_checkpoint", swapping_remove)
    for name in ("open", "scandir", "walk", "listdir"):
        monkeypatch.setattr(os, name, first_look(getattr(os, name)))
    catalog.apply_retention(str(root), None, uncommitted_older_than=0)
    monkeypatch.undo()
    assert removing.is_set() and x.is_symlink() or not x.exists()
    _intact(out, names)


# -- row 4: an overwrite removing its previous generation through a prefix folder flipped to a link -------
def test_an_overwrite_never_deletes_through_a_prefix_folder_flipped_to_a_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(tmp_path / "root" / "t_partial")
    old = make_state(1)
    dcp.save(old, storage_writer=FsspecStorageWriter(url, prefix_strategy="hex"))
    first = read_manifest(url)
    prefixed = sorted(f.name for f in first.files if "/" in f.name)
    prefix = prefixed[0].split("/")[0]
    victims = [n.split("/")[1] for n in prefixed if n.startswith(prefix + "/")]
    out = _outside(tmp_path, victims)
    folder = Path(url) / prefix
    flipped = threading.Event()
    real_open, real_remove, real_unlink = os.open, os.remove, os.unlink

    def flip_first(arg: Any) -> None:
        # the first time anything reaches into the old generation's prefix folder after the commit, it has
        # just become a link (the moment between any check and the deletion)
        text = str(arg)
        if committed.is_set() and not flipped.is_set() and (text == prefix or f"/{prefix}/" in text):
            flipped.set()
            folder.rename(folder.with_name("gone"))
            os.symlink(out, folder)

    def opening(path: Any, *args: Any, **kwargs: Any) -> Any:
        flip_first(path)
        return real_open(path, *args, **kwargs)

    def removing(path: Any, *args: Any, **kwargs: Any) -> Any:
        flip_first(path)
        return real_remove(path, *args, **kwargs)

    def unlinking(path: Any, *args: Any, **kwargs: Any) -> Any:
        flip_first(path)
        return real_unlink(path, *args, **kwargs)

    committed = threading.Event()
    real_unless = commit_mod._unless_removing

    def unless_removing(*args: Any, **kwargs: Any) -> None:  # the commit's last look (step 4) passed
        real_unless(*args, **kwargs)
        committed.set()

    monkeypatch.setattr(commit_mod, "_unless_removing", unless_removing)
    monkeypatch.setattr(os, "open", opening)
    monkeypatch.setattr(os, "remove", removing)
    monkeypatch.setattr(os, "unlink", unlinking)
    new = make_state(2, scale=3)
    dcp.save(new, storage_writer=FsspecStorageWriter(url, overwrite=True, prefix_strategy="hex"))
    monkeypatch.undo()
    assert flipped.is_set()
    _intact(out, victims)  # nothing outside the root deleted (before: files behind the link went)
    # the new generation committed; its folder now holds a link, so readers refuse it rather than read through
    assert json.loads((Path(url) / "smpckpt.manifest.json").read_bytes())["save_id"] != first.save_id
    with pytest.raises(UnsafeCheckpoint):
        checkpoint_state(url)


# -- row 8: a prune at age 0 during saves never empties a committed checkpoint ---------------------------
def _prune_now(root: str, opts: dict[str, Any] | None = None) -> Any:
    return catalog.apply_retention(root, None, uncommitted_older_than=0, storage_options=opts or None)


def test_a_prune_between_the_commits_check_and_its_manifest_fails_the_save(tmp_path: Path) -> None:
    """The prune removes the save's files after the commit's listing and before its manifest: the save
    fails (before: it committed and returned OK with its data files gone)."""
    root = tmp_path / "root"
    url = str(root / "t_partial")

    class PrunedMeanwhile(FsspecStorageWriter):
        def _write_manifest(self, data: bytes) -> None:
            _prune_now(str(root))
            super()._write_manifest(data)

    with pytest.raises(CheckpointException):
        dcp.save(make_state(), storage_writer=PrunedMeanwhile(url))
    assert checkpoint_state(url) in ("missing", "uncommitted")
    assert not any(r.committed for r in scan_root(str(root)))


def test_a_prune_removing_the_whole_folder_before_the_commit_fails_the_save_by_name(tmp_path: Path) -> None:
    """hunt64b F2: the prune removed the save's folder whole after every rank wrote and before the commit
    opened it: the save failed with a bare ``FileNotFoundError`` naming ``t_partial`` (``CheckpointNotFound``
    through the API: the error of a resume that finds nothing)."""
    root = tmp_path / "root"
    url = str(root / "t_partial")

    class PrunedBeforeTheCommit(FsspecStorageWriter):
        def _committed_files(self, *args: Any, **kwargs: Any) -> Any:
            _prune_now(str(root))
            return super()._committed_files(*args, **kwargs)

    with pytest.raises(CheckpointException) as caught:
        dcp.save(make_state(), storage_writer=PrunedBeforeTheCommit(url))
    error = unwrap(caught.value)
    assert type(error) is CheckpointError and url in str(error) and "removed during the save" in str(error), error
    assert not (root / "t_partial").exists()


def test_a_prune_that_marked_the_folder_withdraws_a_commit_landing_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prune marks the folder for removal; the save's whole commit lands right then; the save sees
    the mark after its manifest, withdraws the commit and fails; the prune then finds no manifest and
    removes the folder. No committed checkpoint ever lacks a file."""
    root = tmp_path / "root"
    url = str(root / "t_partial")
    marked, saved = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    class WaitsForTheMark(FsspecStorageWriter):
        def _write_manifest(self, data: bytes) -> None:
            assert marked.wait(60)
            super()._write_manifest(data)

    def save() -> None:
        try:
            dcp.save(make_state(), storage_writer=WaitsForTheMark(url))
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)
        finally:
            saved.set()

    real_publish = commit_mod.Folder.publish

    def publish(folder: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        out = real_publish(folder, name, *args, **kwargs)
        if name == "smpckpt.removing":
            marked.set()
            assert saved.wait(60)  # the save's commit runs entirely between the mark and the check
        return out

    monkeypatch.setattr(commit_mod.Folder, "publish", publish)
    thread = threading.Thread(target=save)
    thread.start()
    # the prune picks the folder while the save is at its manifest (an uncommitted folder)
    deadline = time.monotonic() + 60
    while not any(r.state == "uncommitted" for r in scan_root(str(root))) and time.monotonic() < deadline:
        time.sleep(0.01)  # waiting for the save's files, not for a race: the hooks order the steps
    _prune_now(str(root))
    thread.join(60)
    assert len(errors) == 1 and "commit was withdrawn" in str(unwrap(errors[0])), errors
    assert checkpoint_state(url) in ("missing", "uncommitted")


def test_a_prune_that_finds_the_manifest_after_marking_leaves_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prune picked the folder while uncommitted; the save's manifest lands before the prune marks it:
    the prune sees the manifest, removes its mark and nothing else; the save commits, intact."""
    root = tmp_path / "root"
    url = str(root / "t_partial")
    picked, published, pruned = threading.Event(), threading.Event(), threading.Event()
    real_remove = catalog.remove_checkpoint

    def remove_when_published(*args: Any, **kwargs: Any) -> Any:
        picked.set()
        assert published.wait(60)
        try:
            return real_remove(*args, **kwargs)
        finally:
            pruned.set()

    real_unless = commit_mod._unless_removing

    def unless_after_the_prune(*args: Any, **kwargs: Any) -> None:
        published.set()
        assert pruned.wait(60)
        real_unless(*args, **kwargs)

    class WaitsForThePick(FsspecStorageWriter):
        def _write_manifest(self, data: bytes) -> None:
            assert picked.wait(60)
            super()._write_manifest(data)

    monkeypatch.setattr(catalog, "remove_checkpoint", remove_when_published)
    monkeypatch.setattr(commit_mod, "_unless_removing", unless_after_the_prune)
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(_prune_now(str(root))))
    state = make_state(4)
    (root / "t_partial").mkdir(parents=True)
    (root / "t_partial" / "placeholder").write_bytes(b"")  # uncommitted from the start: the prune picks it
    thread.start()
    dcp.save(state, storage_writer=WaitsForThePick(url))
    thread.join(60)
    assert results and results[0].removed_uncommitted == ()
    assert verify_checkpoint(url).ok
    assert not os.path.exists(os.path.join(url, "smpckpt.removing"))
    assert_state_equal(state, roundtrip_load(state, url))


def test_a_removal_finishing_between_a_commits_manifest_and_its_look_fails_the_save(
    backend: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """hunt64b F1 (HIGH): a stale removal marks the folder and finds no manifest; the save's manifest lands;
    the removal deletes everything, its mark last; only then does the commit look for the mark. Before: no
    mark, so the save returned OK with nothing left. Now the commit also lists its files after looking for
    the mark: they are gone, and the save fails by name."""
    from smpckpt.storage import remove_checkpoint
    from smpckpt.storage.backends import _folder as folder_mod

    base, opts = backend
    url = f"{base}/t_partial"
    files_checked, removal_emptied, manifest_in, look = (threading.Event() for _ in range(4))
    real_check, real_unless, real_tree = commit_mod.check_named, commit_mod._unless_removing, folder_mod.remove_tree

    def check_named(*args: Any, **kwargs: Any) -> None:  # the commit's step 2: every file there
        real_check(*args, **kwargs)
        files_checked.set()
        assert removal_emptied.wait(60)

    def unless_removing(*args: Any, **kwargs: Any) -> Any:  # step 4, held until the removal is done
        manifest_in.set()
        assert look.wait(60)
        return real_unless(*args, **kwargs)

    def remove_tree(*args: Any, **kwargs: Any) -> Any:  # the removal: marked, no manifest seen, emptied
        removal_emptied.set()
        assert manifest_in.wait(60)
        return real_tree(*args, **kwargs)

    monkeypatch.setattr(commit_mod, "check_named", check_named)
    monkeypatch.setattr(commit_mod, "_unless_removing", unless_removing)
    monkeypatch.setattr(folder_mod, "remove_tree", remove_tree)
    out: dict[str, Any] = {}
    thread = _start(
        out,
        "save",
        lambda: dcp.save(make_state(2), storage_writer=FsspecStorageWriter(url, storage_options=opts), no_dist=True),
    )
    assert files_checked.wait(60)
    remove_checkpoint(url, opts, uncommitted_only=True)
    look.set()
    thread.join(60)
    assert isinstance(out["save"], BaseException), f"the save returned OK; the folder is {checkpoint_state(url, opts)}"
    error = unwrap(out["save"])
    assert type(error) is CheckpointError and url in str(error) and "nothing is committed" in str(error), error
    assert checkpoint_state(url, opts) in ("missing", "uncommitted")


def test_a_second_removal_never_clears_a_running_ones_mark(
    backend: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """rev65a F1 (HIGH): stale removal P1 marked the folder and found no manifest; the save's manifest landed; a
    second stale removal P2 found the mark there, saw the manifest ("committed meanwhile") and unlinked P1's
    mark; the commit's look found no mark and every file, returned OK, and P1 then deleted everything. Now a
    removal unlinks only a mark it made: the commit sees P1's and withdraws."""
    from smpckpt.storage import remove_checkpoint
    from smpckpt.storage.backends._folder import Folder

    base, opts = backend
    url = f"{base}/t_partial"
    checked, p1_looked, manifest_in, p2_done, look_done = (threading.Event() for _ in range(5))
    real_check, real_unless, real_exists = commit_mod.check_named, commit_mod._unless_removing, Folder.exists

    def check_named(*args: Any, **kwargs: Any) -> None:
        real_check(*args, **kwargs)
        checked.set()
        assert p1_looked.wait(60)

    def exists(self: Folder, name: str) -> bool:
        found = real_exists(self, name)
        if threading.current_thread().name == "P1" and name == commit_mod.MANIFEST_NAME:
            p1_looked.set()  # P1 found no manifest; it deletes once the commit has looked
            assert look_done.wait(60)
        return found

    def unless_removing(*args: Any, **kwargs: Any) -> None:
        manifest_in.set()
        assert p2_done.wait(60)
        try:
            real_unless(*args, **kwargs)
        finally:
            look_done.set()

    monkeypatch.setattr(commit_mod, "check_named", check_named)
    monkeypatch.setattr(commit_mod, "_unless_removing", unless_removing)
    monkeypatch.setattr(Folder, "exists", exists)
    out: dict[str, Any] = {}
    saving = _start(
        out,
        "save",
        lambda: dcp.save(make_state(2), storage_writer=FsspecStorageWriter(url, storage_options=opts), no_dist=True),
    )
    assert checked.wait(60)
    p1 = _start(out, "P1", lambda: remove_checkpoint(url, opts, uncommitted_only=True))
    assert manifest_in.wait(60)
    remove_checkpoint(url, opts, uncommitted_only=True)  # P2
    p2_done.set()
    saving.join(60)
    p1.join(60)
    assert isinstance(out["save"], BaseException), f"the save returned OK; the folder is {checkpoint_state(url, opts)}"
    assert "the commit was withdrawn" in str(unwrap(out["save"])), out["save"]
    assert checkpoint_state(url, opts) in ("missing", "uncommitted")


def test_a_removal_paused_after_its_look_leaves_a_save_committed_meanwhile(
    backend: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """rev65c F1, F4, F5: a prune finishing an interrupted removal (``removing``: mark + data) looked for a
    manifest, found none and paused; a save of that tag finished the removal itself and committed (OK). The
    prune then deleted the new manifest (S3, memory://) or failed naming the folder (POSIX). Now it finds its
    mark gone, leaves what is there and reports the save committed meanwhile: neither removed nor failed."""
    import fsspec

    from smpckpt.storage.backends._folder import Folder

    base, opts = backend
    root, url = f"{base}/root", f"{base}/root/s2_partial"
    dcp.save(make_state(1), storage_writer=FsspecStorageWriter(url, storage_options=opts), no_dist=True)
    fs, _ = fsspec.core.url_to_fs(url, **opts)
    fs.rm_file(f"{url}/{commit_mod.MANIFEST_NAME}")
    fs.pipe_file(f"{url}/{commit_mod.REMOVING_NAME}", b"removing\n")  # a removal killed after the manifest
    looked, go = threading.Event(), threading.Event()
    real_exists = Folder.exists

    def exists(self: Folder, name: str) -> bool:
        found = real_exists(self, name)
        if threading.current_thread().name == "prune" and name == commit_mod.MANIFEST_NAME:
            looked.set()
            assert go.wait(60)
        return found

    monkeypatch.setattr(Folder, "exists", exists)
    results: list[Any] = []
    prune = threading.Thread(target=lambda: results.append(_prune_now(root, opts)), name="prune")
    prune.start()
    assert looked.wait(60)
    state = make_state(2, scale=3)
    dcp.save(state, storage_writer=FsspecStorageWriter(url, storage_options=opts), no_dist=True)
    go.set()
    prune.join(60)
    assert results and "s2" not in results[0].removed and "s2" not in results[0].failed, results
    assert_state_equal(state, roundtrip_load(state, url, opts))


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_removal_on_a_mark_not_its_own_stops_when_it_goes_before_the_manifest(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rev65c F2, rev65f F2: save C's manifest landed, C held before its look; stale removal Pa marked the folder;
    the user's remove_checkpoint Pb found Pa's mark (not its own); Pa found C's manifest and unlinked its mark; C
    looked, found no mark and its files, returned OK; Pb then deleted C's manifest. Pb now looks for the mark
    again before the manifest goes, stops, and says so; C stays committed. And two removals where one finishes
    first (rev65f F1): the late one finds nothing left and succeeds."""
    from smpckpt.storage import remove_checkpoint
    from smpckpt.storage.backends._folder import Folder

    base, opts = (str(tmp_path), {}) if kind == "local" else request.getfixturevalue("s3")
    url = f"{base}/t_partial"
    ev = {k: threading.Event() for k in ("c_in", "go_c", "a_marked", "go_a", "b_tried", "go_b")}
    real_unless, real_publish = commit_mod._unless_removing, Folder.publish

    def unless(*args: Any, **kwargs: Any) -> None:
        if threading.current_thread().name == "C":
            ev["c_in"].set()
            assert ev["go_c"].wait(60)
        real_unless(*args, **kwargs)

    def publish(self: Folder, name: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return real_publish(self, name, *args, **kwargs)
        finally:
            who = threading.current_thread().name
            if name == commit_mod.REMOVING_NAME and who in ("Pa", "Pb"):
                ev["a_marked" if who == "Pa" else "b_tried"].set()
                assert ev["go_a" if who == "Pa" else "go_b"].wait(60)

    monkeypatch.setattr(commit_mod, "_unless_removing", unless)
    monkeypatch.setattr(Folder, "publish", publish)
    out: dict[str, Any] = {}
    run = functools.partial(_start, out)
    state = make_state(2)
    c = run("C", lambda: dcp.save(state, storage_writer=FsspecStorageWriter(url, storage_options=opts), no_dist=True))
    assert ev["c_in"].wait(60)
    pa = run("Pa", lambda: remove_checkpoint(url, opts, uncommitted_only=True))
    assert ev["a_marked"].wait(60)
    pb = run("Pb", lambda: remove_checkpoint(url, opts))
    assert ev["b_tried"].wait(60)
    ev["go_a"].set()
    pa.join(60)
    ev["go_c"].set()
    c.join(60)
    ev["go_b"].set()
    pb.join(60)
    assert out["Pa"] is False and not isinstance(out["C"], BaseException), out
    assert isinstance(out["Pb"], OSError) and url in str(out["Pb"]) and "stopped" in str(out["Pb"]), out["Pb"]
    assert checkpoint_state(url, opts) == "committed"
    assert_state_equal(state, roundtrip_load(state, url, opts))
    monkeypatch.undo()
    # two removals of one folder, the other finishing first: nothing is left, and the late one says done
    marked, go = threading.Event(), threading.Event()

    def held_publish(self: Folder, name: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return real_publish(self, name, *args, **kwargs)
        finally:
            if threading.current_thread().name == "late" and name == commit_mod.REMOVING_NAME:
                marked.set()
                assert go.wait(60)

    monkeypatch.setattr(Folder, "publish", held_publish)
    late = run("late", lambda: remove_checkpoint(url, opts))
    assert marked.wait(60)
    assert remove_checkpoint(url, opts) is True
    go.set()
    late.join(60)
    assert out["late"] is True and checkpoint_state(url, opts) == "missing", out["late"]


def test_a_removal_whose_mark_put_was_retried_knows_its_own_mark(
    backend: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """rev65c F6: the mark's create landed but its reply was lost; the retry met the mark (412, FileExistsError).
    The removal took it for another's: a stale removal finding the commit left it beside the checkpoint, and
    every later overwrite failed at its commit. The mark carries the removal's nonce now, read back."""
    from smpckpt.storage import remove_checkpoint
    from smpckpt.storage.backends._folder import Folder

    base, opts = backend
    url = f"{base}/t_partial"
    state = make_state(2)
    dcp.save(state, storage_writer=FsspecStorageWriter(url, storage_options=opts), no_dist=True)
    real_publish = Folder.publish

    def lost_reply(self: Folder, name: str, *args: Any, **kwargs: Any) -> Any:
        out = real_publish(self, name, *args, **kwargs)
        if name == commit_mod.REMOVING_NAME:
            raise FileExistsError(17, "injected: the retried create met the first one's object")
        return out

    monkeypatch.setattr(Folder, "publish", lost_reply)
    assert remove_checkpoint(url, opts, uncommitted_only=True) is False  # committed: left as it is
    monkeypatch.undo()
    assert checkpoint_state(url, opts) == "committed" and not _exists(url, commit_mod.REMOVING_NAME, opts)
    dcp.save(state, storage_writer=FsspecStorageWriter(url, storage_options=opts, overwrite=True), no_dist=True)


def test_an_overwrite_of_a_checkpoint_marked_for_removal_is_refused_before_writing(
    backend: tuple[str, dict[str, Any]],
) -> None:
    """rev65c F7: a committed checkpoint beside a killed removal's mark: an overwrite wrote every byte and was then
    withdrawn at its commit, blaming a removal "started while this save was committing". Refused first, by name."""
    import fsspec

    base, opts = backend
    url = f"{base}/t_partial"
    dcp.save(make_state(1), storage_writer=FsspecStorageWriter(url, storage_options=opts), no_dist=True)
    fs, _ = fsspec.core.url_to_fs(url, **opts)
    fs.pipe_file(f"{url}/{commit_mod.REMOVING_NAME}", b"removing\n")  # a removal killed before its manifest delete
    before = sorted(fs.find(url))
    with pytest.raises(CheckpointException) as info:
        dcp.save(make_state(2), storage_writer=FsspecStorageWriter(url, storage_options=opts, overwrite=True))
    error = unwrap(info.value)
    assert isinstance(error, CheckpointError) and commit_mod.REMOVING_NAME in str(error) and url in str(error)
    fs.invalidate_cache(url)
    assert sorted(fs.find(url)) == before  # nothing written


def test_an_overwrite_landing_during_a_commits_look_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """rev65a F3: save A's manifest landed; before its look, save B overwrote the tag and removed A's files. A
    failed with "a removal ... ran; nothing is committed here", though B's checkpoint is: now it names B."""
    url = str(tmp_path / "t_partial")
    held, go = threading.Event(), threading.Event()
    real_unless = commit_mod._unless_removing

    def unless_removing(*args: Any, **kwargs: Any) -> None:
        if threading.current_thread().name == "A":
            held.set()
            assert go.wait(60)
        real_unless(*args, **kwargs)

    monkeypatch.setattr(commit_mod, "_unless_removing", unless_removing)
    out: dict[str, Any] = {}
    a = _start(out, "A", lambda: dcp.save(make_state(2), storage_writer=FsspecStorageWriter(url), no_dist=True))
    assert held.wait(60)
    b_state = make_state(2, scale=3)
    dcp.save(b_state, storage_writer=FsspecStorageWriter(url, overwrite=True), no_dist=True)
    go.set()
    a.join(60)
    error = unwrap(out["A"])
    assert isinstance(error, CheckpointExists) and "another save's commit" in str(error), error
    assert_state_equal(b_state, roundtrip_load(b_state, url))


# -- overwrites replace exactly the checkpoint they saw --------------------------------------------------
def test_of_two_racing_overwrites_the_later_commit_is_refused(backend: tuple[str, dict[str, Any]]) -> None:
    """Save A (overwrite) saw generation 0; save B overwrites first; A's commit finds another manifest
    than the one it saw and is refused (before: both succeeded, A silently replaced B's)."""
    base, opts = backend
    url = f"{base}/t"
    dcp.save(make_state(0), storage_writer=FsspecStorageWriter(url, storage_options=opts))
    b_state = make_state(2, scale=5)

    class Overtaken(FsspecStorageWriter):
        def _write_manifest(self, data: bytes) -> None:
            dcp.save(b_state, storage_writer=FsspecStorageWriter(url, storage_options=opts, overwrite=True))
            super()._write_manifest(data)

    with pytest.raises(CheckpointException) as info:
        dcp.save(make_state(1), storage_writer=Overtaken(url, storage_options=opts, overwrite=True))
    assert isinstance(unwrap(info.value), CheckpointExists), info.value
    assert_state_equal(b_state, roundtrip_load(b_state, url, opts))
    assert verify_checkpoint(url, opts).ok


@pytest.mark.s3
@pytest.mark.parametrize("when", ["before its read", "between its read and its put"])
def test_an_overwrite_whose_checkpoint_a_removal_took_says_so(
    s3: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """rev66d F3: an overwrite on S3 whose old manifest a concurrent removal (retention, prune) deleted during its
    commit (before its read of that manifest, or between the read and its conditional PUT) failed with
    `CommitUncertain`: "may still land ... this save's files are kept", though the request had found no object
    (a 404 is final: it cannot land) and the removal takes the folder. Now it says what happened."""
    import fsspec

    from smpckpt.storage.backends import _s3
    from smpckpt.storage.format.commit import CommitUncertain

    base, opts = s3
    url = f"{base}/t_partial"
    dcp.save(make_state(1), storage_writer=FsspecStorageWriter(url, storage_options=opts), no_dist=True)
    fs, _ = fsspec.core.url_to_fs(url, **opts)
    manifest = f"{url}/{commit_mod.MANIFEST_NAME}"
    real = _s3.get_object_and_etag

    def removed_around_the_read(fs_: Any, where: str) -> Any:
        if where.endswith(commit_mod.MANIFEST_NAME) and when == "before its read":
            fs.rm(manifest)
        got = real(fs_, where)
        if where.endswith(commit_mod.MANIFEST_NAME) and when != "before its read":
            fs.rm(manifest)
        return got

    monkeypatch.setattr(_s3, "get_object_and_etag", removed_around_the_read)
    with pytest.raises(CheckpointException) as info:
        dcp.save(make_state(2), storage_writer=FsspecStorageWriter(url, storage_options=opts, overwrite=True))
    error = unwrap(info.value)
    assert type(error) is CheckpointError and not isinstance(error, (CommitUncertain, CheckpointExists)), repr(error)
    assert "was removed while this save was committing" in str(error) and url in str(error), error
    fs.invalidate_cache(url)
    assert not fs.exists(manifest)  # nothing committed


def test_an_overwrite_killed_after_its_swap_leaves_stock_readers_no_copy_of_the_replaced_generation(
    tmp_path: Path,
) -> None:
    """A save overwriting a committed ``format="torch_save"`` checkpoint is SIGKILLed right after its
    manifest replaced the old one (before step 5). Before: the stock ``.metadata`` copy still described
    the replaced generation, whose files were still there, so stock ``dcp.load`` silently loaded the OLD
    values while smpckpt loaded the committed new ones (verify only warned). Now the overwrite removes
    that copy before its swap: a stock reader fails loudly, smpckpt is unaffected."""
    url = str(tmp_path / "t")
    code = (
        "import os, signal, sys\n"
        "import torch.distributed.checkpoint as dcp\n"
        "from storage_helpers import make_state\n"
        "from smpckpt.storage import FsspecStorageWriter\n"
        "from smpckpt.storage.backends._folder import Folder\n"
        "url = sys.argv[1]\n"
        "dcp.save(make_state(0), storage_writer=FsspecStorageWriter(url, format='torch_save'))\n"
        "real = Folder.replace_if\n"
        "def killed_after_the_swap(self, *a, **kw):\n"
        "    real(self, *a, **kw)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "Folder.replace_if = killed_after_the_swap\n"
        "w = FsspecStorageWriter(url, format='torch_save', overwrite=True)\n"
        "dcp.save(make_state(1), storage_writer=w)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code, url], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    new, old = make_state(1), make_state(0)
    assert_state_equal(new, roundtrip_load(new, url))  # smpckpt follows the manifest: the new generation
    old_names = {n for n in os.listdir(url) if n.startswith(".metadata.")}
    assert len(old_names) == 2  # the replaced generation's files are still there (killed before step 5)
    stock = Path(url, ".metadata")
    assert not stock.exists() or read_manifest(url).metadata.matches(stock.read_bytes())
    assert not any("differs" in w for w in verify_checkpoint(url).warnings)
    assert not torch.equal(old["model"]["w"], new["model"]["w"])
    got = {"model": {"w": torch.zeros_like(new["model"]["w"])}}
    try:  # the stock reader: an error, or the committed values; never the replaced generation's
        dcp.load(got, checkpoint_id=url)
    except (Exception, CheckpointException):  # noqa: BLE001 - loud is right (DCP raises a BaseException)
        return
    assert torch.equal(got["model"]["w"], new["model"]["w"]), "stock dcp.load read the replaced generation"


# -- row 9: one owner for the part sizes; 8 MiB honoured, below S3's minimum refused ----------------------
def test_part_size_is_honoured_or_refused_never_clamped(s3: tuple[str, dict[str, Any]], monkeypatch: Any) -> None:
    from smpckpt.storage.backends import _s3, _sinks
    from smpckpt.storage.write import _base

    assert _base.MIN_PART_SIZE is _sinks.MIN_PART_SIZE == 5 << 20
    with pytest.raises(ValueError, match="part_size"):
        FsspecStorageWriter("/tmp/x", part_size=4 << 20)
    base, opts = s3
    sizes: list[int] = []
    real = _s3.S3MultipartSink._upload_part

    async def recording(self: Any, number: int, body: Any, buf: Any) -> str:
        sizes.append(len(body))
        return await real(self, number, body, buf)

    monkeypatch.setattr(_s3.S3MultipartSink, "_upload_part", recording)
    state = {"w": torch.arange(5 << 20, dtype=torch.float32)}  # 20 MiB: one file, 3 parts of 8 MiB at most
    url = f"{base}/parts"
    writer = FsspecStorageWriter(url, storage_options=opts, part_size=8 << 20, object_file_size=0, thread_count=1)
    dcp.save(state, storage_writer=writer)
    assert sizes == [8 << 20, 8 << 20, 4 << 20], sizes
    assert torch.equal(roundtrip_load(state, url, opts)["w"], state["w"])


def test_a_commit_that_sees_a_removal_and_cannot_withdraw_says_so(tmp_path: Path, monkeypatch: Any) -> None:
    """rev64e F3: the commit saw a removal's mark, then reading back its manifest to withdraw it failed: that
    was a CommitUncertain ("whether a removal started could not be checked ... `smpckpt ls` tells"), though the
    removal was seen and `ls` may list the manifest of a folder being removed. Now it says so."""
    from smpckpt.storage.backends._folder import Folder
    from smpckpt.storage.format.commit import CommitUncertain

    real_exists, real_read = Folder.exists, Folder.read
    marked: list[bool] = []

    def exists(self: Folder, name: str) -> bool:
        if name == commit_mod.REMOVING_NAME and real_exists(self, commit_mod.MANIFEST_NAME):
            marked.append(True)  # a removal marked the folder just as the manifest landed
            return True
        return real_exists(self, name)

    def read(self: Folder, name: str) -> bytes | None:
        if marked and name == commit_mod.MANIFEST_NAME:
            raise OSError(5, "injected: the manifest read failed")
        return real_read(self, name)

    monkeypatch.setattr(Folder, "exists", exists)
    monkeypatch.setattr(Folder, "read", read)
    with pytest.raises(CheckpointException) as info:
        dcp.save(make_state(2), storage_writer=FsspecStorageWriter(str(tmp_path / "t")), no_dist=True)
    err = unwrap(info.value)
    assert isinstance(err, CheckpointError) and not isinstance(err, CommitUncertain), repr(err)
    assert "withdrawing this commit failed" in str(err) and "injected" in str(err), err


def test_a_save_killed_writing_its_manifest_without_hard_links_never_blocks_its_folder(tmp_path: Path) -> None:
    """A filesystem without hard links (``link`` refused with EPERM: some FUSE mounts) took the manifest's
    create-only fallback: created in place, so a save SIGKILLed between that create and its write left an
    empty manifest, the folder ``corrupt`` for good (prune never removes one) and every later save into it
    refused (``CheckpointCorrupt``: "smpckpt.manifest.json is malformed") -- a killed save never blocks
    its tag. Now the whole temporary is renamed into place. Killed at the 1st and the 2nd write of a
    manifest (its temporary, then main's in-place manifest), in children forked by one subprocess."""
    code = (
        "import errno, os, signal, sys\n"
        "import torch.distributed.checkpoint as dcp\n"
        "from storage_helpers import make_state\n"
        "from smpckpt.storage import FsspecStorageWriter\n"
        "def no_link(*a, **k):\n"
        "    raise OSError(errno.EPERM, 'no hard links here')\n"
        "for kth, url in enumerate(sys.argv[1:], 1):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        os.link, real, seen = no_link, os.write, []\n"
        "        def write(fd, data):\n"
        "            if 'smpckpt.manifest.json' in os.readlink(f'/proc/self/fd/{fd}'):\n"
        "                seen.append(fd)\n"
        "                if len(seen) == kth:\n"
        "                    os.kill(os.getpid(), signal.SIGKILL)\n"
        "            return real(fd, data)\n"
        "        os.write = write\n"
        "        dcp.save(make_state(0), storage_writer=FsspecStorageWriter(url))\n"
        "        os._exit(0)\n"
        "    os.waitpid(pid, 0)\n"
    )
    urls = [str(tmp_path / f"k{k}") for k in (1, 2)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code, *urls], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    new = make_state(1)
    for url in urls:  # a killed save is uncommitted (or, not killed, committed): a retry commits beside it
        if checkpoint_state(url) == "uncommitted":
            dcp.save(new, storage_writer=FsspecStorageWriter(url))
            assert_state_equal(new, roundtrip_load(new, url))
        else:
            assert checkpoint_state(url) == "committed" and verify_checkpoint(url).ok, url


def test_without_links_or_renameat2_a_manifest_landing_during_a_publication_is_never_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rev68d F1: links refused and ``renameat2`` too, a publication fell back to a check then ``rename``:
    another save's manifest landing between the two was replaced, both saves reporting success. Now an
    exclusive create in place. The other save lands at the worst moment for either: right after the check,
    or right before the create."""
    import fsspec

    from smpckpt.storage.backends import _nofollow as nf
    from smpckpt.storage.backends._folder import Folder

    def no_link(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EPERM, "no hard links here")

    real_stat, real_open = os.stat, os.open

    def land() -> None:
        (tmp_path / "m.json").write_bytes(b"theirs")

    def stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if path == "m.json" and not (tmp_path / "m.json").exists():
            land()  # after the check found nothing
            raise FileNotFoundError(errno.ENOENT, "not there yet", path)
        return real_stat(path, *args, **kwargs)

    def open_(path: Any, *args: Any, **kwargs: Any) -> int:
        if path == "m.json" and not (tmp_path / "m.json").exists():
            land()  # just before the create
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "link", no_link)
    monkeypatch.setattr(nf, "_renameat2", None)
    monkeypatch.setattr(os, "stat", stat)
    monkeypatch.setattr(os, "open", open_)
    with Folder(fsspec.filesystem("file"), str(tmp_path)) as folder:
        with pytest.raises(FileExistsError, match="m.json"):
            folder.publish("m.json", b"ours", sync=False)
    monkeypatch.undo()
    assert (tmp_path / "m.json").read_bytes() == b"theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]  # no temporary left

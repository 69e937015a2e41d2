"""The commit lists only files that are there: a data file removed (or cut short) between its write and
the commit fails the save instead of committing a checkpoint whose data is gone (a ``prune
--uncommitted-older-than`` with too short an age, running beside a save)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from storage_helpers import make_state, unwrap
from torch.distributed.checkpoint.api import CheckpointException

from smpckpt.errors import CheckpointError
from smpckpt.storage import FsspecStorageWriter, checkpoint_state


class _Pruned(FsspecStorageWriter):
    """Something removes (or truncates) one data file of this save just before its commit."""

    def __init__(self, *args: Any, damage: str, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.damage = damage

    def finish(self, metadata: Any, results: Any) -> None:
        folder = self.path
        name = sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))[0]
        if self.damage == "remove":
            os.remove(os.path.join(folder, name))
        else:
            with open(os.path.join(folder, name), "r+b") as f:
                f.truncate(10)
        super().finish(metadata, results)


@pytest.mark.parametrize("damage", ["remove", "truncate"])
def test_a_data_file_gone_before_the_commit_fails_the_save(tmp_path: Path, damage: str) -> None:
    url = str(tmp_path / "c")
    with pytest.raises(CheckpointException) as info:
        dcp.save(make_state(), storage_writer=_Pruned(url, damage=damage))
    err = unwrap(info.value)
    assert isinstance(err, CheckpointError)
    assert "missing or cut short at the commit" in str(err) and "nothing was committed" in str(err)
    assert checkpoint_state(url) == "uncommitted"


def test_two_overwrites_of_one_manifest_on_local_disk_never_both_succeed(tmp_path: Path) -> None:
    """rev68f F1: an overwrite compared the manifest and renamed its own into place with nothing held
    between: two processes' overwrites of one tag both read the old manifest, both renamed, both reported
    success (the earlier one's checkpoint silently replaced). Compared and renamed under the folder's
    ``flock`` now: the second sees the first's manifest and is refused. Two ``Folder`` opens stand for the
    two processes (``flock`` excludes across opens, in one process too)."""
    import threading

    import fsspec

    from smpckpt.storage.backends._folder import Folder

    fs = fsspec.filesystem("file")
    (tmp_path / "m.json").write_bytes(b"old")
    inside, go, results = threading.Event(), threading.Event(), {}
    with Folder(fs, str(tmp_path)) as first, Folder(fs, str(tmp_path)) as second:
        publish = first.publish

        def held_publish(*args: Any, **kwargs: Any) -> None:  # the first is between its compare and rename
            inside.set()
            go.wait(10)
            publish(*args, **kwargs)

        first.publish = held_publish  # type: ignore[method-assign]

        def overwrite(folder: Folder, data: bytes) -> None:
            try:
                folder.replace_if("m.json", data, b"old", sync=False)
                results[data] = "ok"
            except FileExistsError as exc:
                results[data] = f"refused: {exc}"

        a = threading.Thread(target=overwrite, args=(first, b"first"))
        a.start()
        assert inside.wait(10)
        b = threading.Thread(target=overwrite, args=(second, b"second"))
        b.start()
        b.join(0.5)  # (without the lock the second commits here, in the first's window)
        go.set()
        a.join(10)
        b.join(10)
    assert results[b"first"] == "ok" and results[b"second"].startswith("refused"), results
    assert (tmp_path / "m.json").read_bytes() == b"first"


class _TornBeforeUs(FsspecStorageWriter):
    """Another save's manifest, created in place and half written (the exclusive fallback where links and
    ``renameat2`` are refused), is there just before this save's commit."""

    def _write_manifest(self, data: bytes) -> None:
        with open(os.path.join(self.path, "smpckpt.manifest.json"), "xb") as f:
            f.write(data[: len(data) // 2])
        super()._write_manifest(data)


def test_a_commit_refused_by_an_unreadable_manifest_on_local_disk_removes_its_files_and_says_so(
    tmp_path: Path,
) -> None:
    """rev68h F1: such a refusal is certain on POSIX (not this save's manifest): it said "this save's files were
    removed" while it kept them, and named the torn manifest another save's committed checkpoint."""
    url = str(tmp_path / "c")
    with pytest.raises(CheckpointException) as info:
        dcp.save(make_state(), storage_writer=_TornBeforeUs(url))
    err = unwrap(info.value)
    assert isinstance(err, CheckpointError) and "a manifest in place, unreadable" in str(err), err
    assert sorted(os.listdir(url)) == ["smpckpt.manifest.json"]  # this save's data and metadata removed

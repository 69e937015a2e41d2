"""``prune --uncommitted-older-than AGE`` removes every kind of debris a kill leaves (issue 33 item 12),
never a committed checkpoint or a file one lists, and nothing written to within AGE."""

from __future__ import annotations

import io
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from smpckpt import save_checkpoint
from smpckpt.catalog.root import apply_retention
from smpckpt.storage import read_manifest, verify_checkpoint
from smpckpt.tools.cli import main

HOUR = 3600.0


def _age(path: Path, seconds: float) -> None:
    """Make everything under ``path`` look written ``seconds`` ago."""
    then = time.time() - seconds
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.utime(p, (then, then), follow_symlinks=False)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(6, 4)


def _debris(root: Path) -> dict[str, Path]:
    """A root holding one of each kind of debris, all of it two hours old."""
    save_checkpoint(str(root), "a", model=_model())
    save_checkpoint(str(root), "f", partial=False, model=_model())
    part = root / "a_partial"
    manifest = read_manifest(str(part))
    data = next(p for p in part.iterdir() if p.name.endswith(".smp.distcp"))
    dead = part / data.name.replace(manifest.save_id, "0123456789abcdef")
    shutil.copy(data, dead)  # a killed save's file beside the committed generation
    dead_md = part / ".metadata.0123456789abcdef"
    dead_md.write_bytes(b"x")
    killed_full = root / "g"
    killed_full.mkdir()
    (killed_full / "smpckpt.writing").write_bytes(b"killed\n3")
    (killed_full / "model.safetensors").write_bytes(b"\0" * 64)
    stale_marker = root / "f" / "smpckpt.writing"
    stale_marker.write_bytes(b"gone\n9")
    temp = root / "newest.tmp.123.abcd1234"
    temp.write_text("a")
    # issue 42: temporary files inside committed folders (an interrupted publication, a transfer), a folder
    # holding only a marker's temporary file, a killed full save's staging folder
    inner_temp = part / "smpckpt.manifest.json.tmp.77.0badf00d"
    inner_temp.write_text("{")
    recv = part / (data.name + ".recv.78.feedbeef")
    recv.write_bytes(b"half")
    full_temp = root / "f" / ".metadata.tmp.79.cafe0123"
    full_temp.write_bytes(b"x")
    marker_temp_only = root / "h"
    marker_temp_only.mkdir()
    (marker_temp_only / "smpckpt.writing.tmp.80.12345678").write_bytes(b"killed\n0")
    staging = root / ".smpckpt-staging.18c1f0000abcdef0"
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"\0" * 64)
    (staging / "smpckpt.manifest.json").write_bytes(b"{}")  # killed between its manifest and its rename
    found = {
        "dead": dead,
        "dead_md": dead_md,
        "killed_full": killed_full,
        "marker": stale_marker,
        "temp": temp,
        "inner_temp": inner_temp,
        "recv": recv,
        "full_temp": full_temp,
        "marker_temp_only": marker_temp_only,
        "staging": staging,
    }
    for p in found.values():
        _age(p, 2 * HOUR)
    return found


def test_prune_removes_every_kind_of_debris_and_nothing_else(tmp_path: Path) -> None:
    found = _debris(tmp_path)
    dry = apply_retention(str(tmp_path), None, uncommitted_older_than=HOUR, dry_run=True)
    assert len(dry.removed_debris) == len(found) and all(p.exists() for p in found.values())
    out = io.StringIO()
    assert main(["prune", str(tmp_path), "--uncommitted-older-than", "1h"], stdout=out) == 0
    assert out.getvalue().count("(debris of a killed save)") == len(found), out.getvalue()
    assert not any(p.exists() for p in found.values())
    # what is committed is whole, and the tags the debris held are free
    assert verify_checkpoint(str(tmp_path / "a_partial")).ok and verify_checkpoint(str(tmp_path / "f")).ok
    save_checkpoint(str(tmp_path), "h", partial=False, model=_model())
    assert verify_checkpoint(str(tmp_path / "h")).ok


def test_debris_written_to_within_the_age_stays(tmp_path: Path) -> None:
    found = _debris(tmp_path)
    for p in found.values():
        _age(p, 60)  # a minute ago: a save may be running
    result = apply_retention(str(tmp_path), None, uncommitted_older_than=HOUR)
    assert result.removed_debris == () and all(p.exists() for p in found.values())


def test_a_save_folder_made_moments_ago_with_no_file_yet_is_not_stale(tmp_path: Path) -> None:
    """A save that has made its folder (and a subfolder) and written no file yet is written to within AGE
    (rev62f P1: "would remove fresh (uncommitted, stale)" under 6h); aged, the same folder is stale. On S3 a
    prefix with no object has no time: there it stays stale at any age (README, prune)."""
    save_checkpoint(str(tmp_path), "a", model=_model())
    (tmp_path / "fresh_partial" / "sub").mkdir(parents=True)
    out = io.StringIO()
    assert main(["prune", str(tmp_path), "--uncommitted-older-than", "6h", "--dry-run"], stdout=out) == 0
    assert out.getvalue().strip() == "nothing to remove"
    _age(tmp_path / "fresh_partial", 7 * HOUR)
    out = io.StringIO()
    assert main(["prune", str(tmp_path), "--uncommitted-older-than", "6h", "--dry-run"], stdout=out) == 0
    assert out.getvalue().strip() == "would remove fresh (uncommitted, stale)"


def test_a_dead_folder_whose_removal_stopped_midway_stays_stale(tmp_path: Path) -> None:
    """rev62j F1: folder times counted for every folder, so a 7-hour-old dead save whose removal unlinked one
    file and then failed (or was cut short) looked written to just now: never retried for another AGE."""
    save_checkpoint(str(tmp_path), "a", model=_model())
    dead = tmp_path / "dead_partial"
    dead.mkdir()
    for name in ("x.distcp", "y.distcp"):
        (dead / name).write_bytes(b"0" * 16)
    _age(dead, 7 * HOUR)
    (dead / "x.distcp").unlink()  # the removal's first unlink bumps the folder's own time; y stays
    out = io.StringIO()
    assert main(["prune", str(tmp_path), "--uncommitted-older-than", "6h", "--dry-run"], stdout=out) == 0
    assert out.getvalue().strip() == "would remove dead (uncommitted, stale)"


def test_a_local_removal_cut_short_keeps_its_mark_and_the_next_save_retries_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rev62j F2: on local disk the removal's mark went in directory order, not last, so retention that could
    not remove one file of its victim left an unmarked, uncommitted folder no later save retried (the README:
    "retried by the next save"); object stores already removed the mark last."""
    from smpckpt.catalog.root import scan_root

    save_checkpoint(str(tmp_path), "a", model=_model())
    victim = sorted(p.name for p in (tmp_path / "a_partial").iterdir() if p.name.endswith(".distcp"))[-1]
    real = os.unlink

    def refuse_once(path: Any, *args: Any, **kwargs: Any) -> None:
        if os.fspath(path) == victim and not refused:
            refused.append(path)
            raise PermissionError(1, "refused", path)
        real(path, *args, **kwargs)

    refused: list[Any] = []
    monkeypatch.setattr(os, "unlink", refuse_once)
    save_checkpoint(str(tmp_path), "b", model=_model(), num_kept_partial_checkpoints=1)
    assert refused and {r.tag: r.state for r in scan_root(str(tmp_path))}["a"] == "removing"
    save_checkpoint(str(tmp_path), "c", model=_model(), num_kept_partial_checkpoints=1)
    assert not (tmp_path / "a_partial").exists()


def test_a_removal_takes_a_file_appearing_after_its_listing_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rev62k F1: a racing commit's manifest written after the removal listed the folder was left beside no
    mark (the mark went once the listed files had), so the commit's own check of the mark found none and
    reported a checkpoint whose files were gone. Then the mark stayed beside it (rev64e F1: a save killed
    there left manifest + mark, listed committed, counted by retention). Now the folder is listed again before
    the mark goes and what appeared goes too; a commit still running finds its files gone (step 4) and fails."""
    from smpckpt.catalog.root import scan_root
    from smpckpt.storage.backends._fs import open_fs
    from smpckpt.storage.format.commit import remove_folder

    save_checkpoint(str(tmp_path), "a", model=_model())
    folder = tmp_path / "a_partial"
    manifest = (folder / "smpckpt.manifest.json").read_bytes()
    (folder / "smpckpt.manifest.json").unlink()  # the racing save: its files written, its manifest not yet
    real = os.unlink

    def commit_lands(name: Any, *args: Any, **kwargs: Any) -> None:
        if not landed and str(name).endswith(".distcp"):  # the removal has listed the folder
            landed.append(1)
            (folder / "smpckpt.manifest.json").write_bytes(manifest)
        real(name, *args, **kwargs)

    landed: list[int] = []
    monkeypatch.setattr(os, "unlink", commit_lands)
    fs, path = open_fs(str(folder))
    failed = remove_folder(fs, path, str(folder), uncommitted_only=True)
    assert landed and not failed and not folder.exists()
    assert not any(r.committed for r in scan_root(str(tmp_path)))


def test_retention_never_removes_a_save_that_finished_a_removal_after_its_scan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rev65a F2 (HIGH): retention scanned ``s2_partial`` holding only an interrupted removal's mark
    ("removing"); before it acted, a save of s2 finished that removal itself and committed; retention then
    removed s2 as partly removed, with no look for a manifest. Now it finds the commit and leaves it."""
    import threading

    from smpckpt import resume_from_checkpoint
    from smpckpt.catalog import root as catalog

    model = _model()
    save_checkpoint(str(tmp_path), "s0", model=model)
    (tmp_path / "s2_partial").mkdir()
    (tmp_path / "s2_partial" / "smpckpt.removing").write_bytes(b"removing\n")
    scanned, go = threading.Event(), threading.Event()
    real_scan = catalog.scan_root

    def scan_root(*args: Any, **kwargs: Any) -> Any:
        records = real_scan(*args, **kwargs)
        scanned.set()
        assert go.wait(60)
        return records

    monkeypatch.setattr(catalog, "scan_root", scan_root)
    results: list[Any] = []
    retention = threading.Thread(target=lambda: results.append(apply_retention(str(tmp_path), 5)))
    retention.start()
    assert scanned.wait(60)
    with torch.no_grad():
        model.weight.add_(1)
    save_checkpoint(str(tmp_path), "s2", model=model)
    go.set()
    retention.join(60)
    assert results and "s2" not in results[0].removed, results
    fresh = _model()
    resume_from_checkpoint(str(tmp_path), "s2", model=fresh)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())


def test_an_age_without_its_unit_is_refused_unless_zero() -> None:
    # hunt73c F4 (older): "6" was 6 seconds (the help's example is "6h"), and "6M" 6 minutes (months?): a prune
    # meant to take debris older than 6 hours took any folder left unwritten for 6 seconds, a slow save's too
    import argparse

    from smpckpt.tools.cli import duration

    for text in ("6", "1.5", "6M"):
        with pytest.raises(argparse.ArgumentTypeError, match="unit"):
            duration(text)
    ages = [duration(t) for t in ("0", "90s", "30m", "6h", "6H", "2d")]
    assert ages == [0.0, 90.0, 1800.0, 6 * HOUR, 6 * HOUR, 48 * HOUR]
    err = io.StringIO()
    with pytest.raises(SystemExit):
        main(["prune", "/nonexistent-h73c", "--uncommitted-older-than", "6"], stderr=err)

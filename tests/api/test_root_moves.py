"""A root link whose run folder moves (``mv run_a run_b; ln -sfn run_b root``, a second mount): the same run at a
new folder key goes on with its history (a roll-back included); a link re-pointed at another run's folder starts
afresh there (README, "The Checkpointer"). One process, no spawn."""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from root_jobs_workers import model

import smpckpt.api._fast_save as fast_save_module
import smpckpt.api._save as save_module
from smpckpt import Checkpointer, FastTier, Retention, last_resume_info
from smpckpt.catalog.root import scan_root
from smpckpt.errors import CheckpointError
from smpckpt.storage import MANIFEST_NAME


def _committed(root: str) -> dict[str, Any]:
    return {r.tag: r for r in scan_root(root) if r.committed}


def _repoint(link: Path, folder: Path) -> None:
    """``ln -sfn folder link`` (one rename: the link never misses)."""
    tmp = link.with_name(link.name + ".new")
    tmp.symlink_to(folder)
    os.replace(tmp, link)


@pytest.mark.parametrize("how", ["moved", "copied", "another-run", "another-run-of-this-job"])
def test_a_run_folder_moved_under_its_link_keeps_the_roll_back(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any, how: str
) -> None:
    """rev72o M1 (a regression of fix72o): one Checkpointer on 'root' -> run_a, keeping 3, saves s1, s2, s3 and
    resumes s1 by tag (a roll-back); then run_a is moved to run_b and 'root' re-pointed at it (``copied``: a copy of
    run_a, the same run at a second key as a second mount of it would be). s4 goes on from s1: it records s2, s3 as abandoned, and
    retention keeps s1 (its parent). Before: numbered afresh there (warned), s4 recorded nothing, and retention
    removed s1 and kept the abandoned s2, s3. ``another-run``: 'root' re-pointed at run_c, another job's folder (its
    c1): still afresh (c1 kept as abandoned, warned). ``another-run-of-this-job``: run_c holds a save of this very
    process (another Checkpointer's, same job key) whose tag and number match s3's: not this run's (its save id
    differs): afresh, c-s3 kept."""
    run_a, link = tmp_path / "run_a", tmp_path / "root"
    run_a.mkdir()
    link.symlink_to(run_a)
    m, o = model()
    keep3 = Retention(num_kept_partial_checkpoints=3)
    run_c = tmp_path / "run_c"
    if how == "another-run":
        monkeypatch.setattr(save_module, "job_token", lambda: "other")
        with Checkpointer(str(run_c)) as theirs:
            theirs.save("c1", m, o)
        monkeypatch.undo()
    elif how == "another-run-of-this-job":
        with Checkpointer(str(run_c)) as mine:
            for tag in ("c1", "c2", "s3"):
                mine.save(tag, m, o)
    with Checkpointer(str(link), retention=keep3) as ckpt:
        for tag in ("s1", "s2", "s3"):
            ckpt.save(tag, m, o)
        s1 = {k: v.clone() for k, v in m.state_dict().items()}
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)
        ckpt.resume("s1", model=m, optimizer=o)
        assert all(torch.equal(v, s1[k]) for k, v in m.state_dict().items())
        if how == "moved":
            run_a.rename(tmp_path / "run_b")
            _repoint(link, tmp_path / "run_b")
        elif how == "copied":  # the same run at a second key, as a second mount of it would be
            shutil.copytree(run_a, tmp_path / "run_b", symlinks=True)
            _repoint(link, tmp_path / "run_b")
        else:
            _repoint(link, run_c)
        caplog.set_level(logging.WARNING)
        ckpt.save("s4", m, o)
    afresh = [r.getMessage() for r in caplog.records if "numbered afresh" in r.getMessage()]
    got = _committed(str(link))
    if how in ("moved", "copied"):
        assert not afresh, afresh
        assert got["s4"].extra.get("abandoned") == [[2, 3]], got["s4"].extra
        assert got["s4"].order[0] == 4
        assert sorted(got) == ["s1", "s2", "s3", "s4"]  # before: ['s2', 's3', 's4'] (s1, the parent, removed)
    elif how == "another-run":
        assert len(afresh) == 1, afresh
        assert sorted(got) == ["c1", "s4"] and got["s4"].order[0] == 2, got
        assert got["s4"].extra.get("abandoned") == [[1, 1]], got["s4"].extra  # c1, another job's: kept, uncounted
        assert sorted(_committed(str(run_a))) == ["s1", "s2", "s3"]
    else:
        assert len(afresh) == 1, afresh
        assert got["s4"].order[0] == 4 and "abandoned" not in got["s4"].extra, got["s4"].extra
        assert sorted(got) == ["c2", "s3", "s4"]  # this job's own run_c, numbered on there (keeping 3)
        assert sorted(_committed(str(run_a))) == ["s1", "s2", "s3"]


def test_a_per_save_checkpointer_goes_on_from_a_resume_of_a_run_moved_since(tmp_path: Any) -> None:
    """The thread's resume (of s1, by tag, after s1..s3) through 'root' -> run_a; run_a moved to run_b and 'root'
    re-pointed; a Checkpointer built per save, keeping 2, saves s4: the same run, so it goes on from s1 (s2, s3
    abandoned, s1 kept). Before: the resume was matched by the folder key alone, so s4 numbered after s3 and
    retention removed s1."""
    run_a, link = tmp_path / "run_a", tmp_path / "root"
    run_a.mkdir()
    link.symlink_to(run_a)
    m, o = model()
    with Checkpointer(str(link)) as ckpt:
        for tag in ("s1", "s2", "s3"):
            ckpt.save(tag, m, o)
    with Checkpointer(str(link)) as ckpt:
        ckpt.resume("s1", model=m, optimizer=o)
    assert last_resume_info().tag == "s1"
    run_a.rename(tmp_path / "run_b")
    _repoint(link, tmp_path / "run_b")
    with Checkpointer(str(link), retention=Retention(num_kept_partial_checkpoints=2)) as each:
        each.save("s4", m, o)
    got = _committed(str(link))
    assert got["s4"].extra.get("abandoned") == [[2, 3]], got["s4"].extra
    assert sorted(got) == ["s1", "s2", "s3", "s4"]


@pytest.mark.parametrize("every", [2, 3])
@pytest.mark.parametrize("how", ["moved", "another-run"])
def test_a_tiered_checkpointer_after_the_move_neither_drains_nor_mourns_the_old_folders_saves(
    tmp_path: Any, caplog: Any, how: str, every: int
) -> None:
    """rev72o L3: a tiered Checkpointer (durable_every ``every``, num_kept_local=2) on 'root' -> run_a saves s1, s2,
    s3 (s2 or s3 drained there); then run_a is moved under the link (``moved``) or the link re-pointed at an empty
    run_c (``another-run``), and it saves s4, s5, s6. Before, after a re-point its fast tier forgot what it had
    drained: with every=2 retention removed s2 warning it "never reached" path (it had, run_a's), with every=3 s4
    drained s3 again into run_c (the old folder's save in the new one). Now the old folder's drained saves are
    neither due in the new one nor mourned; the moved run goes on in its folder."""
    run_a, link, fast = tmp_path / "run_a", tmp_path / "root", tmp_path / "fast"
    run_a.mkdir()
    link.symlink_to(run_a)
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    tier = FastTier(str(fast), replicas=1, durable_every=every, num_kept_local=2)
    caplog.set_level(logging.INFO)
    with Checkpointer(str(link), fast_tier=tier) as ckpt:
        for tag in ("s1", "s2", "s3"):
            ckpt.save(tag, m)
        ckpt.wait()
        old = sorted(_committed(str(run_a)))
        assert old == (["s2"] if every == 2 else ["s3"]), old
        new = tmp_path / ("run_b" if how == "moved" else "run_c")
        if how == "moved":
            run_a.rename(new)
        else:
            new.mkdir()
        _repoint(link, new)
        caplog.clear()
        for tag in ("s4", "s5", "s6"):
            ckpt.save(tag, m)
        ckpt.wait()
    mourned = [r.getMessage() for r in caplog.records if "never reached" in r.getMessage()]
    assert not mourned, mourned  # before (another-run, every=2): s2 "never reached" path
    got = sorted(_committed(str(new)))
    drained = ["s4", "s6"] if every == 2 else ["s6"]
    if how == "moved":
        assert got == sorted(old + drained), got
    else:
        assert got == drained, got  # before (every=3): ['s3', 's6'], run_a's s3 drained again into run_c
        assert sorted(_committed(str(run_a))) == old


def test_a_drain_running_while_the_link_is_re_pointed_commits_nowhere_and_the_fast_tier_keeps_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rev72o L6: a tiered save's drain to 'root' -> run_a is still running when 'root' is re-pointed at another
    run's folder run_c. Before, it went on through the link and committed run_a's save s1 in run_c (and pointed
    run_c's newest at it). Now its commit is refused by name (the folder is not the one its save was planned for;
    raised by wait()): nothing committed in run_c, no file of it left there, and the fast tier keeps s1 whole."""
    run_a, run_c, link, fast = tmp_path / "run_a", tmp_path / "run_c", tmp_path / "root", tmp_path / "fast"
    run_a.mkdir()
    run_c.mkdir()
    link.symlink_to(run_a)
    started, go = threading.Event(), threading.Event()
    real = fast_save_module.drain

    def held(*args: Any, **kwargs: Any) -> None:
        started.set()
        go.wait(timeout=60)
        real(*args, **kwargs)

    monkeypatch.setattr(fast_save_module, "drain", held)
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    ckpt = Checkpointer(str(link), fast_tier=FastTier(str(fast), replicas=1, durable_every=1))
    try:
        ckpt.save("s1", m)
        assert started.wait(timeout=60)
        _repoint(link, run_c)
        go.set()
        with pytest.raises(CheckpointError, match=r"re-pointed .*'s1'.* not committed"):
            ckpt.wait()
    finally:
        go.set()
        ckpt.close()
    assert _committed(str(run_c)) == {} and not any(run_c.iterdir()), list(run_c.iterdir())  # before: s1 in run_c
    assert _committed(str(run_a)) == {}
    (job,) = [p for p in fast.iterdir() if p.is_dir()]
    assert (job / "s1_partial" / MANIFEST_NAME).is_file()  # committed in the fast tier: drained again later

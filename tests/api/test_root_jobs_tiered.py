"""Two jobs saving into one root, one of them through a fast tier (README, "The Checkpointer"): a tiered job's
tag-less resume refuses another job's checkpoint it never saw, in ``path`` or in a fast tier both jobs share, as
a plain Checkpointer's does; its own newer copies and a restart's resume are never refused. The other job is a
real second process (its own identity, ``extra["job"]``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_world
from root_jobs_workers import model, other_job, refused_tiered_resume_world, stepped_job, tiered_job
from torch import nn

from smpckpt import Checkpointer, FastTier, resume_from_checkpoint
from smpckpt.catalog.root import newest_tag, scan_root
from smpckpt.errors import RootInUse


def _state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


def _same(m: nn.Module, state: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, state[k]) for k, v in m.state_dict().items())


def _saved(root: str, tag: str) -> dict[str, torch.Tensor]:
    """The model state of ``root``'s checkpoint ``tag``, loaded by a plain resume."""
    n, p = model()
    resume_from_checkpoint(root, tag, model=n, optimizer=p)
    return _state(n)


@pytest.mark.parametrize("shared", [False, True])
def test_a_tiered_jobs_tag_less_resume_refuses_the_other_jobs_checkpoint(tmp_path: Any, shared: bool) -> None:
    """rev69k: A (tiered) saved s1, drained; B saved t1 into the same path (``shared``: through a fast tier in the
    same local_path, so t1 is in A's fast-tier folder too). Before: A's tag-less resume loaded t1, B's state,
    silently (from path, or from the fast tier). Now it is refused as a plain Checkpointer's is (RootInUse, naming
    t1 and A's last save), before any state is applied, and A's next save is still refused; tag='t1' takes it,
    tag='s1' brings A's own back, bit-exact."""
    root, fast = str(tmp_path / "run"), str(tmp_path / "fast")
    m, o = model()
    with Checkpointer(root, fast_tier=FastTier(fast, replicas=1)) as a:
        a.save("s1", m, o)
        a.wait()
        s1 = _state(m)
        other_job(root, "t1", fast=fast if shared else None)
        t1 = _saved(root, "t1")
        assert not _same(m, t1)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)
        before = _state(m)
        with pytest.raises(RootInUse, match="'t1' .sequence 2.* last save 's1' .sequence 1.*this resume is refused"):
            a.resume(model=m, optimizer=o)  # before: took t1
        assert _same(m, before)
        with pytest.raises(RootInUse, match="'t1' .sequence 2.*this save is refused"):
            a.save("s2", m, o)  # the refused resume noted nothing: B's t1 is still unseen
        a.resume("t1", model=m, optimizer=o)  # by tag: taken deliberately
        assert _same(m, t1)
        a.resume("s1", model=m, optimizer=o)
        assert _same(m, s1)
    assert sorted(r.tag for r in scan_root(root) if r.committed) == ["s1", "t1"]


@pytest.mark.dist
def test_every_rank_of_a_tiered_job_gets_the_resume_refusal(tmp_path: Any) -> None:
    """Two ranks of one node: rank 0's counter decides, every rank raises RootInUse with the same words (no hang,
    no "rank 0 failed"), nothing applied."""
    got = run_world(refused_tiered_resume_world, 2, str(tmp_path / "run"), str(tmp_path / "fast"), timeout=180)
    assert got[0]["error"] is not None and "'t1' (sequence 2)" in got[0]["error"], got
    assert "this resume is refused" in got[0]["error"] and got[1]["error"] == got[0]["error"], got
    assert got[0]["unchanged"] and got[1]["unchanged"], got


def test_a_tiered_restarts_tag_less_resume_takes_its_predecessors_and_then_its_own(tmp_path: Any) -> None:
    """A legitimate restart (a new process, path's newest and the fast tier's its predecessor's) is never refused:
    it resumes a2 tag-less, saves b1 and b2 (b2 in the fast tier only), and its tag-less resume takes b2."""
    root, fast = str(tmp_path / "run"), str(tmp_path / "fast")
    tiered_job(root, fast, {})  # a1, a2 (a2 drained)
    a2 = _saved(root, "a2")
    m, o = model()
    with Checkpointer(root, fast_tier=FastTier(fast, replicas=1, durable_every=2)) as b:
        b.resume(model=m, optimizer=o)
        assert b.last_resume_info is not None and b.last_resume_info.tag == "a2" and _same(m, a2)
        b.save("b1", m, o)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)
        b.save("b2", m, o)  # (durable_every=2: b1 stays in the fast tier)
        b.wait()
        b2 = _state(m)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)
        b.resume(model=m, optimizer=o)
        assert b.last_resume_info is not None and b.last_resume_info.tag == "b2" and _same(m, b2)


def test_a_tiered_restart_loads_its_own_newer_fast_copy_over_its_predecessors_late_save(
    tmp_path: Any, caplog: Any
) -> None:
    """B, a tiered restart, resumed A's a1; B saved b1 (fast tier only); A, still running, committed a2 into path
    (numbered 2, as b1 is); B saved b2 (fast tier only), abandoning a2. B's tag-less resume loads its own b2 from
    the fast tier, bit-exact, refusing nothing (a2, path's newest, is another job's but below B's b2)."""
    root, fast = str(tmp_path / "run"), str(tmp_path / "fast")
    a = stepped_job(root, "a1,a2")
    try:
        assert a.stdout is not None and a.stdin is not None
        assert a.stdout.readline().strip() == "saved a1"
        m, o = model()
        with Checkpointer(root, fast_tier=FastTier(fast, replicas=1, durable_every=3)) as b:
            b.resume(model=m, optimizer=o)
            assert b.last_resume_info is not None and b.last_resume_info.tag == "a1"
            b.save("b1", m, o)
            a.stdin.write("go\n")
            a.stdin.close()
            assert a.wait(timeout=300) == 0
            assert newest_tag(root) == "a2"
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(1.0)
            caplog.set_level(logging.WARNING)
            b.save("b2", m, o)
            b2 = _state(m)
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(1.0)
            b.resume(model=m, optimizer=o)
            info = b.last_resume_info
            assert info is not None and info.tag == "b2" and info.tier == "fast" and _same(m, b2), info
    finally:
        a.kill() if a.poll() is None else None
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "'a2' (sequence 2) committed by the job this one replaced" in said, said


_PREDECESSOR = r"""
import sys, torch, warnings
from torch import nn
import smpckpt
warnings.simplefilter("ignore")
torch.manual_seed(1)
m = nn.Linear(4, 2)
o = torch.optim.AdamW(m.parameters(), lr=1e-2)
with smpckpt.Checkpointer(sys.argv[1], fast_tier=smpckpt.FastTier(sys.argv[2], replicas=1, durable_every=3)) as c:
    for i in range(1, 6):
        with torch.no_grad():
            m.weight.fill_(float(i))
        c.save(f"a{i}", m, o)
"""


def test_an_export_before_a_restarts_first_save_keeps_its_roll_back(tmp_path: Any) -> None:
    """rev70a: the predecessor saved a1..a5 (a3 in path, a4 and a5 in the fast tier only); the restart rolled back
    to a3, exported, then saved b1. The export's draw counted as the job's save, so b1 numbered past a3 only (5,
    a5's number) without a5's own copy, and recorded no roll-back: a later tag-less resume with b1 unusable took
    a5, a save the roll-back discarded. b1 numbers after a5 and records [4, 5] abandoned, as without the export."""
    import subprocess
    import sys

    root, fast = str(tmp_path / "run"), str(tmp_path / "fast")
    subprocess.run([sys.executable, "-c", _PREDECESSOR, root, fast], check=True, timeout=300)
    m, o = model()
    with Checkpointer(root, fast_tier=FastTier(fast, replicas=1, durable_every=4)) as b:  # b1 in the fast tier only
        b.resume("a3", model=m, optimizer=o)
        assert float(m.weight.flatten()[0]) == 3.0
        b.export("e1", str(tmp_path / "exp"), model=m, optimizer=o)
        with torch.no_grad():
            m.weight.fill_(100.0)
        b.save("b1", m, o)
        b.wait()
    manifest = next(
        json.loads(p.read_text()) for p in Path(fast).rglob("*manifest.json") if p.parent.name == "b1_partial"
    )
    assert manifest["extra"]["sequence"] == 6 and manifest["extra"].get("abandoned") == [[4, 5]]
    # b1's copy loses a file: the restart after it falls back past a4 and a5, which b1's roll-back discarded (its
    # record was read from complete copies only: a5 was loaded, rev70a L)
    next(p for p in Path(fast).rglob("*.distcp") if p.parent.name == "b1_partial").unlink()
    with Checkpointer(root, fast_tier=FastTier(fast, replicas=1, durable_every=4)) as c:
        c.resume(model=m, optimizer=o)
        assert c.last_resume_info is not None and c.last_resume_info.tag == "a3"
        assert torch.equal(m.weight, torch.full_like(m.weight, 3.0))


def test_an_old_disks_incomplete_copy_of_another_history_hides_nothing(tmp_path: Path) -> None:
    """rev70f: job 1 saved s1..s7 (s5 in path); job 2 rolled back to s5 and saved x (8, abandoning 6-7) on a disk
    then pulled; job 3 resumed path's s5 and saved t6, t7, never seeing x; the old disk came back with x missing a
    file. x's roll-back record (read from incomplete copies since rev70a L) dropped t6 and t7 and the restart
    loaded s5 with only "x is incomplete" said. An incomplete copy's record counts within its own history only."""
    import shutil

    from tier_helpers import job as job_folder
    from tier_helpers import linear, same

    root, fast = str(tmp_path / "run"), str(tmp_path / "fast")

    def tier() -> FastTier:
        return FastTier(local_path=fast, replicas=1, durable_every=5)

    with Checkpointer(root, fast_tier=tier()) as c:  # job 1: s1..s7, s5 drained
        for s in range(1, 8):
            c.save(f"s{s}", model=linear(s))
            c.wait()
    with Checkpointer(root, fast_tier=tier()) as c:  # job 2: rolls back to s5, saves x
        c.resume("s5", model=linear(0))
        c.save("x", model=linear(80))
        c.wait()
    shutil.copytree(job_folder(Path(fast), root) / "x_partial", tmp_path / "old_disk")
    shutil.rmtree(fast)  # the disk pulled: the fast tier lost
    t7 = linear(107)
    with Checkpointer(root, fast_tier=tier()) as c:  # job 3: path's s5, then t6, t7
        c.resume(model=linear(0))
        assert c.last_resume_info is not None and c.last_resume_info.tag == "s5"
        c.save("t6", model=linear(106))
        c.wait()
        c.save("t7", model=t7)
        c.wait()
    back = job_folder(Path(fast), root) / "x_partial"
    shutil.copytree(tmp_path / "old_disk", back)  # the old disk is back, x missing a data file
    next(back.rglob("*.distcp")).unlink()
    got = linear(7)
    with Checkpointer(root, fast_tier=tier()) as c:
        c.resume(model=got)
        assert c.last_resume_info is not None and c.last_resume_info.tag == "t7"
    assert same(got, t7)

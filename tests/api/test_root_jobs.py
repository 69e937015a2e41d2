"""Two jobs saving into one root (a sweep that forgot to vary ``path``, a second launch of a script while the
first still runs): the job behind is refused at its next save, naming the other's tag, and nothing is removed;
a restart that resumed saves on; two Checkpointers of one process into one root are one job (README, "The
Checkpointer"). The other job is a real second process (its own identity, ``extra["job"]``)."""

from __future__ import annotations

from typing import Any

import pytest
from dist_harness import run_world
from root_jobs_workers import model, other_job, refused_world
from torch import nn

from smpckpt import Checkpointer, FastTier, Location, Retention, SaveOptions, resume_from_checkpoint, save_checkpoint
from smpckpt.catalog.root import JOB_KEY, newest_tag, scan_root
from smpckpt.errors import RootInUse


def _committed(root: str, options: dict[str, Any] | None = None) -> list[str]:
    return [r.tag for r in scan_root(root, storage_options=options) if r.committed]


def _refused_naming_the_other(ckpt: Checkpointer, m: nn.Module, o: Any, root: str, other: str, mine: str) -> None:
    """Sync and async saves alike: refused at the call, before anything is written, naming both jobs' tags."""
    for options in (SaveOptions(), SaveOptions(async_save=True)):
        with pytest.raises(RootInUse) as refused:
            ckpt.save("s9", m, o, options=options)
        message = str(refused.value)
        for part in (root, f"{other!r}", "sequence 2", f"{mine!r}", "give each job its own path"):
            assert part in message, (part, message)


@pytest.mark.parametrize("where", ["local", "s3", "tiered"])
def test_a_second_job_saving_into_the_root_is_refused_at_the_next_save_and_nothing_is_removed(
    tmp_path: Any, request: pytest.FixtureRequest, where: str
) -> None:
    """Job A saves s1 (keeping 1); job B, a second launch that resumed nothing, saves t1 (keeping 1) into the
    same root. Before: B's retention removed A's s1, and A's next save went on (numbered after t1), removing t1
    in turn; a tag-less restart of either resumed the other's state. Now B keeps s1 as abandoned (with a
    warning naming it) and A's next save is refused, naming t1; nothing is removed, ``newest`` stays t1."""
    options: dict[str, Any] | None = None
    root = str(tmp_path / "run")
    if where == "s3":
        root, options = request.getfixturevalue("s3_root")
    tier = FastTier(str(tmp_path / "fast"), replicas=1) if where == "tiered" else None  # s1 drains to path
    m, o = model()
    keep = Retention(num_kept_partial_checkpoints=1)
    with Checkpointer(Location(root, storage_options=options), fast_tier=tier, retention=keep) as a:
        a.save("s1", m, o)
        a.wait()
        said = other_job(root, "t1", options=options)
        assert _committed(root, options) == ["s1", "t1"]  # before: ["t1"], B's retention removed A's s1
        assert "'s1'" in said and "kept as abandoned" in said, said
        _refused_naming_the_other(a, m, o, root, "t1", "s1")
    # a Checkpointer built per save (its first listing finds the job's own s1 below t1), smp's face alike
    where_ = Location(root, storage_options=options)
    with Checkpointer(where_) as b, pytest.raises(RootInUse, match="'t1' .sequence 2.* last save 's1' .sequence 1"):
        b.save("s9", m, o)
    with pytest.raises(RootInUse, match="'t1' .sequence 2.* last save 's1' .sequence 1"):
        save_checkpoint(where_, "s9", model=m, optimizer=o)
    assert _committed(root, options) == ["s1", "t1"]
    assert [r.tag for r in scan_root(root, storage_options=options)] == ["s1", "t1"]  # no folder of s9 begun
    assert newest_tag(root, storage_options=options) == "t1"
    assert not list((tmp_path / "fast").rglob("s9*"))  # nor in the fast tier


def test_a_restart_that_resumed_saves_on_and_the_job_it_replaced_is_refused(tmp_path: Any) -> None:
    """A restart resumes the newest checkpoint (another process's) and saves: not refused, its retention
    removes its history's oldest as always; the first process, still saving there, is the job refused."""
    root = str(tmp_path)
    m, o = model()
    with Checkpointer(root, retention=Retention(num_kept_partial_checkpoints=2)) as a:
        a.save("s1", m, o)
        said = other_job(root, "t1", resume=True)
        assert "resumed s1" in said and "abandoned" not in said, said
        assert _committed(root) == ["t1"]  # keeping 1: s1 was the restarted job's own history
        _refused_naming_the_other(a, m, o, root, "t1", "s1")
    assert _committed(root) == ["t1"]


def test_checkpointers_of_one_process_in_one_root_are_one_job(tmp_path: Any) -> None:
    """Two models' Checkpointers and smp's face, saving in turn into one root (each after the others' commits),
    are one job: none is refused, each save is numbered after the last, and every manifest names one job."""
    root = str(tmp_path)
    m, o = model()
    n, p = model()
    with Checkpointer(root) as first, Checkpointer(root) as second:
        for step in range(2):
            first.save(f"a{step}", m, o)
            second.save(f"b{step}", n, p)
            save_checkpoint(root, f"c{step}", model=m, optimizer=o)
    records = [r for r in scan_root(root) if r.committed]
    assert [(r.tag, r.order[0]) for r in records] == [
        (t, i + 1) for i, t in enumerate(["a0", "b0", "c0", "a1", "b1", "c1"])
    ]
    assert len({r.extra[JOB_KEY] for r in records}) == 1
    resume_from_checkpoint(root, model=m, optimizer=o)  # the newest: c1, this process's own


@pytest.mark.dist
def test_every_rank_of_the_refused_job_gets_the_refusal(tmp_path: Any) -> None:
    """Two ranks: rank 0 draws the number and refuses, the other rank gets the same class naming rank 0 (no
    hang); nothing written."""
    root = str(tmp_path)
    got = run_world(refused_world, 2, root, timeout=180)
    assert "give each job its own path" in got[0]["error"] and "'t1'" in got[0]["error"], got
    assert got[1]["error"].startswith("rank 0 failed: another job is saving into"), got
    assert got[0]["dirs"] == got[1]["dirs"] == ["newest", "s1_partial", "smpckpt.abandoned", "t1_partial"], got

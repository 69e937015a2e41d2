"""Two jobs saving into one root (a sweep that forgot to vary ``path``, a second launch of a script while the
first still runs): the job behind is refused at its next save, naming the other's tag, and nothing is removed;
a restart that resumed saves on; two Checkpointers of one process into one root are one job (README, "The
Checkpointer"). The other job is a real second process (its own identity, ``extra["job"]``)."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import torch
from dist_harness import run_world
from root_jobs_workers import model, other_job, refused_world, stepped_job, tiered_job
from test_tiers_path import _down
from torch import nn

import smpckpt.api._save as save_module
import smpckpt.api.checkpointer as checkpointer_module
from smpckpt import (
    Checkpointer,
    FastTier,
    Location,
    Retention,
    SaveOptions,
    last_resume_info,
    resume_from_checkpoint,
    save_checkpoint,
)
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


@pytest.mark.parametrize("where", ["local", "s3", "tiered", "shared"])
def test_a_second_job_saving_into_the_root_is_refused_at_the_next_save_and_nothing_is_removed(
    tmp_path: Any, request: pytest.FixtureRequest, where: str
) -> None:
    """Job A saves s1 (keeping 1); job B, a second launch that resumed nothing, saves t1 (keeping 1) into the
    same root. Before: B's retention removed A's s1, and A's next save went on (numbered after t1), removing t1
    in turn; a tag-less restart of either resumed the other's state. Now B keeps s1 as abandoned (with a
    warning naming it) and A's next save is refused, naming t1; nothing is removed, ``newest`` stays t1. ``shared``:
    B saves through a fast tier in A's local_path too (fix70a: A's tiered save counted B's fast copy of t1 as seen,
    was not refused and its retention removed t1 from path)."""
    options: dict[str, Any] | None = None
    root = str(tmp_path / "run")
    if where == "s3":
        root, options = request.getfixturevalue("s3_root")
    tier = FastTier(str(tmp_path / "fast"), replicas=1) if where in ("tiered", "shared") else None  # s1 drains
    m, o = model()
    keep = Retention(num_kept_partial_checkpoints=1)
    with Checkpointer(Location(root, storage_options=options), fast_tier=tier, retention=keep) as a:
        a.save("s1", m, o)
        a.wait()
        said = other_job(root, "t1", options=options, fast=str(tmp_path / "fast") if where == "shared" else None)
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


def test_a_per_save_checkpointer_goes_on_from_a_roll_back_of_this_process(tmp_path: Any) -> None:
    """rev72j M2: A saves s1, s2, s3; B (same process) resumes s1; C, built per save keeping 2, saves s4. s4 goes on
    from s1: s2, s3 are its abandoned range (never counted); retention keeps s1 (s4's parent). Before (a strict
    xfail): s4 recorded no range (this job's own saves ended the listing before the resume's hint was used) and s1
    was removed. Now the hint is used while this job saved nothing since the resume (no save stamped after it)."""
    root = str(tmp_path)
    m, o = model()
    with Checkpointer(root) as a:
        for tag in ("s1", "s2", "s3"):
            a.save(tag, m, o)
    with Checkpointer(root) as b:
        b.resume("s1", model=m, optimizer=o)
    with Checkpointer(root, retention=Retention(num_kept_partial_checkpoints=2)) as c:
        c.save("s4", m, o)
    records = {r.tag: r for r in scan_root(root) if r.committed}
    assert records["s4"].extra.get("abandoned") == [[2, 3]], records["s4"].extra
    assert sorted(records) == ["s1", "s2", "s3", "s4"]  # before: s1 removed


def test_a_second_per_save_checkpointer_goes_on_from_the_first_not_from_the_roll_back_again(tmp_path: Any) -> None:
    """After the roll-back above (s4 went on from s1), D, built per save in the same thread keeping 2, saves s5: the
    thread's resume of s1 is spent (s4 was saved after it), so s5 goes on from s4: it records no range of its own
    (s4's [2, 3] stays s4's) and retention keeps s5 and s4, removing s1. A hint taken again would abandon s4,
    the job's last save, and keep s1."""
    root = str(tmp_path)
    m, o = model()
    with Checkpointer(root) as a:
        for tag in ("s1", "s2", "s3"):
            a.save(tag, m, o)
    with Checkpointer(root) as b:
        b.resume("s1", model=m, optimizer=o)
    keep2 = Retention(num_kept_partial_checkpoints=2)
    for tag in ("s4", "s5"):
        with Checkpointer(root, retention=keep2) as each:
            each.save(tag, m, o)
    records = {r.tag: r for r in scan_root(root) if r.committed}
    assert records["s4"].extra.get("abandoned") == [[2, 3]], records["s4"].extra
    assert records["s5"].order[0] == 5 and "abandoned" not in records["s5"].extra, records["s5"].extra
    assert sorted(records) == ["s2", "s3", "s4", "s5"]


@pytest.mark.dist
def test_every_rank_of_the_refused_job_gets_the_refusal(tmp_path: Any) -> None:
    """Two ranks: rank 0 draws the number and refuses, the other rank gets the same class naming rank 0 (no
    hang); nothing written."""
    root = str(tmp_path)
    got = run_world(refused_world, 2, root, timeout=180)
    assert "give each job its own path" in got[0]["error"] and "'t1'" in got[0]["error"], got
    assert got[1]["error"].startswith("rank 0 failed: another job is saving into"), got
    assert got[0]["dirs"] == got[1]["dirs"] == ["newest", "s1_partial", "smpckpt.abandoned", "t1_partial"], got


@pytest.mark.parametrize("export_first", [False, True])
def test_a_restart_that_resumed_is_not_refused_when_its_predecessor_commits_late(
    tmp_path: Any, caplog: Any, export_first: bool
) -> None:
    """rev69c 4: B, a restart, resumes a1 (tag-less) while its predecessor A still commits a2 (a replacement pod
    overlapping the terminating pod's last save). Before: B's first save was refused (RootInUse, "last save
    '(none)'"), a restart crashing for nothing. Now B saves, a2 is abandoned by B's history (warned, naming a2 and
    a1) and a tag-less resume takes B's b1. rev69i 2: also when B exports before its first save (the export's draw
    took a2's number and forgot what B resumed, naming the export's number as B's "last save")."""
    root = str(tmp_path)
    a = stepped_job(root, "a1,a2")
    try:
        assert a.stdout is not None and a.stdin is not None
        assert a.stdout.readline().strip() == "saved a1"
        m, o = model()
        with Checkpointer(root) as b:
            b.resume(model=m, optimizer=o)
            assert b.last_resume_info is not None and b.last_resume_info.tag == "a1"
            if export_first:
                b.export("e1", model=m, optimizer=o)
            a.stdin.write("go\n")
            a.stdin.close()
            assert a.wait(timeout=300) == 0
            assert newest_tag(root) == "a2"
            caplog.set_level(logging.WARNING)
            b.save("b1", m, o)  # before: RootInUse
    finally:
        a.kill() if a.poll() is None else None
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "'a2' (sequence 2)" in said and "resumed 'a1' (sequence 1)" in said, said
    records = {r.tag: r for r in scan_root(root) if r.committed}
    assert sorted(records) == ["a1", "a2", "b1"] and records["b1"].extra["abandoned"] == [[2, 2]]
    n, p = model()
    resume_from_checkpoint(root, model=n, optimizer=p)
    assert last_resume_info() is not None and last_resume_info().tag == "b1"  # type: ignore[union-attr]


@pytest.mark.parametrize("export_first", [False, True])
def test_a_restart_saving_through_checkpointers_built_per_save_keeps_its_retention(
    tmp_path: Any, caplog: Any, export_first: bool
) -> None:
    """rev69c 5: a restart resumes another process's a1 in one Checkpointer, then saves through a new one each time
    (README: "built per save"; smp's face). Before: the first save warned "resumed none" and kept a1 as abandoned,
    so retention never removed it: every restart leaked the previous run's checkpoints. Now the save goes on from
    the tag this thread resumed: keeping 2, only b2 and b3 are left. rev69i 4: also when each per-save
    Checkpointer exports first (the export's first listing ignored the thread's resume)."""
    root = str(tmp_path)
    other_job(root, "a1")
    m, o = model()
    with Checkpointer(root) as first:
        first.resume(model=m, optimizer=o)
    caplog.set_level(logging.WARNING)
    for tag in ("b1", "b2") if not export_first else ("b1", "b2", "b3"):
        with Checkpointer(root, retention=Retention(num_kept_partial_checkpoints=2)) as each:
            if export_first:
                each.export(f"e-{tag}", model=m, optimizer=o)
            each.save(tag, m, o)
    if not export_first:
        save_checkpoint(root, "b3", model=m, optimizer=o, num_kept_partial_checkpoints=2)
    assert _committed(root) == ["b2", "b3"]  # before: ["a1", "b2", "b3"]
    assert not [r for r in caplog.records if "resumed none" in r.getMessage()]


@pytest.mark.parametrize("spelling", ["slash", "file-url", "link"])
def test_a_per_save_checkpointer_goes_on_from_a_resume_through_another_spelling_of_the_root(
    tmp_path: Any, caplog: Any, spelling: str
) -> None:
    """hunt72a F3: the thread's resume was matched to a per-save Checkpointer by the root's spelling ('/x' against
    '/x/', 'file:///x', a link to it): the save warned "resumed none" and kept the run it resumed as abandoned,
    never removed (README: "resume in one Checkpointer, save or export through new ones: retention as usual")."""
    root = tmp_path / "run"
    root.mkdir()
    (tmp_path / "linked").symlink_to(root)
    spelled = {"slash": f"{root}/", "file-url": f"file://{root}", "link": str(tmp_path / "linked")}[spelling]
    other_job(str(root), "a1")
    m, o = model()
    with Checkpointer(spelled) as first:
        first.resume(model=m, optimizer=o)
    caplog.set_level(logging.WARNING)
    with Checkpointer(str(root), retention=Retention(num_kept_partial_checkpoints=1)) as each:
        each.save("b1", m, o)
    assert _committed(str(root)) == ["b1"]  # before: ["a1", "b1"]
    assert not [r for r in caplog.records if "resumed none" in r.getMessage()]


@pytest.mark.parametrize(
    "resumed", ["through-the-link", "before-the-link-is-built-on", "one-checkpointer-on-the-link", "smp-kept"]
)
def test_a_resume_goes_on_in_the_folder_it_resumed_not_where_a_link_points_later(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any, resumed: str
) -> None:
    """rev72a M1, M2: run1 and run2 each hold another job's a1 (step-named tags); 'current' links to run1; this job
    resumes run1's a1, 'current' is re-pointed to run2, then a Checkpointer keeping 1 saves b1 into run2. It must not
    go on from the a1 it resumed (that was run1's): run2's a1 is another job's, kept as abandoned with a warning.
    through-the-link (M1): the resume was through 'current', matched by resolving ResumeInfo.path at the save, when
    it named run2. before-the-link-is-built-on (M2): a Checkpointer built on 'current' while it named run1 kept that
    key and saved into run2 going on from run1's resume. Before, both removed the other job's a1 from run2.
    one-checkpointer-on-the-link, smp-kept (rev72j M1): the Checkpointer that resumed through 'current' (smp's kept
    one) saves after the re-pointing: its counter held run1's history, so run2's a1 was removed with no warning."""
    run1, run2, link = tmp_path / "run1", tmp_path / "run2", tmp_path / "current"
    run1.mkdir()
    run2.mkdir()
    link.symlink_to(run1)
    job = ["B"]
    monkeypatch.setattr(save_module, "job_token", lambda: job[0])
    m, o = model()
    for root in (run1, run2):
        with Checkpointer(str(root)) as theirs:
            theirs.save("a1", m, o)
    job[0] = "A"  # this job from here on
    keep1 = Retention(num_kept_partial_checkpoints=1)
    early = Checkpointer(str(link), retention=keep1) if resumed == "before-the-link-is-built-on" else None
    same = Checkpointer(str(link), retention=keep1) if resumed == "one-checkpointer-on-the-link" else None
    if resumed == "smp-kept":
        resume_from_checkpoint(str(link), model=m, optimizer=o)
    elif same is not None:
        same.resume(model=m, optimizer=o)
    else:
        with Checkpointer(str(link) if early is None else str(run1)) as first:
            first.resume(model=m, optimizer=o)
    assert last_resume_info().tag == "a1"
    link.unlink()
    link.symlink_to(run2)
    caplog.set_level(logging.WARNING)
    if resumed == "smp-kept":
        save_checkpoint(str(link), "b1", model=m, optimizer=o, num_kept_partial_checkpoints=1)
    else:
        with same or early or Checkpointer(str(run2), retention=keep1) as each:
            each.save("b1", m, o)
    assert _committed(str(run2)) == ["a1", "b1"]  # before: ["b1"]
    assert _committed(str(run1)) == ["a1"]
    warned = [r.getMessage() for r in caplog.records if "resumed none" in r.getMessage()]
    assert len(warned) == 1 and "another job or run (the newest 'a1', sequence 1)" in warned[0], warned


def test_an_export_between_saves_does_not_hide_the_other_job(tmp_path: Any) -> None:
    """rev69c 2: A saves s1, B saves t1, A exports, then saves s2. Before: the export's draw marked t1 seen, s2
    was not refused and A's retention (keeping 1) removed B's t1. Now s2 is refused naming t1; nothing removed."""
    root = str(tmp_path / "run")
    m, o = model()
    with Checkpointer(root, retention=Retention(num_kept_partial_checkpoints=1)) as a:
        a.save("s1", m, o)
        other_job(root, "t1")
        a.export("e1", model=m, optimizer=o)
        with pytest.raises(RootInUse, match="'t1' .sequence 2.* last save 's1' .sequence 1"):
            a.save("s2", m, o)
    assert _committed(root) == ["s1", "t1"]


def test_a_refused_job_resuming_tag_less_is_refused_too(tmp_path: Any) -> None:
    """rev69c 1 (in one process): A saved s1, B saved t1; A's tag-less resume (rolling back) took t1 silently,
    after which A's saves were no longer refused and removed B's checkpoints. Now the resume is refused by name,
    before any state is applied; a resume naming its tag is the user's choice and goes on."""
    root = str(tmp_path)
    m, o = model()
    with Checkpointer(root) as a:
        a.save("s1", m, o)
        other_job(root, "t1")
        before = {k: v.clone() for k, v in m.state_dict().items()}
        with pytest.raises(RootInUse, match="'t1' .sequence 2.* last save 's1' .sequence 1.*this resume is refused"):
            a.resume(model=m, optimizer=o)
        assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
        a.resume("s1", model=m, optimizer=o)
    assert _committed(root) == ["s1", "t1"]


def test_two_saves_drawing_one_number_remove_none_of_each_other(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """rev69c 3: two saves draw the same number before either commits (ordered here by holding the writes: b2
    draws, a2 draws, b2 commits, a2 commits). Before: a2's retention (keeping 1) removed b2, numbered alike and
    stamped earlier. Now retention removes nothing when another checkpoint has the number just saved, and warns."""
    root = str(tmp_path)
    m, o = model()
    real, drew, go, done = checkpointer_module.write_checkpoint, *(threading.Event() for _ in range(3))

    def held(*args: Any) -> None:
        if threading.current_thread() is not threading.main_thread():  # b2's: waits for a2's draw
            drew.set()
            go.wait(timeout=120)
            real(*args)
            done.set()
        else:  # a2's: drawn after b2's, committed after it
            go.set()
            done.wait(timeout=120)
            real(*args)

    keep = Retention(num_kept_partial_checkpoints=1)
    with Checkpointer(root, retention=keep) as a, Checkpointer(root, retention=keep) as b:
        a.save("a1", m, o)
        monkeypatch.setattr(checkpointer_module, "write_checkpoint", held)
        failed: list[BaseException] = []
        saving = threading.Thread(target=lambda: _caught(failed, lambda: b.save("b2", m, o)))
        saving.start()
        assert drew.wait(timeout=120)
        a.save("a2", m, o)  # draws 2 too: b2 is not committed yet
        saving.join(timeout=300)
        assert not failed, failed
    records = [(r.tag, r.order[0]) for r in scan_root(root) if r.committed]
    assert sorted(records) == [("a2", 2), ("b2", 2)], records  # before: [("a2", 2)], b2 removed by a2's retention


def _caught(failed: list[BaseException], fn: Any) -> None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
        failed.append(exc)


def test_the_job_token_keeps_each_part_it_can_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """rev69c 9: one unreadable /proc file (a container hiding boot_id) dropped every other part too (start time,
    pid namespace): the identity fell back to host and pid. Now each part is read on its own."""
    from smpckpt.api import _save

    whole = _save.job_token()
    hidden: set[str] = set()

    def opened(path: str, *args: Any, **kwargs: Any) -> Any:
        if path in hidden:
            raise PermissionError(13, "hidden", path)
        return open(path, *args, **kwargs)

    monkeypatch.setattr(_save, "open", opened, raising=False)
    hidden.add("/proc/sys/kernel/random/boot_id")
    no_boot = _save.job_token()
    hidden.add("/proc/self/stat")
    neither = _save.job_token()
    assert len({whole, no_boot, neither}) == 3  # before: no_boot == neither (host and pid alone)


def test_a_restart_resuming_by_tag_while_path_is_down_keeps_its_history(
    s3_root: tuple[str, dict[str, Any]], tmp_path: Any, caplog: Any
) -> None:
    """rev69c 7: a restart resumes a2 by tag from the fast tier while path is down, saves b1 still down (numbered
    without a listing), then b2 with path back. Before: b2's first listing found none of the job's own
    checkpoints, warned "resumed none" and recorded the job's own b1 (and a2) as abandoned. Now the job's history
    goes on: no range recorded, no warning."""
    root, options = s3_root
    fast = str(tmp_path / "fast")
    tiered_job(root, fast, options)
    where = Location(root, storage_options=dict(options))
    m, o = model()
    caplog.set_level(logging.WARNING)
    with Checkpointer(where, fast_tier=FastTier(fast, replicas=1, durable_every=2)) as b:
        where.storage_options.update(_down(options))
        b.resume("a2", model=m, optimizer=o)
        b.save("b1", m, o)
        where.storage_options.update(options)
        b.save("b2", m, o)
        b.wait()
    records = {r.tag: r for r in scan_root(root, storage_options=options) if r.committed}
    assert "b2" in records and "abandoned" not in records["b2"].extra, records["b2"].extra  # before: [[1, 3]]
    assert not [r for r in caplog.records if "resumed none" in r.getMessage()]


def test_the_fresh_job_warning_says_retention_removes_unnumbered_checkpoints(tmp_path: Any, caplog: Any) -> None:
    """rev69c 6: a root holding only unnumbered committed checkpoints (``convert --to dcp``'s outputs, older
    versions): the fresh job's warning promised they were "kept as abandoned", yet no range can mark them and its
    retention (keeping 1) removed them. The warning now names them and says retention removes them."""
    import io

    from smpckpt.tools.cli import main

    src, root = str(tmp_path / "src"), str(tmp_path / "run")
    m, o = model()
    with Checkpointer(src) as c:
        c.save("x", m, o)
    for tag in ("old1", "old2"):
        argv = ["convert", "--to", "dcp", f"{src}/x", f"{root}/{tag}_partial"]
        assert main(argv, stdout=io.StringIO(), stderr=io.StringIO()) == 0
    assert [r.order[0] for r in scan_root(root) if r.committed] == [0, 0]
    caplog.set_level(logging.WARNING)
    with Checkpointer(root, retention=Retention(num_kept_partial_checkpoints=1)) as c:
        c.save("n1", m, o)
        c.save("n2", m, o)
    said = " ".join(r.getMessage() for r in caplog.records if "resumed none" in r.getMessage())
    assert "['old1', 'old2'] carry no sequence number" in said and "retention removes them" in said, said
    assert _committed(root) == ["n2"]  # as the warning says


def test_a_tag_less_resume_after_an_export_or_a_refused_save_still_refuses_the_other_job(tmp_path: Any) -> None:
    """rev69i 1: A saved s1, B saved t1; an export of A (or A's refused s2) read t1's number as newest, after which
    A's tag-less roll-back took B's t1 silently. Now it is refused, naming t1 and the way to take it deliberately."""
    root = str(tmp_path)
    m, o = model()
    with Checkpointer(root) as a:
        a.save("s1", m, o)
        other_job(root, "t1")
        a.export("e1", model=m, optimizer=o)
        with pytest.raises(RootInUse, match="'t1' .sequence 2.*this resume is refused.*pass tag= to take it"):
            a.resume(model=m, optimizer=o)  # before: took t1
        with pytest.raises(RootInUse, match="this save is refused"):
            a.save("s2", m, o)
        with pytest.raises(RootInUse, match="'t1' .sequence 2.*this resume is refused"):
            a.resume(model=m, optimizer=o)  # before: took t1
        a.resume("s1", model=m, optimizer=o)
    assert _committed(root) == ["s1", "t1"]


def test_a_predecessors_save_numbered_with_the_restarts_first_is_not_refused(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """rev69i 3: A's last save a2 draws number 2 before B (its restart, which resumed a1) draws 2 for b1, and commits
    after b1. Before: B's next save b2 was refused, a restart crashing for nothing. Now a2 is abandoned with a
    warning and b2 saves. Two jobs in one process: the job identity differs per thread (A on the main thread)."""
    root = str(tmp_path)
    m, o = model()
    main = threading.main_thread()
    monkeypatch.setattr(save_module, "job_token", lambda: "A" if threading.current_thread() is main else "B")
    real, a_drew, b_saved, a_done = checkpointer_module.write_checkpoint, *(threading.Event() for _ in range(3))

    def held(req: Any, *rest: Any) -> Any:
        if req.tag == "a2":  # drawn, then written once b1 committed
            a_drew.set()
            b_saved.wait(timeout=120)
        return real(req, *rest)

    failed: list[BaseException] = []

    def job_b() -> None:
        n, p = model()
        with Checkpointer(root) as b:
            b.resume(model=n, optimizer=p)
            resumed.set()
            a_drew.wait(timeout=120)
            b.save("b1", n, p)
            b_saved.set()
            a_done.wait(timeout=120)
            b.resume(model=n, optimizer=p)  # a2 drew first: b1 is the later of the two at number 2, B's own
            assert b.last_resume_info is not None and b.last_resume_info.tag == "b1"
            b.save("b2", n, p)  # before: RootInUse

    resumed = threading.Event()
    with Checkpointer(root) as a:
        a.save("a1", m, o)
        monkeypatch.setattr(checkpointer_module, "write_checkpoint", held)
        caplog.set_level(logging.WARNING)
        saving = threading.Thread(target=lambda: _caught(failed, job_b))
        saving.start()
        assert resumed.wait(timeout=120)
        a.save("a2", m, o)
        a_done.set()
        saving.join(timeout=300)
    assert not failed, failed
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "'a2' (sequence 2) committed by the job this one replaced" in said, said
    records = [(r.tag, r.order[0]) for r in scan_root(root) if r.committed]
    assert sorted(records) == [("a1", 1), ("a2", 2), ("b1", 2), ("b2", 3)], records
    assert newest_tag(root) == "b2"


def test_a_tag_less_resume_after_a_failed_save_refuses_the_other_jobs_checkpoint_at_its_number(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rev69j 1: A saved s1; its s2 failed in the write (number 2 drawn, nothing committed); B then saved t1,
    numbered 2 too. A's tag-less roll-back took t1, B's state, silently: a number drawn counted as accepted. Now
    refused naming t1; A's own s1 comes back by its tag, bit-exact."""
    root = str(tmp_path)
    real = checkpointer_module.write_checkpoint

    def failing(req: Any, *rest: Any) -> Any:
        if req.tag == "s2":
            raise OSError("disk full (injected) writing s2")
        return real(req, *rest)

    m, o = model()
    with Checkpointer(root) as a:
        a.save("s1", m, o)
        s1 = {k: v.clone() for k, v in m.state_dict().items()}
        monkeypatch.setattr(checkpointer_module, "write_checkpoint", failing)
        with pytest.raises(Exception, match="disk full"):
            a.save("s2", m, o)
        other_job(root, "t1")
        with pytest.raises(RootInUse, match="'t1' .sequence 2.*this resume is refused.*pass tag= to take it"):
            a.resume(model=m, optimizer=o)  # before: took t1
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)
        a.resume("s1", model=m, optimizer=o)
    assert all(torch.equal(m.state_dict()[k], v) for k, v in s1.items())


def test_a_late_save_of_the_replaced_job_at_the_restarts_number_is_named_as_such() -> None:
    """rev69k: a restart's tag-less resume meeting its predecessor's late save at its own number (drawn after the
    restart's, committed after it) is refused -- two histories, neither chosen silently -- naming the job this one
    replaced and the tag it resumed, not "another job is saving" and a save that may not have committed."""
    from types import SimpleNamespace

    from smpckpt.catalog.root import SequenceCounter

    counter = SequenceCounter("/nowhere")
    counter.job, counter._from, counter._drawn, counter._accepted, counter._tag = "B", ("A", "a1", 1), 2, 2, "b1"
    late = SimpleNamespace(tag="a2", order=(2, 0, ""), manifest=SimpleNamespace(extra={JOB_KEY: "A"}))
    with pytest.raises(
        RootInUse,
        match=r"^the job this one replaced \(it resumed 'a1'\): its late checkpoint 'a2'.*"
        r"\(or tag='a1', the one it resumed\)$",
    ):
        counter.resuming(late, None)
    assert counter.resuming(late, "a2") is late  # by tag: taken deliberately
    other = SimpleNamespace(tag="t2", order=(2, 0, ""), manifest=SimpleNamespace(extra={JOB_KEY: "C"}))
    with pytest.raises(RootInUse, match=r"^another job is saving into /nowhere: its checkpoint 't2'"):
        counter.resuming(other, None)

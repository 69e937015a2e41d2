"""Histories of the fast tier (one process, one node, and pure logic): lineages and segments telling a fork
from a roll-back, histories a job abandoned refused or skipped as fallbacks, roll-backs recorded only once they
succeed, and the abandoned saves the fast tier keeps, said at each save."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
from tier_helpers import job as _job
from tier_helpers import linear as _linear
from tier_helpers import partials as _partials
from tier_helpers import same as _same
from tier_helpers import tier_record as _tier_record
from torch import nn

from smpckpt import (
    Checkpointer,
    CheckpointError,
    FastTier,
    ResumeOptions,
)
from smpckpt.storage import read_manifest


def _abandoned_fast_history(tmp_path: Path) -> tuple[Path, FastTier, dict[str, nn.Module]]:
    """Job A (fast tier, durable_every=3) saves s1..s5: only s3 reaches path. Job B, without the fast
    tier, resumes s3 from path and saves b1 -- numbered after path's s3 only, so below A's s5."""
    durable = tmp_path / "durable"
    fast = FastTier(local_path=str(tmp_path / "fast"), replicas=1, durable_every=3)
    models = {f"s{s}": _linear(s) for s in range(1, 6)} | {"b1": _linear(100)}
    with Checkpointer(durable, fast_tier=fast) as a:
        for s in range(1, 6):
            a.save(f"s{s}", models[f"s{s}"])
    with Checkpointer(durable) as b:
        got = _linear(99)
        b.resume(model=got)
        assert b.last_resume_info is not None and b.last_resume_info.tag == "s3"
        assert _same(got, models["s3"])
        b.save("b1", models["b1"])
    return durable, fast, models


def test_a_fast_tier_history_a_job_without_it_abandoned_is_refused_by_name(tmp_path: Path) -> None:
    """tag=None with the fast tier again: its s5 (sequence 5) outranks b1 (4), but b1 continued the run
    and s5's job never saw it. Neither number nor clock says which history the user continues: refused,
    naming both (it once resumed the abandoned s5, silently); tag= picks either, bit-exact."""
    durable, fast, models = _abandoned_fast_history(tmp_path)
    with Checkpointer(durable, fast_tier=fast) as c:
        with pytest.raises(
            CheckpointError,
            match=r"ambiguous resume.*'s5' \(sequence number 5\).*'b1', sequence "
            r"number 4.*resume\(tag='b1'\).*resume\(tag='s5'\)",
        ):
            c.resume(model=_linear(99))
        for tag, tier in (("b1", "durable"), ("s5", "fast")):
            got = _linear(99)
            c.resume(tag=tag, model=got)
            info = c.last_resume_info
            assert info is not None and (info.tag, info.tier) == (tag, tier)
            assert _same(got, models[tag])


def test_a_fast_tier_history_continued_from_the_durable_one_resumes_as_before(tmp_path: Path) -> None:
    """After tag='b1' chose path's history, the fast tier's next save c1 knew b1: tag=None takes it again,
    and when c1 cannot be loaded the abandoned s5 is no fallback: path's b1 is (it once was s5, silently).
    A job that enables a fast tier on a root of plain saves (resuming one, or starting afresh) resumes
    its fast-tier saves as before."""
    durable, fast, models = _abandoned_fast_history(tmp_path)
    fast = FastTier(local_path=fast.local_path, replicas=1, durable_every=10)  # c1 stays in the fast tier
    with Checkpointer(durable, fast_tier=fast) as c:
        c.resume(tag="b1", model=_linear(99))
        models["c1"] = _linear(101)
        c.save("c1", models["c1"])
    local = _job(Path(fast.local_path), durable)
    # num_kept_local=2: the abandoned s5 stays, uncounted (as path's retention: fix72e); s4, which no save
    # records as abandoned, fills the second slot (the next save removes it)
    assert _partials(local) == ["c1_partial", "s4_partial", "s5_partial"]
    for broken in (False, True):
        if broken:  # one node: no intact copy anywhere, the fast copy of c1 fails
            data = next(p for p in (local / "c1_partial").iterdir() if p.name.endswith(".distcp"))
            data.write_bytes(data.read_bytes()[:-1] + bytes([data.read_bytes()[-1] ^ 0xFF]))
        with Checkpointer(durable, fast_tier=fast) as c, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = _linear(99)
            c.resume(model=got)
            info = c.last_resume_info
        want = "b1" if broken else "c1"
        assert info is not None and (info.tag, info.tier) == (want, "durable" if broken else "fast")
        assert _same(got, models[want])

    plain = tmp_path / "plain"
    with Checkpointer(plain) as p:
        p.save("p1", _linear(1))
    for resumed in (True, False):
        tier = FastTier(local_path=str(tmp_path / f"fast-{resumed}"), replicas=1, durable_every=3)
        with Checkpointer(plain, fast_tier=tier) as f:
            if resumed:
                f.resume(model=_linear(99))
            f.save(f"f-{resumed}", _linear(2))
        with Checkpointer(plain, fast_tier=tier) as f:
            got = _linear(99)
            f.resume(model=got)
            info = f.last_resume_info
            assert info is not None and (info.tag, info.tier) == (f"f-{resumed}", "fast")
            assert _same(got, _linear(2))


def test_a_plain_writer_of_the_root_beside_a_tiered_one_in_one_process_is_no_divergence(tmp_path: Path) -> None:
    """Two Checkpointers of one root in one process, one with the fast tier: p2 (plain) is saved between
    the fast-only s1 and s3. s3's draw read p2's number from ``newest``, so s3 knew it: tag=None resumes
    s3 as before, not refused."""
    durable, fast = tmp_path / "durable", FastTier(local_path=str(tmp_path / "fast"), replicas=1, durable_every=5)
    models = {tag: _linear(i) for i, tag in enumerate(("s1", "p2", "s3"), 1)}
    with Checkpointer(durable, fast_tier=fast) as a, Checkpointer(durable) as b:
        a.save("s1", models["s1"])
        b.save("p2", models["p2"])
        a.save("s3", models["s3"])
    assert _tier_record(_job(Path(fast.local_path), durable) / "s3_partial")["path_seen"] == 1  # p2's number
    with Checkpointer(durable, fast_tier=fast) as c:
        got = _linear(99)
        c.resume(model=got)
        info = c.last_resume_info
    assert info is not None and (info.tag, info.tier) == ("s3", "fast")
    assert _same(got, models["s3"])


def test_lineage_skips_what_the_job_saw_and_left_and_ends_at_path() -> None:
    """(pure logic, rev58c) A rewind by tag wrote "fork-seen", which switched the fork check off for 16
    saves: a later real fork resumed the abandoned history silently. A save after a resume from ``path``
    had an empty lineage, and the heal then refused same-history stale copies, falling back to an older
    save. Now the numbers a job saw and did not go on from are skipped, the rest stays checked, and a
    lineage ends where ``path``'s checkpoint was gone on from."""
    from smpckpt.api._fast_resume import lineage_for, refuse_forked
    from smpckpt.api._tiers import PATH_MARK, SKIPPED, LocalCopy, candidates

    def copy(seq: int, lineage: tuple[int, ...] = (), history: int = 1000) -> LocalCopy:
        return LocalCopy("committed", {}, history + seq, seq, (seq, seq, ""), {}, lineage=lineage)

    saves: dict[str, LocalCopy] = {}
    for seq in range(1, 8):  # s1..s7, each numbered after the one before
        saves[f"s{seq}"] = copy(seq, lineage_for([saves], 0, None))
    assert saves["s7"].lineage == tuple(range(1006, 1000, -1))
    s8 = copy(8, lineage_for([saves], 0, saves["s6"].digest))  # the job rewound to s6 by tag
    assert s8.lineage == (SKIPPED, 1006, 1005, 1004, 1003, 1002, 1001)
    s9 = copy(9, lineage_for([{**saves, "s8": s8}], 0, s8.digest))
    views = [{"s8": s8, "s9": s9}]
    refuse_forked(candidates(views)[0], candidates(views))  # nothing else at its numbers: no fork
    forked = [
        {**views[0], "new6": copy(6, history=2000)}
    ]  # another history's save 6 (the fast tiers lost, path's s5 resumed)
    with pytest.raises(CheckpointError, match=r"two histories of this job: 's9' \(save 9\) and 'new6' \(save 6\)"):
        refuse_forked(candidates(forked)[0], candidates(forked))
    # after a resume from path's save 4 the next save's lineage ends there; stale saves 3, 4 of the same
    # history back on a node are no fork
    x5 = copy(5, lineage_for([{}], 4, PATH_MARK))
    c6 = copy(6, lineage_for([{"x5": x5}], 4, x5.digest))
    assert (x5.lineage, c6.lineage) == ((), (1005,))
    back = [{"x5": x5, "c6": c6, "c3": copy(3), "a4": copy(4)}]
    refuse_forked(candidates(back)[0], candidates(back))


def _raising(sd: Any) -> Any:
    raise RuntimeError("translate_function failed")


def test_a_fast_tier_resume_by_tag_marks_a_rollback_only_once_it_succeeded(tmp_path: Path) -> None:
    """rev60a F1, fast tier: a resume of s3 from the fast tier that failed (a raising translate_function)
    marked a roll-back: s6 recorded s4, s5 abandoned. The same resume, succeeding, marks it (s7)."""
    durable = tmp_path / "durable"
    fast = FastTier(local_path=str(tmp_path / "fast"), replicas=1, durable_every=1, num_kept_local=None)
    models = {s: _linear(s) for s in range(1, 8)}
    with Checkpointer(durable, fast_tier=fast) as c:
        for s in range(1, 6):
            c.save(f"s{s}", models[s])
        with pytest.raises(RuntimeError, match="translate_function failed"):
            c.resume(tag="s3", model=_linear(99), options=ResumeOptions(translate_function=_raising))
        c.save("s6", models[6])
        got = _linear(99)
        c.resume(tag="s3", model=got)
        info = c.last_resume_info
        assert info is not None and (info.tag, info.tier) == ("s3", "fast")
        assert _same(got, models[3])
        c.save("s7", models[7])
    assert "abandoned" not in read_manifest(str(durable / "s6_partial")).extra
    assert read_manifest(str(durable / "s7_partial")).extra["abandoned"] == [[4, 6]]


def test_a_fast_tier_rollback_is_recorded_beside_newest_and_never_resumed_past(tmp_path: Path) -> None:
    """rev60c F1, F2: the drain of a save after a roll-back (s3; s4, s5 abandoned) left no root copy of the
    record, and with s6 damaged in both tiers a tag-less resume loaded the abandoned s5 from the fast tier
    (``ls --local`` predicting it) while the warning named s3. Now s3 loads, as warned, bit-exact."""
    import io
    import json

    from smpckpt.tools.cli import main

    durable, local = tmp_path / "durable", tmp_path / "fast"
    fast = FastTier(local_path=str(local), replicas=1, durable_every=1, num_kept_local=None)
    models = {s: _linear(s) for s in range(1, 7)}
    with Checkpointer(durable, fast_tier=fast) as c:
        for s in range(1, 6):
            c.save(f"s{s}", models[s])
        c.resume(tag="s3", model=_linear(99))
        c.save("s6", models[6])
    record = json.loads((durable / "smpckpt.abandoned").read_text())
    assert record == {"tag": "s6", "sequence": 6, "abandoned": [[4, 5]]}
    (durable / "s6_partial" / "smpckpt.manifest.json").write_text("{not json")
    got = _linear(99)
    with Checkpointer(durable, fast_tier=fast) as c, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c.resume(model=got)  # s6 intact in the fast tier: it loads, and no warning says s3 is resumed
        info = c.last_resume_info
    assert info is not None and (info.tag, info.tier) == ("s6", "fast") and _same(got, models[6])
    assert not [w for w in caught if "resuming from the newest committed checkpoint" in str(w.message)]
    (_job(local, durable) / "s6_partial" / "smpckpt.manifest.json").write_text("{not json")
    out = io.StringIO()
    main(["ls", str(durable), "--local", str(local)], stdout=out, stderr=io.StringIO())
    assert out.getvalue().splitlines()[-1] == "resume: s3 from the fast tier", out.getvalue()
    got = _linear(99)
    with Checkpointer(durable, fast_tier=fast) as c, pytest.warns(UserWarning) as caught:
        c.resume(model=got)
        info = c.last_resume_info
    assert info is not None and info.tag == "s3" and _same(got, models[3])
    said = [str(w.message) for w in caught if "resuming from the newest committed checkpoint" in str(w.message)]
    assert len(said) == 1 and "'s3'" in said[0] and "['s5', 's4']" in said[0], said
    assert f"as {durable}/smpckpt.abandoned records" in said[0]


def test_the_fast_tier_fallbacks_skip_what_a_newer_save_or_paths_choice_abandoned() -> None:
    """rev60c F2: the fast tier's candidates after a roll-back to s4 (s6 recording s5 abandoned; s5 and s6
    undrained, path's newest s4): when s6 fails to load, s5 was the next fallback. Neither it nor, with
    path's choice s3 (its ranges naming s4-s5), any save its history abandoned is one; tag= names any."""
    from smpckpt.api._fast_resume import usable_saves
    from smpckpt.api._resume import Target
    from smpckpt.api._tiers import FastCandidate
    from smpckpt.storage.format.manifest import Manifest, MetadataRecord

    def cand(seq: int, abandoned: tuple[tuple[int, int], ...] = ()) -> FastCandidate:
        return FastCandidate(f"s{seq}", seq, seq, (seq, 0, ""), {}, (), abandoned=abandoned)

    found = [cand(6, ((5, 5),)), cand(5), cand(4), cand(3)]
    path_s4 = Target("s4", "path/s4_partial", None, None, False, False, (4, 0, ""))
    assert [c.tag for c in usable_saves(found, path_s4, None)] == ["s6", "s4"]
    path_s3 = Target("s3", "path/s3_partial", None, None, False, True, (3, 0, ""), abandoned=((4, 5),))
    assert [c.tag for c in usable_saves(found[1:], path_s3, None)] == ["s3"]
    assert [c.tag for c in usable_saves(found[1:2], path_s3, "s5")] == ["s5"]
    # a record of numbers not below its own save's is ignored there (crafted): it hid the newer fast saves
    extra = {"sequence": 4, "abandoned": [[5, 9], [1, 2]]}
    crafted = Manifest("id-s4", "partial", "raw", MetadataRecord(".metadata", 0, 0), (), 1, "", extra)
    path_crafted = Target.of("s4", "path/s4_partial", crafted, False)
    assert path_crafted.abandoned == ((1, 2),)
    assert [c.tag for c in usable_saves([cand(6), cand(5)], path_crafted, None)] == ["s6", "s5"]


def test_histories_are_told_apart_by_their_segments_never_by_save_times() -> None:
    """rev63c: beyond the 16-save lineage, a fork is told by ``runs`` (segments: id, first number). A, B, C
    segments; B left A at 6. A's save 24 (a node back with an old disk) is past where B's history left A:
    refused either way round. Two histories leaving A at 6 for two segments (a restart at 6 on each
    side): refused. A roll-back (A's 5 below B's first 6), a save without runs, or a history that passed
    over the other (saw it, went on elsewhere) is not."""
    from smpckpt.api._tiers import FastCandidate, apart, runs_of

    def save(seq: int, runs: list[tuple[int, int]], passed: tuple[tuple[int, int], ...] = ()) -> FastCandidate:
        return FastCandidate(f"s{seq}", seq, seq, (seq, 0, ""), {}, (), runs=tuple(runs), passed=passed)

    a_, b_, c_, d_ = 0xA, 0xB, 0xC, 0xD
    a24, b30 = save(24, [(a_, 1)]), save(30, [(a_, 1), (b_, 6)])
    assert apart(b30, a24) and apart(a24, save(6, [(a_, 1), (b_, 6)]))
    assert apart(save(24, [(a_, 1), (c_, 6)]), save(6, [(a_, 1), (b_, 6)]))  # siblings at 6
    assert not apart(save(6, [(a_, 1), (b_, 6)]), save(5, [(a_, 1)]))  # a roll-back to A's 4: 5 abandoned
    # B's 6-10 rolled back to A's 5: the roll-back's job saw B's 10 (it numbered 11 after it) and passed it
    assert not apart(save(12, [(a_, 1), (c_, 11)], ((b_, 10),)), save(10, [(a_, 1), (b_, 6)]))
    # rev63g F1: A left for B at 8 (an ordinary restart) and, by a job that never saw B's saves, for C at 6
    assert apart(save(24, [(a_, 1), (b_, 8)]), save(6, [(a_, 1), (c_, 6)]))
    assert apart(save(6, [(a_, 1), (c_, 6)]), save(24, [(a_, 1), (b_, 8)]))
    assert not apart(b30, save(24, []))  # an older copy: the lineage alone
    assert not apart(save(31, [(a_, 1), (b_, 6), (d_, 31)], ((a_, 24),)), a24)  # settled: seen, passed over
    assert runs_of([["000000000000000a", 1], ["0b", 6]]) == ((a_, 1), (b_, 6))
    assert runs_of([["zz", 1]]) == runs_of([["0a", True]]) == runs_of("x") == ()  # damaged: no evidence


def test_each_save_says_how_many_abandoned_saves_the_fast_tier_keeps(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """rev72e LOW-2: fast-tier retention keeps every save a roll-back abandoned, uncounted and never removed
    (65c8d35, as path's), and nothing said so: a job rolling back often filled /dev/shm silently. Now each
    save that keeps any warns once (each node's first rank; not again after its drain), naming how many, the
    newest few, their size and how to remove them; once per growth of that set, not again at each later save."""
    durable, local = tmp_path / "durable", tmp_path / "fast"
    fast = FastTier(local_path=str(local), replicas=1, durable_every=2, num_kept_local=1)
    said: list[list[str]] = []
    with Checkpointer(durable, fast_tier=fast) as c, caplog.at_level(logging.WARNING, logger="smpckpt.api"):
        for tag in ("s1", "s2", "s3", "back", "s4", "s5"):
            caplog.clear()
            if tag == "back":
                c.resume(tag="s2", model=_linear(99))  # s3 abandoned by the next save
            else:
                c.save(tag, _linear(int(tag[1])))
                c.wait()  # its drain too
            said.append([r.getMessage() for r in caplog.records if "as abandoned" in r.getMessage()])
    job = _job(local, durable)
    assert _partials(job) == ["s3_partial", "s5_partial"]
    size = sum(p.stat().st_size for p in (job / "s3_partial").iterdir()) / 2**20
    want = (
        f"fast tier {job}: keeps 1 checkpoint(s) a newer save records as abandoned (a roll-back by tag=, or saves "
        f"the job went on past), 's3', {size:.1f} MiB on this node: retention neither counts nor removes them, so "
        "each roll-back adds to them (on /dev/shm they hold memory). Remove those no longer wanted by hand, on every "
        f"node, e.g. `rm -r {job}/s3_partial`"
    )
    assert said == [[], [], [], [], [want], []], said  # rev72m L: once per growth (was [want] again at s5)

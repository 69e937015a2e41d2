"""Tiered checkpoints across ranks: 2 simulated nodes x 2 gloo ranks (``LOCAL_WORLD_SIZE=2``), each node's
fast tier its own folder; kills during replication and during the drain; a changed world; nodes lost,
back with old disks, damaged files healed from peers."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import tier_jobs_workers
import tier_workers
import torch
from dist_harness import RankFailed, run_world
from tier_helpers import job as _job

from smpckpt.api._tiers import durable_key, job_folder
from smpckpt.storage.format.manifest import MANIFEST_NAME


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    base = tmp_path_factory.mktemp("tiers")
    return base, run_world(tier_workers.main_world, 4, str(base))


def _reports(base: Path) -> dict[int, Any]:
    out = {}
    for rank in range(4):
        path = base / f"report{rank}.pkl"
        if path.exists():
            out[rank] = pickle.loads(path.read_bytes())
    return out


@pytest.fixture(scope="module")
def killed(
    tmp_path_factory: pytest.TempPathFactory, world: tuple[Path, list[dict[str, Any]]]
) -> tuple[Path, dict[str, dict[int, Any]], list[dict[str, Any]]]:
    """Rank 3 killed during step2's replica transfers; rank 1 killed during step2's drain; rank 2 killed
    between the node commits; rank 1 killed during step3's drain (num_kept_local=2); then one restarted
    world resumes these and the five saves of ``world``."""
    base = tmp_path_factory.mktemp("killed")
    reports = {}
    for name, fn, victim in (
        ("replication", tier_workers.killed_in_replication, 3),
        ("drain", tier_workers.killed_in_drain, 1),
        ("commit", tier_workers.killed_between_node_commits, 2),
        ("drain3", tier_jobs_workers.killed_in_drain_of_step3, 1),
    ):
        (base / name / "fast").mkdir(parents=True)
        with pytest.raises(RankFailed, match=f"rank {victim}: no result"):
            run_world(fn, 4, str(base / name / "fast"), str(base / name / "durable"), timeout=180)
        reports[name] = _reports(base / name / "fast")
    return base, reports, run_world(tier_workers.restarted, 4, str(base), str(world[0]))


@pytest.mark.dist
def test_five_saves_keep_two_fast_and_drain_the_third(world: tuple[Path, list[dict[str, Any]]]) -> None:
    for rank, r in enumerate(world[1]):
        for mode in ("sync", "async"):
            assert r[mode]["local_after_saves"] == ["step4_partial", "step5_partial"], (rank, mode)
            assert r[mode]["durable_after_saves"] == ["newest", "step3_partial"], (rank, mode)


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_one_node_lost_resumes_the_fifth_save_from_peer_replicas(killed: Any, mode: str) -> None:
    restarted = killed[2]
    for rank, r in enumerate(restarted):
        got = r[mode]["one_node_lost"]
        assert (got["tag"], got["tier"], got["uc"], got["exact"]) == ("step5", "fast", {"step": 5}, True), rank
        peers = got["from_peers"]
        assert peers and {dst for _, _, dst in peers} == {2}  # node 1's first rank fetched, once per file
        assert {src for _, src, _ in peers} <= {0, 1}
    assert restarted[2][mode]["local_after_heal"] == ["step5_partial"]  # the lost node holds the copy again


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_fast_tier_lost_resumes_the_newest_durable_save(killed: Any, mode: str) -> None:
    for rank, r in enumerate(killed[2]):
        got = r[mode]["all_lost"]
        assert (got["tag"], got["tier"], got["uc"], got["exact"]) == ("step3", "durable", {"step": 3}, True), rank


@pytest.mark.dist
def test_ranks_without_local_world_size_or_with_different_node_folders_are_refused(
    world: tuple[Path, list[dict[str, Any]]],
) -> None:
    for rank, r in enumerate(world[1]):
        got = r["refusals"]
        assert "needs LOCAL_WORLD_SIZE" in got["no_lws"], (rank, got)
        assert "local_path differs between ranks of node" in got["mates_differ"], (rank, got)
        assert got["left"] == [], (rank, got)


@pytest.mark.dist
def test_a_smaller_world_reshards_from_the_fast_tier(world: tuple[Path, list[dict[str, Any]]]) -> None:
    base, saved = world[0] / "reshard", [r["reshard"] for r in world[1]]
    out = run_world(tier_workers.resume_resharded, 2, str(base / "fast"), str(base / "durable"))
    for rank, r in enumerate(out):
        assert (r["tag"], r["tier"], r["uc"], r["layout_changed"]) == ("step2", "fast", {"step": 2}, True), rank
        want = saved[rank]  # old ranks 0 and 1 are tp 0 and 1 of dp 0: the same pieces
        assert r["state"].keys() == want.keys()
        assert all(torch.equal(r["state"][k], want[k]) for k in want), rank


@pytest.mark.dist
def test_kill_during_replication_leaves_the_previous_save_newest(killed: Any) -> None:
    base, reports, resumed = killed
    rep = reports["replication"]
    assert sorted(rep) == [0, 1, 2], rep  # rank 3 died; every other rank got an error, none hung
    for rank, got in rep.items():
        assert got["error"].startswith("CheckpointError"), (rank, got)
        if rank % 2 == 0:  # each node's first rank removed its copy of the uncommitted step2
            assert got["local"] == ["step1_partial"], (rank, got)
    for rank, r in enumerate(resumed):
        got = r["replication"]
        assert (got["tag"], got["tier"], got["exact"]) == ("step1", "fast", True), rank
        again = got["after_resave"]  # the tag saves again: its leftovers were settled
        assert (again["tag"], again["tier"], again["uc"], again["exact"]) == ("step2", "fast", {"step": 2}, True)


@pytest.mark.dist
def test_kill_during_the_drain_keeps_both_tiers_usable(killed: Any) -> None:
    base, reports, resumed = killed
    rep = reports["drain"]
    assert 1 not in rep and rep, rep
    for rank, got in rep.items():
        assert "drain of checkpoint 'step2'" in got["error"], (rank, got)
    durable = base / "drain" / "durable"
    assert (durable / "newest").read_text().strip() == "step1"
    for rank, r in enumerate(resumed):
        # the fast tier committed step2 before its drain began: it is the newest checkpoint ...
        got = r["drain"]
        assert (got["tag"], got["tier"], got["exact"]) == ("step2", "fast", True), rank
        # ... and the last durable checkpoint was never lost
        got = r["drain_no_fast"]
        assert (got["tag"], got["tier"], got["exact"]) == ("step1", "durable", True), rank


@pytest.mark.dist
def test_kill_between_the_node_commits_leaves_a_complete_checkpoint(killed: Any) -> None:
    base, reports, resumed = killed
    rep = reports["commit"]
    assert 2 not in rep and rep, rep
    node1 = _job(base / "commit" / "fast" / "node1", base / "commit" / "durable") / "step2_partial"
    assert "smpckpt.manifest.json" not in rep[3]["step2"], rep[3]  # node 1 never committed its copy
    for rank, r in enumerate(resumed):
        # every node held its share before any committed: the union of the copies is complete
        got = r["commit"]
        assert (got["tag"], got["tier"], got["exact"]) == ("step2", "fast", True), rank
    assert (node1 / "smpckpt.manifest.json").exists()  # the resume sent node 1 the manifest


@pytest.mark.dist
def test_a_drain_killed_is_retried_by_the_next_save_and_never_lost(killed: Any) -> None:
    """durable_every=3, num_kept_local=2: rank 1 killed while draining step3. The restarted job resumes
    step3 from the fast tier; its next save drains step3 again (a warning says so) and retention keeps
    step3 until then; with every fast tier lost, step3 comes from the durable tier."""
    base, reports, resumed = killed
    rep = reports["drain3"]
    assert 1 not in rep and rep, rep
    for rank, got in rep.items():
        assert "drain of checkpoint 'step3'" in got["error"], (rank, got)
        if rank % 2 == 0:
            assert got["local"] == ["step2_partial", "step3_partial"], (rank, got)
        # the kill left path without step3, and rank 1's file begun there (others' may be being removed)
        assert MANIFEST_NAME not in got["durable_step3"], (rank, got)
        assert any("_r1_" in name for name in got["durable_step3"]), (rank, got)
    for rank, r in enumerate(resumed):
        got = r["retry"]
        assert (got["resume"]["tag"], got["resume"]["tier"], got["resume"]["exact"]) == ("step3", "fast", True), rank
        if rank == 0:
            said = got["warnings"]
            assert len([w for w in said if "'step3' (save 3) was due for the durable tier" in w]) == 1, said
            assert "this save drains it to" in said[0] and "again" in said[0], said
        if rank % 2 == 0:
            assert got["fast"] == ["step4_partial", "step5_partial"], (rank, got)
        assert got["durable"] == ["newest", "step3_partial"], (rank, got)
        no_fast = got["no_fast"]
        assert (no_fast["tag"], no_fast["tier"], no_fast["uc"], no_fast["exact"]) == (
            "step3",
            "durable",
            {"step": 3},
            True,
        )


# -- issue 46: jobs apart, crafted and corrupt folders, folders refused (one 4-rank world) ----------------
@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    base = tmp_path_factory.mktemp("cases")
    return base, run_world(tier_jobs_workers.new_cases, 4, str(base), timeout=420)


def _cli(*argv: str) -> tuple[int, str, str]:
    from smpckpt.tools.cli import main

    out, err = io.StringIO(), io.StringIO()
    rc = main(list(argv), stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.dist
def test_jobs_sharing_local_path_see_only_their_own_copies(cases: tuple[Path, list[dict[str, Any]]]) -> None:
    """X saves step1-2 in the fast tier only; Z (a new run, empty path) resumes with missing_ok and saves
    step1; Y saves three with num_kept_local=2; a link to Y's step103 sits in X's folder as step9."""
    base, results = cases
    for rank, r in enumerate(results):
        got = r["jobs"]
        assert got["z_resume"] == "ok None", (rank, got)  # starts fresh: X's step2 is not Z's
        assert got["z_save"] == "ok None", (rank, got)  # X's step1 is no obstacle to Z's
        assert got["jobs"] == {
            "X": ["step1_partial", "step2_partial", "step9_partial"],  # Y's retention left X's alone
            "Y": ["step102_partial", "step103_partial"],
            "Z": ["step1_partial"],
        }, (rank, got)
        x = got["x_resume"]
        assert (x["tag"], x["tier"], x["uc"], x["exact"]) == ("step2", "fast", {"step": 2}, True), (rank, x)
        assert any("folder step9_partial is foreign" in w and "a link to" in w for w in x["warnings"]), x
    jobs = base / "jobs"
    nodes = [str(jobs / "fast" / f"node{n}") for n in (0, 1)]
    rc, out, err = _cli("ls", str(jobs / "X"), "--local", *nodes)
    assert rc == 0, err
    tags = [line.split()[1 if line.startswith(">") else 0] for line in out.splitlines() if "step" in line[:12]]
    assert tags[:3] == ["step2", "step1", "step9"], out
    assert "note: step9 is foreign: " in out
    for name in ("Y", "Z"):
        root = durable_key(str(jobs / name), None)
        for node in nodes:
            assert f"other job: {job_folder(node, root)} (durable root {root}): " in out, out
    assert out.splitlines()[-1] == "resume: step2 from the fast tier", out


@pytest.mark.dist
def test_a_crafted_newer_incomplete_save_keeps_no_retention_slot(cases: tuple[Path, list[dict[str, Any]]]) -> None:
    for rank, r in enumerate(cases[1]):
        if rank == 0:
            assert r["slot"]["after"] == ["step2_partial", "step3_partial", "zz_partial"], r["slot"]
        elif rank == 2:
            assert r["slot"]["after"] == ["step2_partial", "step3_partial"], r["slot"]


@pytest.mark.dist
def test_unsafe_fast_tier_folders_are_skipped_alike_on_every_rank(cases: tuple[Path, list[dict[str, Any]]]) -> None:
    base, results = cases
    said = [r["unsafe"]["warnings"] for r in results]
    for rank, r in enumerate(results):
        got = r["unsafe"]
        assert (got["tag"], got["tier"], got["uc"], got["exact"]) == ("step2", "fast", {"step": 2}, True), rank
        assert got["save3"] == "ok None", (rank, got)
        assert said[rank] == said[0], rank  # one judgement, shared
        junk = ["junk_abs_partial", "junk_climb_partial", "junk_meta_partial"] if rank < 2 else ["junk_node1_partial"]
        assert got["after"] == [*junk, "step2_partial", "step3_partial"], got  # retention left them alone
    assert [w.split("folder ")[1].split(" ")[0] for w in said[0]] == [
        "junk_abs_partial",
        "junk_climb_partial",
        "junk_meta_partial",
        "junk_node1_partial",
    ], said[0]
    unsafe = base / "unsafe"
    rc, out, err = _cli("ls", str(unsafe / "durable"), "--local", *(str(unsafe / "fast" / f"node{n}") for n in (0, 1)))
    assert rc == 0, err
    for tag in ("junk_abs", "junk_climb", "junk_meta", "junk_node1"):
        assert f"note: {tag} is unsafe: " in out, out


@pytest.mark.dist
def test_a_corrupt_fast_tier_file_heals_from_a_peer_then_the_next_save(
    cases: tuple[Path, list[dict[str, Any]]],
) -> None:
    base, results = cases
    victim = results[0]["heal"]["victim"]
    for rank, r in enumerate(results):
        got = r["heal"]["one_copy"]
        assert (got["tag"], got["tier"], got["uc"], got["exact"]) == ("step3", "fast", {"step": 3}, True), rank
        assert [(src // 2, dst) for name, src, dst in got["from_peers"] if name == victim] == [(1, 0)], got
        if rank == 0:  # rank 0 warns
            assert any("'step3' has corrupt parts" in w and "fetching them from peers" in w for w in got["warnings"])
        assert r["heal"]["healed"], rank  # node 0's copy is intact again
        got = r["heal"]["both_copies"]
        assert (got["tag"], got["tier"], got["uc"], got["exact"]) == ("step2", "fast", {"step": 2}, True), rank
    assert any("'step3' from the fast tier failed" in w for w in results[0]["heal"]["both_copies"]["warnings"])
    for rank, r in enumerate(results):  # a corrupt metadata (size kept) fetched again from the intact peer
        got = r["heal"]["metadata"]
        assert (got["tag"], got["tier"], got["uc"], got["exact"]) == ("step1", "fast", {"step": 1}, True), (rank, got)
    assert any("'step1' has corrupt parts (.metadata." in w for w in results[0]["heal"]["metadata"]["warnings"])
    heal = base / "heal"
    nodes = [str(heal / "fast" / f"node{n}") for n in (0, 1)]
    rc, out, err = _cli("verify", f"{heal / 'durable'}/step2", "--local", *nodes)
    assert rc == 1, out + err
    removed = results[0]["heal"]["removed"]
    assert f"step2: {removed} (rank 0's data file) is held intact by 1 of the 2 folders" in err, err
    rc, out, err = _cli("verify", f"{heal / 'durable'}/step1", "--local", *nodes)
    assert rc == 0, out + err


@pytest.mark.dist
def test_a_drain_copies_a_damaged_file_from_a_peers_intact_replica_and_fails_only_when_none_is(
    cases: tuple[Path, list[dict[str, Any]]],
) -> None:
    """rev58b F6: the drain copied each file from the rank that wrote it; a damaged copy there failed the
    drain, and every retry failed alike (a peer's intact replica was never tried) until a resume healed
    it. Now a copy that fails the check is taken from the next node holding the file; only when no node
    holds it intact does the drain fail, naming the file, the tag and every node tried; nothing of it in
    ``path``; the fast tier keeps the save."""
    for rank, r in enumerate(cases[1]):
        got = r["replica"]
        assert got["save1"] == "ok None", (rank, got)
        assert "injected: no space left on path's storage" in got["save2"], (rank, got)
        assert got["save3"] == "ok None", (rank, got)  # step2 drained, its damaged file from node 1
        assert got["victim_units"] > 1, got  # node 0's copy failed after its first blocks were copied
        assert got["from_path"] == "ok {'uc': {'step': 2}, 'exact': True}", (rank, got)
        assert "injected: no space left on path's storage" in got["save4"], (rank, got)
        said, victim = got["save5"], got["victim4"]
        assert f"the drain of 'step4' copies nothing damaged: no fast tier holds an intact copy of {victim}" in said
        assert "held by node(s) 0, 1; tried node 0 (ranks 0..1): " in said and "; node 1 (ranks 2..3): " in said, said
        assert said.count("checksum mismatch") == 2, said
        assert got["durable"] == ["newest", "step2_partial"], (rank, got)  # nothing of step4
        assert got["newest"] == "ok b'step2'", (rank, got)
        assert got["fast"] == [["step4_partial", "step5_partial"]] * 2, (rank, got)  # step4 kept, on both nodes
        assert got["step4_kept"] == [True, True], (rank, got)
    first = cases[1][0]["replica"]
    assert first["partial"]["aborted"] == 1 and first["partial"]["written"] > 0, first  # node 0's copy: begun, aborted
    assert (first["victim_intact"], first["verify"]) == ("ok True", "ok ()"), first
    assert any("the drain of 'step2' copied 1 file(s) from a peer's intact replica" in w for w in first["warnings"])


@pytest.mark.dist
def test_a_node_back_with_an_older_save_of_the_tag_still_loads_the_newer(
    cases: tuple[Path, list[dict[str, Any]]],
) -> None:
    """Node 1's stale disk held the older step1's manifest: healing the newer one's in was refused
    (``File exists``), so the newer step1, complete on node 0, never loaded (the resume fell back or failed).
    A damaged manifest on node 1 ("damaged") refused it alike, and so did parts cut short there ("cut_short":
    counted as missing, fetched under the same name) -- README promised a file cut short heals."""
    for rank, r in enumerate(cases[1]):
        for tag in ("None", "step1", "damaged", "cut_short"):
            got = r["stale"][tag]
            assert isinstance(got, dict), (rank, tag, got)
            assert (got["tag"], got["tier"], got["uc"], got["exact"]) == ("step1", "fast", {"step": 12}, True), rank


@pytest.mark.dist
def test_fast_tier_folders_refused_up_front_by_name(cases: tuple[Path, list[dict[str, Any]]]) -> None:
    for r in cases[1]:
        got = r["refused"]
        for how in ("", "_resume"):
            assert got[f"shared{how}"].startswith("ValueError") and "passes too" in got[f"shared{how}"], got
            assert "is the same folder as path" in got[f"same{how}"], got
            assert "is inside path" in got[f"inside{how}"], got
            assert "contains path" in got[f"contains{how}"], got
            assert "local_path" in got[f"file{how}"] and "is not a folder" in got[f"file{how}"], got
            if os.path.isdir("/sys/kernel"):
                assert "local_path '/sys' is not writable" in got[f"read_only{how}"], got
        assert got["left"] == (["durable", "file", "shared"], []), got
        assert got["shared_left"] == [], got


@pytest.mark.dist
def test_a_node_back_with_an_abandoned_history_is_refused_not_resumed(cases: tuple[Path, list[dict[str, Any]]]) -> None:
    """Every fast tier lost after step9 (step5 drained, step8 and step9 kept): the job resumed step5 and
    saved new6. Node 1 came back with its old disk holding step8 and step9 whole: tag=None resumed step9,
    the abandoned history, on every rank without a word. Each save records the digests of the saves it
    was numbered after (its lineage, 16 back: step9 names step6, beyond what retention kept), so a save of
    one of those numbers that is not the one named is another history: refused, naming both; by tag, each
    loads bit-exact; a save made after going on from new6 (in sight of both) resumes."""
    _, results = cases
    for r in range(4):
        fork = results[r]["fork"]
        assert fork["after_loss"].startswith("ok"), fork
        assert fork["none"].startswith("CheckpointError: ambiguous resume"), fork["none"]
        assert "'step9' (save 9) and 'new6' (save 6)" in fork["none"]
        assert fork["new6"]["tag"] == "new6" and fork["new6"]["exact"], fork["new6"]
        assert fork["step9"]["tag"] == "step9" and fork["step9"]["exact"], fork["step9"]
        assert fork["went_on"]["tag"] == "new7" and fork["went_on"]["exact"], fork["went_on"]


@pytest.mark.dist
def test_fast_tier_retention_keeps_the_jobs_own_save_over_one_its_history_abandoned(
    cases: tuple[Path, list[dict[str, Any]]],
) -> None:
    """After new7 (gone on from new6 by tag, in sight of the old disk's step8 and step9, which new7 records as
    abandoned), num_kept_local=2 kept new7 and step9 on node 1 and removed new6 on both nodes: with new7 then
    damaged, a resume falls back past new6 to path (scratch /work/hunt72/hunt72b/h5.py: path's step7, not new8)."""
    for rank, r in enumerate(cases[1]):  # abandoned: kept, never counted (as path's retention; fix72e)
        abandoned = ["step8_partial", "step9_partial"] if rank >= 2 else ["step9_partial"]  # node 0: step9 healed
        assert r["fork"]["kept"] == ["new6_partial", "new7_partial", *abandoned], (rank, r["fork"]["kept"])


@pytest.mark.dist
def test_a_node_back_with_a_history_forked_beyond_the_lineage_is_refused(
    cases: tuple[Path, list[dict[str, Any]]],
) -> None:
    """rev63c: the fork 19 saves back (step24's lineage names saves 8-23, new6 is save 6): tag=None resumed
    step24, the abandoned history, silently. new6 was saved after step24 with a lower number, so its job
    never saw step24: another history, refused naming both; by tag, each loads bit-exact. step24's drain
    never committed: going on from new6, the next save drained it into path (its newest); now named, not
    drained."""
    for rank, r in enumerate(cases[1]):
        fork = r["deep_fork"]
        assert fork["none"].startswith("CheckpointError: ambiguous resume"), (rank, fork["none"])
        assert "'step24' (save 24) and 'new6' (save 6)" in fork["none"], fork["none"]
        for tag in ("new6", "step24"):
            assert fork[tag]["tag"] == tag and fork[tag]["exact"], (rank, fork[tag])
        assert (fork["save7"][:2], fork["wait"]) == ("ok", "ok None"), fork
        assert "step24_partial" not in fork["path"], (rank, fork["path"])  # path's newest step5 still
    _deep_fork_refused(cases[1], "deep_fork")


def _deep_fork_refused(results: list[dict[str, Any]], name: str) -> None:
    """rev63c: the fork refused naming both, each loadable by tag, step24 not drained; going on from new6
    (by tag, step7: save 25, in sight of step24) settles it: tag=None loads step7 bit-exact."""
    for rank, r in enumerate(results):
        fork = r[name]
        assert fork["none"].startswith("CheckpointError: ambiguous resume"), (rank, fork["none"])
        assert "'step24' (save 24) and 'new6' (save 6)" in fork["none"], fork["none"]
        for tag in ("new6", "step24"):
            assert fork[tag]["tag"] == tag and fork[tag]["exact"], (rank, fork[tag])
        assert (fork["save7"][:2], fork["wait"]) == ("ok", "ok None"), fork
        assert "step24_partial" not in fork["path"], (rank, fork["path"])  # path's newest step5 still
        assert not isinstance(fork["went_on"], str), (rank, fork["went_on"])
        assert fork["went_on"]["tag"] == "step7" and fork["went_on"]["exact"], (rank, fork["went_on"])
    said = results[0][name]["warned"]
    assert len(said) == 1 and "'step24' (save 24)" in said[0] and "did not go on from it" in said[0], said


@pytest.fixture(scope="module")
def histories(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_world(tier_jobs_workers.history_cases, 4, str(tmp_path_factory.mktemp("histories")), timeout=600)


@pytest.mark.dist
def test_a_fork_beyond_the_lineage_is_refused_whichever_clock_is_ahead(histories: list[dict[str, Any]]) -> None:
    """rev63c F3: the old history's saves stamped 1 h ahead (its rank 0's host): the save-time rule saw
    new6 as saved before step24 and resumed step24 silently. The histories' segments (runs) tell."""
    _deep_fork_refused(histories, "deep_fork_ahead")


@pytest.mark.dist
@pytest.mark.parametrize("case, tag", [("skew_rollback", "step6"), ("skew_plain", "step19")])
def test_a_job_restarted_on_a_host_whose_clock_is_behind_resumes_its_newest(
    histories: list[dict[str, Any]], case: str, tag: str
) -> None:
    """rev63c F1: the first saves stamped 1 h ahead, the job restarted on a host with the true clock (a roll-
    back by tag='step4' then step6; or a plain resume then 17 saves): tag=None was refused, an older save
    of the job's own history "saved later". No clocks now: the newest loads bit-exact on every rank."""
    for rank, r in enumerate(histories):
        got = r[case]["none"]
        assert not isinstance(got, str), (rank, got)
        assert got["tag"] == tag and got["exact"], (rank, got)


@pytest.mark.dist
@pytest.mark.parametrize("case", ["rollback_drain", "far_drain"])
def test_a_pending_drain_not_of_the_jobs_history_is_never_drained_however_far_back(
    histories: list[dict[str, Any]], case: str
) -> None:
    """rev63c F2: step6 due for path, its drain lost. rollback_drain: the job rolled back to step4 and saved
    new7-new24; far_drain: every fast tier lost, the job resumed path's step5, saved new6-new23, then node 1
    came back with step6 (another history's). Past the 16 numbers a lineage names, new23 (new24) drained
    step6 into path as its newest. Now never: each save names it, as the roll-back's or another history's;
    the job's own newest loads bit-exact (new24 saw step6 and went on: settled)."""
    for rank, r in enumerate(histories):
        got = r[case]
        assert "step6_partial" not in got["path"] and got["newest"] != "step6", (rank, got["path"], got["newest"])
        assert not isinstance(got["none"], str), (rank, got["none"])
        assert got["none"]["tag"] == "new24" and got["none"]["exact"], (rank, got["none"])
    said = histories[0][case]["said"]
    why = "abandoned by the roll-back to 'step4' (save 4)" if case == "rollback_drain" else "did not go on from it"
    assert said and all("'step6' (save 6)" in w and why in w for w in said), said


# -- rev62a: a copy a node cannot read, or reads wrong, while others hold it intact (4 nodes of 1 rank) --------
@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_world(tier_jobs_workers.fetch_faults, 4, str(tmp_path_factory.mktemp("faults")), timeout=400)


@pytest.mark.dist
@pytest.mark.parametrize("case", ["eio", "gone", "manifest"])
def test_a_copy_the_first_holder_cannot_read_is_taken_from_the_next_node(
    faults: list[dict[str, Any]], case: str
) -> None:
    """eio (a hang, rev62a F1) and gone (node 1 left an empty metadata, F5): node 1 lacks step2's metadata,
    node 0 cannot read its own; manifest (F2): node 1 lacks the manifest and node 2 holds a corrupt part,
    the failed attempt's manifest on node 1 no obstacle to the retry. step2 loads, node 1 healed."""
    for rank, r in enumerate(faults):
        got = r[case]
        assert (got.get("tag"), got.get("uc"), got.get("exact")) == ("step2", {"step": 2}, True), (rank, got)
        assert got["md"] == faults[3][case]["md"], rank  # node 1's metadata fetched intact
    if case != "manifest":  # node 0's copy named, node 2's taken
        said = [m for m in faults[0][case]["logged"] if "(copy skipped)" in m]
        assert len(said) == 1 and "node 0's " in said[0] and "step2_partial/.metadata." in said[0], said
        assert ("EIO" in said[0] or "I/O error" in said[0]) if case == "eio" else ": gone" in said[0], said
        assert said[0].count("step2_partial/.metadata.") == 1, said  # an OSError's path once (rev63c)


@pytest.mark.dist
def test_a_metadata_no_node_can_read_falls_back_on_every_rank_naming_each_copy(faults: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(faults):
        got = r["eio_all"]
        assert (got.get("tag"), got.get("exact")) == ("step1", True), (rank, got)
    said = [w for w in faults[0]["eio_all"]["warnings"] if "'step2' from the fast tier failed" in w]
    assert len(said) == 1 and all(f"node {n}'s " in said[0] and f"/node{n}/" in said[0] for n in (0, 2, 3)), said
    assert "injected I/O error" in said[0] and "resuming from checkpoint 'step1'" in said[0], said


@pytest.mark.dist
def test_a_pending_drain_takes_the_metadata_from_a_node_whose_copy_is_intact(faults: list[dict[str, Any]]) -> None:
    """rev62a F3: node 0's copy of step2's metadata corrupt at its size blocked every later save."""
    for rank, r in enumerate(faults):
        got = r["drain"]
        assert (got["save3"][:2], got["wait"]) == ("ok", "ok None"), (rank, got)
        assert "step2_partial" in got["durable"], got
    said = [m for m in faults[0]["drain"]["logged"] if "(copy skipped)" in m]
    assert len(said) == 1 and "node 0's " in said[0] and "not the manifest's metadata" in said[0], said


@pytest.mark.dist
def test_a_corrupt_part_that_cannot_be_removed_falls_back_naming_it_apart_from_fetched_ones(
    faults: list[dict[str, Any]],
) -> None:
    """rev62a F4: the parts the failed attempt fetched intact are not counted as corrupt (rev63c: nor removed)."""
    victim = faults[0]["stuck"]["victim"]
    for rank, r in enumerate(faults):
        got = r["stuck"]
        assert (got.get("tag"), got.get("exact")) == ("step1", True), (rank, got)
    said = [w for w in faults[0]["stuck"]["warnings"] if "'step2' from the fast tier failed" in w]
    assert len(said) == 1 and f"could not remove 1 part(s) found corrupt ({victim})" in said[0], said
    assert "fetched by the failed attempt" not in said[0] and "on node 0" in said[0], said


@pytest.mark.dist
@pytest.mark.parametrize("case", ["manifest", "eio_part"])
def test_a_retried_load_keeps_the_intact_parts_the_failed_attempt_fetched(
    faults: list[dict[str, Any]], case: str
) -> None:
    """rev63c: node 2's copy of one part is corrupt (manifest) or unreadable (eio_part, EIO sending and
    checking it); the failed attempt fetched every part the nodes lacked. The retry fetched them all
    again (GiBs per rank at real sizes); it fetches only that part now, the rest checked and kept."""
    victim = faults[2][case]["victim"]
    for rank, r in enumerate(faults):
        got = r[case]
        assert (got.get("tag"), got.get("uc"), got.get("exact")) == ("step2", {"step": 2}, True), (rank, got)
        assert got["fetched"] == [victim], (rank, got["fetched"])
    said = [m for m in faults[2][case]["logged"] if "node 2's copy of checkpoint 'step2' holds" in m]
    assert len(said) == 1 and f"holds 1 part(s) found corrupt ({victim}): removed" in said[0], said


@pytest.mark.dist
@pytest.mark.parametrize("case", ["full", "full_md"])
def test_a_node_whose_disk_is_full_fails_the_resume_by_name_instead_of_loading_an_older_save(
    faults: list[dict[str, Any]], case: str
) -> None:
    """hunt64c: node 1 lacks its part of step2 (full) or its metadata (full_md) and cannot store what a peer
    holds intact (ENOSPC): the resume loaded step1 (a committed save's progress lost, warned on rank 0 alone
    as a failed fast-tier load). It fails on every rank alike, naming node 1's file and the full disk; with
    room again, step2."""
    victim = faults[1][case]["victim"]
    for rank, r in enumerate(faults):
        got = r[case]
        said = got["full"]
        assert got["after"] is None, (rank, got["after"], said)  # before hunt64c: step1
        assert "/node1/" in said and "step2_partial" in said and "No space left on device" in said, (rank, said)
        if case == "full":
            assert said.startswith("NodeFull: loading checkpoint ") and victim in said, (rank, said)
            assert "disk is full" in said and "intact" in said, (rank, said)
        else:
            assert said.startswith("NodeFull: "), (rank, said)  # every rank (rev64b R2: CheckpointError but one)
            assert "writing its metadata to node 1's copy of checkpoint 'step2'" in said, (rank, said)
            assert "step2_partial/.metadata." in said, (rank, said)
        assert (got.get("tag"), got.get("uc"), got.get("exact")) == ("step2", {"step": 2}, True), (rank, got)


@pytest.mark.dist
def test_a_node_whose_disk_is_full_loads_paths_drained_copy_of_the_same_save(faults: list[dict[str, Any]]) -> None:
    """rev64b: as above, but path holds step2 drained: its copy of the same save loads (bit-exact), with a
    warning naming the full disk, rather than failing the resume."""
    for rank, r in enumerate(faults):
        got = r["full_path"]
        assert (got.get("tag"), got.get("tier"), got.get("uc"), got.get("exact")) == (
            "step2",
            "durable",
            {"step": 2},
            True,
        ), (rank, got)
        said = [w for w in got["warnings"] if "disk is full" in w]  # warned on rank 0
        assert len(said) == (rank == 0), (rank, got["warnings"])
        assert rank or ("/node1/" in said[0] and "loading path's drained copy of 'step2' instead" in said[0]), said


@pytest.mark.dist
def test_a_save_committed_on_some_nodes_only_is_the_jobs_own_and_drained(tmp_path: Path) -> None:
    """hunt64c F2: node 1's commit of step3 failed (ENOSPC) after the agreement, node 0's committed (a manifest
    on any node proves the copy complete, a resume loads it): the save failed naming only the OSError, and
    step4 called step3 "another history's save: a node back with an older disk?" and never drained it."""
    results = run_world(tier_jobs_workers.commit_partly_failed, 4, str(tmp_path), timeout=180)
    for rank, got in enumerate(results):
        assert (got["save4"], got["wait4"]) == ("ok None", "ok None"), (rank, got)
        assert not any("another history" in w for w in got["said4"]), (rank, got["said4"])
        assert "step3_partial" in got["durable"] and "newest" in got["durable"], (rank, got["durable"])
        assert got["save3"].startswith("CheckpointError: committing checkpoint 'step3'"), (rank, got["save3"])
        assert "on node 1: OSError" in got["save3"] and "committed on the other node(s)" in got["save3"], rank
        assert got["save5"].startswith("CheckpointExists: committing checkpoint 'step5'"), (rank, got["save5"])
    assert any("drains it to" in w and "'step3'" in w for w in results[0]["said4"]), results[0]["said4"]

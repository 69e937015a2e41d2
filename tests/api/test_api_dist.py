"""Multi-process (gloo) save/resume: cycles with retention, crash before commit, tag checks, reshard.

One world per scenario group (spawning costs seconds on 2 cores); each group's results are computed
once per module and asserted by several tests.
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Any

import api_workers
import pytest
import torch
import tp_model
from dist_harness import run_world

from smpckpt import ParallelLayout, last_resume_info, resume_from_checkpoint

pytestmark = pytest.mark.dist


def _close(got: list[float], want: list[float], n: int) -> bool:
    """``n`` losses each, pairwise close (a truncated or empty list fails instead of passing vacuously)."""
    assert len(got) == len(want) == n, (got, want)
    return all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6) for a, b in zip(got, want, strict=True))


def _ok(result: Any) -> Any:
    if isinstance(result, dict) and "error" in result and len(result) == 1:
        pytest.fail(result["error"])
    return result


@pytest.fixture(scope="module")
def cycles(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("cycles"))
    return run_world(api_workers.cycles_world, 2, root)


@pytest.fixture(scope="module")
def reshard(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    root = str(tmp_path_factory.mktemp("reshard"))
    return root, run_world(api_workers.reshard_world, 2, root)


# -- cycles and retention ------------------------------------------------------------------------------
def test_cycles_keep_two_newest_and_move_newest(cycles: list[dict[str, Any]]) -> None:
    r = _ok(cycles[0]["cycles"])
    assert r["seen"] == [
        (["step1_partial"], "step1"),
        (["step1_partial", "step2_partial"], "step2"),
        (["step2_partial", "step3_partial"], "step3"),
        (["step3_partial", "step4_partial"], "step4"),
    ]


def test_resume_newest_bit_exact_on_every_rank(cycles: list[dict[str, Any]]) -> None:
    for rank_result in cycles:
        r = _ok(rank_result["cycles"])
        assert r["uc"] == {"step": 4}
        assert r["same"] and r["optim_same"]
        assert r["path_taken"] == "fast"
        assert "torch" in r["rng"] and "python" in r["rng"]


def test_crash_before_commit_keeps_previous(cycles: list[dict[str, Any]]) -> None:
    for rank_result in cycles:
        r = _ok(rank_result["crash"])
        # the coordinator (rank 0) writes the manifest: every rank reports its failure
        assert re.fullmatch(
            r"CheckpointError: saving checkpoint \S+/step5_partial failed on rank 0: "
            r"OSError: simulated crash before commit",
            r["save_error"],
        ), r["save_error"]
        assert "step5_partial" in r["dirs"]  # data written, never committed
        assert r["newest"] == "step4"  # newest did not move
        assert r["uc_after_crash"] == {"step": 4} and r["bitexact_after_crash"]
        assert r["crash_fell_back"] is False


@pytest.mark.parametrize("case", ["uncommitted", "garbage", "missing"])
def test_unusable_newest_falls_back_with_warning(cycles: list[dict[str, Any]], case: str) -> None:
    for rank, rank_result in enumerate(cycles):
        r = _ok(rank_result["crash"])[case]
        assert r["uc"] == {"step": 4} and r["bitexact"] and r["fell_back"]
        if rank == 0:  # rank 0 resolves the tag and warns; the others learn it from ResumeInfo
            assert r["warned"]


def test_tag_mismatch_is_an_error_on_every_rank(cycles: list[dict[str, Any]]) -> None:
    for rank_result in cycles:
        r = _ok(rank_result["tags"])
        for key, fn, tags in (
            ("mismatch", "save_checkpoint", ("t0", "t1")),
            ("bad_on_one_rank", "save_checkpoint", ("ok", "bad/tag")),  # the mismatch is found first
            ("resume_mismatch", "resume_from_checkpoint", ("t0", "t1")),
        ):
            assert r[key] == (
                f"ValueError: {fn}'s arguments differ between ranks in tag (tag: rank 0: {tags[0]!r}, rank 1: "
                f"{tags[1]!r}); every rank must pass the same"
            ), (key, r[key])
        # every option field is compared (dataclasses.fields), each named when it differs
        assert r["options_mismatch"] == (
            "ValueError: save_checkpoint's arguments differ between ranks in num_kept_partial_checkpoints, sync_files "
            "(num_kept_partial_checkpoints: rank 0: 1, rank 1: 2; sync_files: rank 0: True, rank 1: False); every "
            "rank must pass the same"
        ), r["options_mismatch"]
        assert r["full_mismatch"] == (
            "ValueError: save_checkpoint's arguments differ between ranks in dtype (dtype: rank 0: 'torch.bfloat16', "
            "rank 1: 'torch.float16'); every rank must pass the same"
        ), r["full_mismatch"]
        assert r["resume_options_mismatch"] == (
            "ValueError: resume_from_checkpoint's arguments differ between ranks in strict (strict: rank 0: True, "
            "rank 1: False); every rank must pass the same"
        ), r["resume_options_mismatch"]
        # async_save on one rank only is found by the comparison, before that rank's extra step
        assert r["async_mismatch"] == (
            "ValueError: save_checkpoint's arguments differ between ranks in async_save (async_save: rank 0: True, "
            "rank 1: False); every rank must pass the same"
        ), r["async_mismatch"]
        # an argument that fails its own check on one rank fails every rank, in the same collective
        bad_keep = (
            "num_kept_partial_checkpoints must be >= 1 (it counts the checkpoints kept, the new one included), got 0"
        )
        bad_options = "options must be a Sharding, FastTier, AsyncOptions, ResumeOptions or a sequence of them; got str"
        if r["rank"] == 1:
            assert r["bad_option_on_one_rank"] == f"ValueError: {bad_keep}", r["bad_option_on_one_rank"]
            assert r["bad_resume_option_on_one_rank"] == f"TypeError: {bad_options}", r
        else:
            assert r["bad_option_on_one_rank"] == f"ValueError: rank 1 failed: {bad_keep}", r["bad_option_on_one_rank"]
            assert r["bad_resume_option_on_one_rank"] == f"TypeError: rank 1 failed: {bad_options}", r
        assert not any(d.startswith(("t0", "t1", "ok", "bad", "t_opts", "t_full")) for d in r["dirs"])


def test_failed_delete_is_survived_and_retried(cycles: list[dict[str, Any]]) -> None:
    r = _ok(cycles[0]["failed_delete"])
    dirs, newest = r["after_failed_delete"]
    assert newest == "step6" and {"step3_partial", "step4_partial", "step6_partial"} <= set(dirs)
    dirs, newest = r["after_retry"]
    assert newest == "step7"
    # committed ones beyond 1 are gone; the uncommitted step5 debris is left for a human
    assert dirs == ["step5_partial", "step7_partial"]


def test_missing_ok(cycles: list[dict[str, Any]]) -> None:
    for rank_result in cycles:
        r = _ok(rank_result["missing_ok"])
        assert r["none"] is None
        assert re.fullmatch(r"CheckpointNotFound: no committed checkpoint under \S+/nothing-here", r["error"]), r[
            "error"
        ]


# -- layout change with optimizer state -------------------------------------------------------------------
def _reference_losses() -> list[float]:
    """The unbroken single-process run (tp=dp=1, no process group)."""
    ctx, model, opt = tp_model.build(ParallelLayout())
    return [tp_model.train_step(ctx, model, opt, s) for s in range(6)]


def test_same_layout_resume_is_bit_exact(reshard: tuple[str, list[dict[str, Any]]]) -> None:
    _, results = reshard
    for r in results:
        unbroken, same = _ok(r["unbroken"]), _ok(r["same_layout"])
        assert same["uc"] == {"step": 3}
        assert same["path_taken"] == "fast" and not same["layout_changed"]
        assert len(unbroken["losses"]) == 6 and same["losses"] == unbroken["losses"][3:]  # bit-exact continuation
        assert torch.equal(same["rand"], unbroken["rand_after_save"])  # RNG restored
        assert "torch" in same["rng"]


def test_tp_run_matches_single_process_reference(reshard: tuple[str, list[dict[str, Any]]]) -> None:
    _, results = reshard
    ref = _reference_losses()
    got = _ok(results[0]["unbroken"])["losses"]
    assert _close(got, ref, 6), (got, ref)


def test_tp2_to_dp2_reshards_params_and_optimizer_bit_exact(reshard: tuple[str, list[dict[str, Any]]]) -> None:
    _, results = reshard
    saved = tp_model.global_state([_ok(r["unbroken"])["state"] for r in results])
    for rank, r in enumerate(results):
        d = _ok(r["dp2"])
        assert d["uc"] == {"step": 3}
        assert d["path_taken"] == "reshard" and d["layout_changed"] and d["resharded_tensors"] > 0
        assert d["rng"] == ()
        if rank == 0:
            assert d["rng_warned"]
        assert saved and set(d["state"]) == set(saved)
        for name, value in saved.items():
            assert torch.equal(d["state"][name], value), name
        # training continues with the loss of the unbroken run (other reduction order: tolerance)
        unbroken = _ok(r["unbroken"])["losses"][3:]
        assert _close(d["losses"], unbroken, 3), (d["losses"], unbroken)


def test_single_process_no_pg_resumes_tp2_checkpoint(reshard: tuple[str, list[dict[str, Any]]]) -> None:
    root, results = reshard
    saved = tp_model.global_state([_ok(r["unbroken"])["state"] for r in results])
    ctx, model, opt = tp_model.build(ParallelLayout(), seed=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        uc = resume_from_checkpoint(root, model=model, optimizer=opt, specs=tp_model.SPECS)
    assert uc == {"step": 3}
    info = last_resume_info()
    assert info is not None and info.tag == "s3" and info.path_taken == "reshard"
    assert info.saved_layout == ParallelLayout(tp=2) and info.layout == ParallelLayout()
    assert any("RNG states are not restored" in str(w.message) for w in caught)
    state = tp_model.local_state(model, opt)
    assert saved and set(state) == set(saved)
    for name, value in saved.items():
        assert torch.equal(state[name], value), name
    losses = [tp_model.train_step(ctx, model, opt, s) for s in range(3, 6)]
    ref = _reference_losses()[3:]
    assert _close(losses, ref, 3), (losses, ref)


def test_a_dead_peer_is_a_checkpoint_error_naming_the_rank(tmp_path: Any) -> None:
    import multiprocessing as mproc

    from dist_harness import RankFailed

    # rank 1 exits without a result on purpose; rank 0's answer is what matters
    with pytest.raises(RankFailed, match=r"^rank 1: no result \(died\)$") as info:
        run_world(api_workers.peer_dies_during_save, 2, str(tmp_path), timeout=120)
    assert "rank 0" not in str(info.value), "rank 0 must fail cleanly, not hang or crash"
    text = (tmp_path / "rank0.txt").read_text()
    assert text.startswith("smpckpt.errors.CheckpointError: rank 0 of 2: saving checkpoint 't'"), text
    assert "another rank died or was killed" in text
    assert mproc.active_children() == []


def test_warnings_made_errors_leave_no_rank_waiting_inside_a_resume(tmp_path: Any) -> None:
    """rev59c F1: a warning issued on rank 0 alone between two collectives (here: the layout changed, RNG
    states not restored), under a filter that makes warnings errors (pytest's ``-W error``), took rank 0 out
    of the resume while rank 1 waited in the next collective until the group's timeout. The warning is
    issued inside an agreement: every rank raises it alike (rank 0 the warning, the other a CheckpointError
    naming it); with warnings left alone the resume goes on as before."""
    got = run_world(api_workers.warnings_as_errors_world, 2, str(tmp_path), timeout=90)
    assert got[0]["said"].startswith("UserWarning: the layout changed"), got[0]
    assert got[1]["said"].startswith("CheckpointError: rank 0 failed with UserWarning: the layout changed"), got[1]
    assert got[0]["untouched"] and got[1]["untouched"], got
    assert got[0]["tag"] == got[1]["tag"] == "s1"
    assert got[0]["sum"] == got[1]["sum"] != got[0]["fresh"]  # dp=2: both ranks hold the whole model, loaded alike


def test_warnings_made_errors_leave_no_rank_waiting_inside_a_fast_tier_resume(tmp_path: Any) -> None:
    """rev60d F1: the fast tier's load caught only CheckpointErrors: a warning made an error on rank 0 alone
    (the layout changed; the fallback when ``newest`` is gone, issued once its copy loaded) left rank 0 out
    of the resume while rank 1, holding a CheckpointError naming it, waited in the next collective. Every
    rank raises alike now; with warnings left alone the fallback loads s2 from the fast tier and
    ``ResumeInfo.fell_back`` says so (it said False while the warning said it fell back: F2)."""
    got = run_world(api_workers.fast_tier_warnings_as_errors_world, 2, str(tmp_path), timeout=150)
    assert got[0]["layout"].startswith("UserWarning: the layout changed"), got[0]
    assert got[1]["layout"].startswith("CheckpointError: rank 0 failed with UserWarning: the layout changed"), got[1]
    assert got[0]["newest"].startswith("UserWarning: ") and "newest" in got[0]["newest"], got[0]
    assert got[1]["newest"].startswith("CheckpointError: rank 0 failed with UserWarning: "), got[1]
    assert got[0]["layout_said_at"] == ["api_workers.py"] and got[1]["layout_said_at"] == [], got
    for r in got:
        assert r["loaded"] == ("s2", "fast", True) and r["same"], r


def test_user_content_needing_pickle_is_refused_before_the_load_on_every_rank(tmp_path: Any) -> None:
    """A resume without allow_pickle of a checkpoint whose user_content needs it: refused on both ranks
    alike (no rank waits), naming the checkpoint and allow_pickle, with the model and optimizer as they
    were (the refusal came after the load had written into them); allow_pickle=True loads it."""
    got = run_world(api_workers.pickled_user_content_world, 2, str(tmp_path), timeout=120)
    for rank in (0, 1):
        for tag, what in (("p", f"checkpoint 'p' ({tmp_path}/p_partial)"), ("f", f"full checkpoint {tmp_path}/f")):
            r = got[rank][tag]
            assert r["said"].startswith(f"UnsafeCheckpoint: {what}: its user_content holds objects"), r
            assert "allow_pickle=True" in r["said"], r
            assert r["untouched"] and r["loaded"], (rank, tag, r)
            assert r["x"] == (5 if tag == "p" else 7)  # rank 0's user_content, on every rank


def test_translate_function_dropping_a_key_on_two_ranks(tmp_path: Any) -> None:
    """A key the translate_function drops keeps the model's value (it was loaded in place anyway), into the
    saved layout and resharded; every other key as a resume without the function loads it."""
    got = run_world(api_workers.translate_drop_world, 2, str(tmp_path), timeout=120)
    for rank in (0, 1):
        assert len(got[rank]) == 2, got[rank]
        for layout, r in got[rank].items():
            assert r["same"] and all(r["same"].values()), (rank, layout, r)
            assert r["skipped"] == ("model.blocks.0.fc1.bias",), (rank, layout, r)


def test_a_translate_function_failing_on_one_rank_leaves_every_model_untouched(tmp_path: Any) -> None:
    """It ran inside the apply step, after the rank before it had set its model (rev60c F3): rank 0 went on
    from the checkpoint, rank 1 from its own state. It runs in the step every rank decides before any
    applies now: both raise, neither model changed."""
    got = run_world(api_workers.translate_fails_on_one_rank_world, 2, str(tmp_path), timeout=120)
    for rank, r in enumerate(got):
        assert r["untouched"] is True, (rank, r)
    assert "rank 1's translate_function failed" in got[1]["said"], got
    assert got[0]["said"] != "no error", got  # rank 0 raises too


def test_saves_with_retention_and_resumes_alternating_make_one_gloo_group(tmp_path: Any) -> None:
    """Each alternation of save_checkpoint(num_kept_partial_checkpoints=N) and resume_from_checkpoint built
    a Checkpointer, and each its gloo group for background saves (freed by the garbage collector alone):
    one group in all now (no join group: ``Sharding.join_timeout`` is off by default), and retention still keeps
    the 2 newest."""
    got = run_world(api_workers.alternate_world, 2, str(tmp_path), timeout=120)
    for r in got:
        assert r == {"groups": 1, "dirs": ["s3_partial", "s4_partial"], "tag": "s4"}, got


def test_rollback_retention_and_fallback_follow_the_history_on_every_rank(tmp_path: Any) -> None:
    results = run_world(api_workers.rollback_world, 2, str(tmp_path))
    for rank, rank_result in enumerate(results):
        r = _ok(rank_result["rollback"])
        assert r["back"] == {"step": 3}
        # the history s6 <- s3 <- s2 stays (retention 3), and s4, s5 (abandoned, uncounted); s1 (the oldest) went
        assert r["kept"] == ["s2_partial", "s3_partial", "s4_partial", "s5_partial", "s6_partial"]
        # s6 damaged: every rank loads s3 bit-exactly (never s5, the abandoned history's newest)
        assert r["uc"] == {"step": 3} and r["same"], r
        if rank == 0:
            assert r["warned"]


def test_a_retried_drains_warning_made_an_error_fails_every_rank_alike(tmp_path: Any) -> None:
    """rev59c F3: a save that drains an earlier save again (its drain never committed) warned on rank 0
    alone, after the drain was queued; under a filter making warnings errors an async save's future failed
    on rank 0 only (``wait_for_saves`` raised there, not on rank 1), and the next save refused on every
    rank. The warning is issued where rank 0 decides the retry, inside the agreement on that decision: the
    save fails on every rank alike (rank 0 the warning, rank 1 a CheckpointError naming it), and the next
    save goes on, draining it."""
    got = run_world(api_workers.retried_drain_warning_as_error_world, 2, str(tmp_path), timeout=120)
    assert got[0]["first"][0] == got[1]["first"][0] == "no error", got
    assert "injected: no space left" in got[0]["first"][1], got[0]
    assert got[0]["said"].startswith("UserWarning: checkpoint 'step2' (save 2) was due for the durable tier"), got[0]
    assert got[1]["said"].startswith("CheckpointError: rank 0 failed with UserWarning: checkpoint 'step2'"), got[1]
    assert got[0]["after"] == got[1]["after"] == "no error", got
    assert "step2_partial" in got[0]["durable"], got[0]  # drained by the next save


def test_fast_tier_threads_outlive_saves_end_at_close_and_a_failed_save_does_not_poison_the_next(
    tmp_path: Any,
) -> None:
    """rss61: each tiered save started its file writers, replica senders and receivers (and each drain
    its copiers) anew, and glibc's per-thread arenas kept their freed buffers (RSS per rank +300 MiB over
    16 saves at a scaled 70B shape). The Checkpointer's threads now serve every save: each starts once
    (the replica ones in save 1, the writers and the drain's copiers at most 4 each), all alive after the
    7th save, none after close; a save whose received replica failed half way (ENOSPC on rank 1) is
    refused naming it, and the next save still replicates: node 1 lost, its resume from node 0's replicas
    is bit-exact."""
    got = run_world(api_workers.fast_tier_threads_world, 2, str(tmp_path), timeout=240)
    for rank, r in enumerate(got):
        started = r["started"]
        assert len(started) == len(set(started)) and sorted(started) == sorted(r["alive"]), (rank, started, r)
        replica = [n for n in started if n.startswith("smpckpt-replica")]
        assert replica and replica == r["replica_threads"], (rank, started)
        assert 0 < len([n for n in started if n.startswith("smpckpt-drain-copy")]) <= 4, (rank, started)
        assert 0 < len([n for n in started if n.startswith("smpckpt-write")]) <= 4, (rank, started)
        assert r["after_close"] == [] and r["after_exit"] == [], r
        assert r["failed"].startswith("CheckpointError: ") and "injected: no space left" in r["failed"], r
        assert "s6_partial" in r["failed"], r["failed"]
        assert r["loaded"][:2] == ("s7", "fast") and r["exact"], r
    assert got[1]["loaded"][2], got[1]  # rank 1's files came from its peer


def test_a_key_a_later_stages_translate_function_drops_is_warned(tmp_path: Any) -> None:
    """rev61e F2: the warning took rank 0's dropped keys for every rank's; under pp=2 stage 1's were lost."""
    got = run_world(api_workers.pp_translate_drop_world, 2, str(tmp_path), timeout=120)
    assert any("translate_function" in s and "model.head.bias" in s for s in got[0]["said"]), got
    assert got[1]["said"] == [], got  # rank 0 alone says it
    assert "model.head.bias" in got[0]["skipped"], got


def test_a_ctrl_c_on_one_rank_is_its_keyboard_interrupt_and_a_named_error_elsewhere(tmp_path: Any) -> None:
    """hunt62b: rank 1's Ctrl-C inside dcp.save came out as CheckpointError on both ranks; now rank 1 raises
    KeyboardInterrupt and rank 0 a CheckpointError naming rank 1, with no rank left waiting."""
    got = run_world(api_workers.ctrl_c_on_one_rank_world, 2, str(tmp_path), timeout=120)
    assert got[1]["said"].startswith("KeyboardInterrupt"), got
    assert got[0]["said"].startswith("CheckpointError") and "rank 1" in got[0]["said"], got
    assert "KeyboardInterrupt" in got[0]["said"], got
    for r in got:
        assert r["newest_after_failure"] is None and r["newest"] == "s1", got


def test_a_ctrl_c_on_one_rank_in_a_tiered_resume_fails_every_rank_at_once(tmp_path: Any) -> None:
    """rev62b F1: the fast tier's agreement on a failed load caught only ``Exception``, so the interrupted rank
    skipped it and rank 0 waited there for the other process to go (then a collective's error)."""
    got = run_world(api_workers.ctrl_c_in_a_tiered_resume_world, 2, str(tmp_path), timeout=120)
    assert got[1]["said"].startswith("KeyboardInterrupt"), got
    assert got[0]["said"].startswith("CheckpointError") and "rank 1" in got[0]["said"], got
    assert "KeyboardInterrupt" in got[0]["said"] and "collective" not in got[0]["said"], got


def test_an_export_out_bad_or_different_on_one_rank_fails_every_rank_naming_it(tmp_path: Any) -> None:
    """rev62d F3: ``out`` is checked and compared in the call's agreement, like the tag."""
    got = run_world(api_workers.export_out_per_rank_world, 2, str(tmp_path), timeout=120)
    assert got[1]["type"].startswith("TypeError: out must be a str"), got
    assert "rank 1 failed: out must be a str" in got[0]["type"], got  # at once, naming it
    for r in got:
        assert r["differ"].startswith("ValueError") and "differ between ranks in out" in r["differ"], got


def test_a_diverging_dp_replica_is_refused_naming_its_key(tmp_path: Any) -> None:
    """hunt62b R1: a plain DP replica whose dtype or shape differs on one rank, or a key one rank lacks, was
    refused as "ranks [0] hold 2 such tensors, ranks [1] hold 2 such tensors": no key (a replica is written
    by its owner alone, so the write plans showed nothing). Now every rank names the key and each view."""
    got = run_world(api_workers.diverging_replica_world, 2, str(tmp_path), timeout=120)
    for said in got:
        assert "'model.b': torch.float32 (5,) on ranks [0], torch.float64 (5,) on ranks [1]" in said["dtype"], said
        assert "'model.w': torch.float32 (4, 6) on ranks [0], torch.float32 (6, 4) on ranks [1]" in said["shape"], said
        assert "'model.extra': absent on ranks [0], torch.float32 (2,) on ranks [1]" in said["extra_key"], said
        assert (
            "'model.v': torch.float32 (4, 6) on ranks [0], torch.float32 (4, 6) (the tensor of 'model.w') on "
            in said["tie"]
        )
        assert all(s.startswith("ReplicaMismatch") for s in said.values()), said
        # the API names what it takes: no rank_local= (the planners' keyword), rev64c F3
        assert "rank-unique keys listed in Sharding(held_by_some=[globs])" in said["values"], said["values"]
        assert not any("rank_local=" in s for s in said.values()), said


@pytest.mark.parametrize("how", ["sync", "async", "compiled", "full"])
def test_ddp_batchnorm_statistics_are_rank_0s_as_ddps_next_forward_takes(tmp_path: Any, how: str) -> None:
    # hunt67 F1: DDP + BatchNorm failed every save (ReplicaMismatch 'model.1.running_mean': "replicas that drifted
    # apart"), and verify_replicas=False, its advice, wrote rank 1's statistics: a resumed job differed from one
    # that never stopped
    for rank, equal in enumerate(run_world(api_workers.ddp_batchnorm_world, 2, str(tmp_path), how, timeout=120)):
        assert all(equal.values()), (rank, equal)


def test_ddp_saved_by_a_group_without_some_of_its_ranks_saves_without_the_buffer_sync(tmp_path: Any) -> None:
    # rev67d F4: rank 0 saving DDP alone (Sharding(process_group=new_group([0]))) hung in DDP's buffer sync, a
    # collective of DDP's whole group; without the sync it saves this rank's values, as before hunt67
    got = run_world(api_workers.ddp_subgroup_save_world, 2, str(tmp_path), timeout=60)
    assert got[1] == {} and len(got[0]) == 7 and all(got[0].values()), got

"""save_checkpoint(async_save=True): training blocks only for staging; the future completes after the
commit, ``newest`` and retention; errors surface on the future and on the next call; kills lose nothing."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch
from async_workers import (
    a_background_collective_times_out,
    a_peer_stops_in_a_drain,
    a_peer_stops_or_is_slow,
    destroyed_under_a_background_save,
    model,
    reused_after_the_group_was_made_again,
    the_store_host_stops,
    training_loop_while_saving,
)
from dist_harness import run_world

import smpckpt
import smpckpt.api.checkpointer
from smpckpt import CheckpointError, CheckpointExists, resume_from_checkpoint, save_checkpoint
from smpckpt.storage import verify_checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))


def _state(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


def _loads(root: str, tag: str | None, want: dict[str, torch.Tensor]) -> None:
    fresh = model(99)
    resume_from_checkpoint(root, tag, model=fresh)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_updates_after_return_do_not_reach_the_checkpoint(tmp_path: Any) -> None:
    m = model(0)
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(2, 64)).sum().backward()
    opt.step()
    before = _state(m)
    moments = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    # staging before the save returns (overlap_staging=False): no change after it reaches the checkpoint
    ckpt = smpckpt.Checkpointer(str(tmp_path), async_options=smpckpt.AsyncOptions(enabled=True, overlap_staging=False))
    fut = ckpt.save("a", model=m, optimizer=opt)
    with torch.no_grad():  # every parameter and optimizer tensor, in place, at once
        for p in m.parameters():
            p.add_(1.0)
        for s in opt.state.values():
            for v in s.values():
                v.add_(1.0)
    assert fut.result() is None
    _loads(str(tmp_path), "a", before)
    fresh = model(5)
    fresh_opt = torch.optim.Adam(fresh.parameters())
    fresh(torch.randn(2, 64)).sum().backward()
    fresh_opt.step()
    resume_from_checkpoint(str(tmp_path), "a", model=fresh, optimizer=fresh_opt)
    for k, v in moments.items():
        assert torch.equal(fresh_opt.state_dict()["state"][0][k], v), k
    assert ckpt.staging_bytes() >= sum(v.numel() * v.element_size() for v in before.values())


def test_staging_buffers_follow_a_key_whose_shape_or_dtype_changed(tmp_path: Any) -> None:
    """hunt62b: a buffer was kept per (key, shape, dtype) for the Checkpointer's life, so a tensor whose shape
    or dtype changed between async saves left every earlier buffer held (host memory, pinned on CUDA, grew
    with each change: 1+2+...+8 MiB for a buffer growing 1 MiB a save). One buffer per key now, and none for
    a key the state no longer holds (rev62b F2: a key renamed at each save kept every earlier one); every save
    still equals its state."""
    m, rng_bytes = model(0), 0
    with smpckpt.Checkpointer(str(tmp_path), async_options=smpckpt.AsyncOptions(enabled=True)) as ckpt:
        for i in range(1, 7):
            name = "hist" if i < 5 else f"hist{i}"  # saves 5 and 6: the key renamed, then renamed again
            if i >= 5:
                delattr(m, "hist" if i == 5 else f"hist{i - 1}")
            size = 1 << 18 + min(i, 4)
            m.register_buffer(name, torch.arange(size, dtype=torch.float64 if i % 2 else torch.float32))
            want = _state(m)
            ckpt.save(f"s{i}", model=m).result()  # type: ignore[union-attr]
            held = ckpt.staging_bytes() - sum(v.numel() * v.element_size() for v in want.values())
            assert held == (held if i == 1 else rng_bytes) < 1 << 16, i  # besides the state: its RNG states
            rng_bytes = held
            fresh = model(9)
            fresh.register_buffer(name, torch.zeros_like(want[name]))
            resume_from_checkpoint(str(tmp_path), f"s{i}", model=fresh)
            for k, v in fresh.state_dict().items():
                assert torch.equal(v, want[k]) and v.dtype == want[k].dtype, (i, k)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_tied_head_is_written_once_as_by_a_synchronous_save(tmp_path: Any, overlap: bool) -> None:
    """Staging copied each key into a buffer of its own, so an async save wrote a head tied to its
    embedding twice and recorded no tie (a synchronous save of the same model writes it once and records
    it, which consolidation and exports follow)."""
    import json

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(8, 4)
            self.head = torch.nn.Linear(4, 8, bias=False)
            self.head.weight = self.embed.weight

    torch.manual_seed(0)
    m = Tied()
    opt = torch.optim.Adam(m.parameters())
    m.head(m.embed(torch.tensor([1, 2]))).sum().backward()
    opt.step()
    with smpckpt.Checkpointer(
        str(tmp_path), async_options=smpckpt.AsyncOptions(enabled=True, overlap_staging=overlap)
    ) as ckpt:
        ckpt.save("a", model=m, optimizer=opt).result()
    manifest = json.loads((tmp_path / "a_partial" / "smpckpt.manifest.json").read_text())
    assert manifest["extra"]["layout_record"]["tied"] == {"model.head.weight": "model.embed.weight"}
    fresh = Tied()
    resume_from_checkpoint(str(tmp_path), "a", model=fresh)
    assert fresh.head.weight is fresh.embed.weight and torch.equal(fresh.embed.weight, m.embed.weight)


def test_a_tied_dtensor_head_is_written_once_by_an_async_save(tmp_path: Any) -> None:
    """DTensors were staged with a copy per key, so an async save of a tied DTensor head wrote it twice and
    recorded no tie (a synchronous save writes it once and records it)."""
    from async_workers import tied_dtensor_saves
    from dist_harness import run_world

    (got,) = run_world(tied_dtensor_saves, 1, str(tmp_path))
    assert got["sync"]["tied"] == {"model.head.weight": "model.embed.weight"}
    assert got["async"] == got["sync"]
    assert got["async"]["equal"] and got["async"]["still_tied"]


def test_two_quick_saves_commit_in_order(tmp_path: Any) -> None:
    root = str(tmp_path)
    m = model(1)
    first = _state(m)
    f1 = save_checkpoint(root, "s1", model=m, async_save=True)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(2.0)
    second = _state(m)
    f2 = save_checkpoint(root, "s2", model=m, async_save=True)  # waits for s1 first
    assert f1.done()
    f2.result()
    assert open(os.path.join(root, "newest")).read().strip() == "s2"
    _loads(root, "s1", first)
    _loads(root, None, second)


def test_a_staging_refused_on_one_rank_fails_the_save_on_every_rank(tmp_path: Any) -> None:
    """hunt65a: with overlap_staging, a rank whose deferred staging was refused (a tensor changed in place
    before it was copied) failed its save before the write, while the other ranks went into the write's
    collectives and waited there for it (the background group's timeout: 30 minutes by default), their
    futures and next saves with them. The ranks now agree on the staging first: every rank's save fails,
    naming the tensor and, elsewhere, the rank; nothing is committed and the next save goes on."""
    from async_workers import one_rank_refuses_its_staging

    got = run_world(one_rank_refuses_its_staging, 2, str(tmp_path), timeout=200)
    assert "model.0.weight changed in place after the async save of checkpoint 'a'" in got[0]["error"]
    assert got[1]["error"].startswith("rank 0 failed: model.0.weight changed in place"), got[1]["error"]
    assert [g["a_committed"] for g in got] == [False, False]
    assert [g["b_exact"] for g in got] == [True, True]


@pytest.mark.parametrize(
    "what, error, elsewhere",
    [
        (
            "buffers",
            "MemoryError: cannot allocate the staging buffers (injected)",
            "CheckpointError: rank 1 failed with ",
        ),
        ("thread", "RuntimeError: can't start new thread (injected)", "RuntimeError: rank 1 failed: "),
        ("drain", "RuntimeError: can't start new thread (injected)", "RuntimeError: rank 1 failed: "),
    ],
)
def test_a_staging_that_fails_on_one_rank_fails_the_save_on_every_rank(
    tmp_path: Any, what: str, error: str, elsewhere: str
) -> None:
    """hunt65a: staging ran on each rank alone, so a rank that could not stage (its buffers not allocated)
    raised from ``save`` while the others' background writes waited for it in their collectives (30
    minutes by default), and their next save with them. The same for a rank whose save lane's thread could not
    start (the lead's notes, 2026-11-30), or its drain lane's (rev66a F2: the next save's collectives then
    misaligned and hung). The ranks agree on each: every rank's save raises, naming the rank, and the next save
    goes on."""
    from async_workers import one_rank_cannot_stage

    got = run_world(one_rank_cannot_stage, 2, str(tmp_path), what, timeout=200)
    assert got[1]["error"] == error
    assert got[0]["error"].startswith(elsewhere) and error.split(": ", 1)[1] in got[0]["error"], got[0]
    assert [g["b"] for g in got] == [True, True]


def _hold_background_writes(monkeypatch: Any) -> threading.Event:
    """Background writes wait (up to 30 s) until the returned event is set; only in this process (a forked
    child inherits the patch and must not be held)."""
    release = threading.Event()
    real = smpckpt.api.checkpointer.write_checkpoint
    parent = os.getpid()

    def held(*args: Any) -> None:
        if os.getpid() == parent:
            release.wait(30)
        real(*args)

    monkeypatch.setattr(smpckpt.api.checkpointer, "write_checkpoint", held)
    return release


def test_wait_for_previous_false_refuses_while_one_is_in_flight(tmp_path: Any, monkeypatch: Any) -> None:
    release = _hold_background_writes(monkeypatch)
    m = model(2)
    fut = save_checkpoint(str(tmp_path), "slow", model=m, async_save=True)
    with pytest.raises(CheckpointError, match="still running"):
        save_checkpoint(str(tmp_path), "next", model=m, async_save=True, wait_for_previous=False)
    release.set()
    fut.result()
    assert not os.path.exists(os.path.join(str(tmp_path), "next_partial"))


def test_background_error_surfaces_on_the_future_and_on_the_next_save(tmp_path: Any) -> None:
    root = str(tmp_path)
    m = model(3)
    kept = _state(m)
    save_checkpoint(root, "a", model=m)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(3.0)
    fut = save_checkpoint(root, "a", model=m, async_save=True)  # exists: fails in the background
    with pytest.raises(CheckpointExists):
        fut.result()
    with pytest.raises(CheckpointError, match="background save of checkpoint 'a' failed"):
        save_checkpoint(root, "b", model=m, async_save=True)
    assert not os.path.exists(os.path.join(root, "b_partial"))
    _loads(root, "a", kept)  # nothing committed was lost or overwritten
    save_checkpoint(root, "b", model=m, async_save=True).result()  # reported once, then saves go on
    assert open(os.path.join(root, "newest")).read().strip() == "b"
    smpckpt.wait_for_saves()


def test_full_checkpoints_are_not_async(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="async_save"):
        save_checkpoint(str(tmp_path), "f", partial=False, model=model(0), async_save=True)


def test_killed_during_background_write_resumes_the_previous_tag(tmp_path: Any) -> None:
    root, ready = str(tmp_path / "ckpt"), str(tmp_path / "ready")
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "async_workers.py"), root, ready],
        cwd=HERE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE)])},
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert os.path.exists(ready), "the child died before its background save reached the commit"
    assert open(os.path.join(root, "newest")).read().strip() == "a"
    assert os.listdir(os.path.join(root, "b_partial")), "the background save wrote nothing before the kill"
    _loads(root, None, _state(model(0)))  # newest -> a, b has no commit and is never taken
    assert smpckpt.last_resume_info().tag == "a"
    assert verify_checkpoint(os.path.join(root, "a_partial")).ok


def test_a_script_that_returns_while_saving_still_commits(tmp_path: Any) -> None:
    """The interpreter's exit finishes the save in flight: before the fix the save died opening its
    thread pools ("cannot schedule new futures after interpreter shutdown") and the process exited 0."""
    root = str(tmp_path / "ckpt")
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "async_workers.py"), "returns-while-saving", root],
        cwd=HERE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE)])},
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert open(os.path.join(root, "newest")).read().strip() == "b"
    want = model(0)
    with torch.no_grad():
        for p in want.parameters():
            p.add_(1.0)
    _loads(root, "b", _state(want))


@pytest.mark.parametrize(
    ("status", "exit_code", "want"),
    [("default", "", 1), ("3", "", 3), ("none", "", 0), ("default", "0", 1), ("default", "3", 3), ("5", "4", 4)],
)
def test_a_failed_final_background_save_sets_the_exit_status(
    tmp_path: Any, status: str, exit_code: str, want: int
) -> None:
    """A script that returns while its last (async) save fails exits non-zero, so the job is seen to
    fail; AsyncOptions(exit_status=...) chooses the status, None keeps the interpreter's. A script that
    ends with sys.exit(N), N a failure status of its own, keeps N."""
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "async_workers.py"),
            "fails-while-saving",
            str(tmp_path),
            status,
            exit_code,
        ],
        cwd=HERE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE)])},
        capture_output=True,
        timeout=120,
    )
    err = proc.stderr.decode()
    assert proc.returncode == want, err[-2000:]
    assert "main returned" in proc.stdout.decode()
    assert "background save of checkpoint 'lost' failed" in err and "No space left on device" in err
    assert not os.path.exists(os.path.join(str(tmp_path), "newest"))


def _worker(*args: str) -> subprocess.Popen[bytes]:
    """``async_workers.py`` with ``args`` in a fresh interpreter (its exit hooks run as a program's do)."""
    return subprocess.Popen(
        [sys.executable, os.path.join(HERE, "async_workers.py"), *args],
        cwd=HERE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE)])},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


@pytest.mark.parametrize(("how", "want"), [("result", 0), ("exception", 0), ("done", 1)])
def test_a_background_failure_the_program_saw_is_not_reported_again_at_exit(tmp_path: Any, how: str, want: int) -> None:
    """hunt69b F6: a program that caught its failed async save's error from ``fut.result()`` (or read it with
    ``fut.exception()``) still exited 1 with an ERROR "at interpreter exit"; that failure is the program's now.
    One it never looked at (``done()`` only) keeps the exit status 1 and the ERROR. ``a`` is intact either way."""
    root = str(tmp_path / "ckpt")
    proc = _worker("handled-failure", root, how)
    out, err = (b.decode() for b in proc.communicate(timeout=120))
    assert proc.returncode == want and "main returned" in out, err[-2000:]
    assert ("at interpreter exit" in err) == (want == 1), err[-2000:]
    assert ("exiting with status 1" in err) == (want == 1), err[-2000:]
    _loads(root, "a", _state(model(0)))


@pytest.mark.parametrize("fail", ["ok", "fail"])
def test_the_exit_wait_is_said_once_per_job_at_warning(tmp_path: Any, fail: str) -> None:
    """hunt69b F5: every rank logged "waiting for the background save ... before exiting" at WARNING (hundreds
    of lines per exit at hundreds of ranks); rank 0 says it at WARNING, the others at DEBUG. A save that fails
    (on rank 1's write) is still said by every rank, at ERROR, and each exits 1; else both exit 0 with ``b``."""
    root, init = str(tmp_path / "ckpt"), str(tmp_path / "init")
    procs = [_worker("exit-wait-rank", str(rank), root, init, fail) for rank in (0, 1)]
    outs = [[b.decode() for b in p.communicate(timeout=120)] for p in procs]
    said = "waiting for the background save of 'b' before exiting"
    for rank, (proc, (out, err)) in enumerate(zip(procs, outs)):
        assert proc.returncode == (1 if fail == "fail" else 0) and "main returned" in out, (rank, err[-3000:])
        assert f"{'WARNING' if rank == 0 else 'DEBUG'} {said}" in err, (rank, err[-3000:])
        assert f"{'DEBUG' if rank == 0 else 'WARNING'} {said}" not in err, (rank, err[-3000:])
        failed = "ERROR " in err and "background save of checkpoint 'b' failed" in err
        assert failed == (fail == "fail"), (rank, err[-3000:])
    assert open(os.path.join(root, "newest")).read().strip() == ("a" if fail == "fail" else "b")
    _loads(root, None, _state(model(0 if fail == "fail" else 1)))


def test_a_resume_waits_for_this_process_background_save(tmp_path: Any, monkeypatch: Any) -> None:
    """A resume started while this process's save is in flight resumes what that save leaves: before,
    it took the previous tag, which the save's retention could remove while it was being read."""
    root = str(tmp_path)
    m = model(4)
    save_checkpoint(root, "a", model=m)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    want = _state(m)
    release = _hold_background_writes(monkeypatch)
    fut = save_checkpoint(root, "b", model=m, async_save=True, num_kept_partial_checkpoints=1)
    timer = threading.Timer(0.5, release.set)
    timer.start()
    try:
        _loads(root, None, want)
    finally:
        timer.cancel()
        release.set()
    assert fut.done() and smpckpt.last_resume_info().tag == "b"
    assert not os.path.exists(os.path.join(root, "a_partial"))


def _child_saves(root: str) -> None:
    save_checkpoint(root, "c", model=model(6))  # its own save: nothing of the parent's to wait for


def test_a_child_forked_during_a_background_save_exits_at_once(tmp_path: Any, monkeypatch: Any) -> None:
    """A process forked while a save is in flight (a DataLoader worker) inherits the exit hook and a
    copy of the save's future, which no thread of the child will ever finish: it must neither wait for
    it at exit nor in its own saves."""
    release = _hold_background_writes(monkeypatch)
    fut = save_checkpoint(str(tmp_path), "a", model=model(5), async_save=True)
    child = multiprocessing.get_context("fork").Process(target=_child_saves, args=(str(tmp_path / "child"),))
    try:
        child.start()
        child.join(20)
        assert child.exitcode == 0, child.exitcode
    finally:
        if child.is_alive():
            child.kill()
        release.set()
    fut.result()
    assert os.path.exists(os.path.join(str(tmp_path), "child", "c_partial", "smpckpt.manifest.json"))


def _child_opens_a_gate() -> None:
    from smpckpt.api._staging import StagingGate

    gate = StagingGate()
    gate.guard()  # joins the process's step hook's set: takes its writers' lock
    gate.close()


def test_a_child_forked_while_another_thread_holds_the_step_hooks_lock_can_open_a_gate() -> None:
    """The step hook's writers' lock held by another thread of the parent at the fork stays held in the child
    (no thread there will release it): the child's first Checkpointer would hang in its first save. The
    child's main thread takes it (a new thread could reuse the dead holder's id and enter the RLock anyway)."""
    from smpckpt.api._staging import _GatesHook

    hook = _GatesHook.shared()
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with hook.lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    child = multiprocessing.get_context("fork").Process(target=_child_opens_a_gate)
    try:
        assert held.wait(10)
        child.start()
        child.join(20)
        assert child.exitcode == 0, child.exitcode  # None: hung on the parent's held lock
    finally:
        if child.is_alive():
            child.kill()
        release.set()
        holder.join()


@pytest.mark.dist
def test_async_saves_beside_the_training_loops_collectives(tmp_path: Any) -> None:
    results = run_world(training_loop_while_saving, 2, str(tmp_path), timeout=180)
    assert all(r["exact"] for r in results)
    assert all(r["newest"] == "s2" for r in results)


def test_dcp_async_save_with_our_planner_and_writer(tmp_path: Any) -> None:
    import torch.distributed.checkpoint as dcp

    from smpckpt.model.layout import ParallelLayout
    from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner
    from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter

    m = model(4)
    want = _state(m)
    state = {"model": m.state_dict()}
    planner = ParallelSavePlanner(ParallelLayout(), rank=0, enable_plan_caching=False)
    fut = dcp.async_save(state, storage_writer=FsspecStorageWriter(str(tmp_path / "c")), planner=planner)
    with torch.no_grad():  # DCP stages (copies) before async_save returns
        for p in m.parameters():
            p.add_(1.0)
    fut.result()
    dest = {"model": {k: torch.zeros_like(v) for k, v in want.items()}}
    dcp.load(
        dest,
        storage_reader=FsspecStorageReader(str(tmp_path / "c")),
        planner=ParallelLoadPlanner(ParallelLayout(), rank=0),
    )
    for k, v in want.items():
        assert torch.equal(dest["model"][k], v), k


@pytest.mark.dist
def test_dcp_async_save_process_mode_with_our_planner_and_writer(tmp_path: Any) -> None:
    from async_workers import dcp_process_mode

    assert run_world(dcp_process_mode, 2, str(tmp_path), timeout=180) == [True, True]


def test_a_background_save_whose_process_group_was_destroyed_says_so(tmp_path: Any) -> None:
    """hunt69b F2: destroy_process_group() with an async save in flight (no wait()) failed it with "dcp.save's
    world has 1 ranks but the layout ... describes 2"; the error now names the destroyed group and the fix."""
    root = str(tmp_path / "ckpt")
    for got in run_world(destroyed_under_a_background_save, 2, root, timeout=120):
        assert got["said"].startswith("CheckpointError: saving checkpoint 'b'"), got
        assert "the process group was destroyed (destroy_process_group()) while it ran" in got["said"], got
        assert "before destroy_process_group()" in got["said"] and got["newest"] == "a", got


def test_a_checkpointer_reused_after_its_process_group_was_made_again_says_build_a_new_one(tmp_path: Any) -> None:
    """hunt69b F3: after destroy_process_group() and init_process_group() again, the same Checkpointer's saves
    failed with torch's "Group ... is not registered"; now refused by name (build a new Checkpointer), while a
    new one, and the smp face (which builds one itself), save on."""
    root, init = str(tmp_path / "ckpt"), str(tmp_path / "init2")
    for got in run_world(reused_after_the_group_was_made_again, 2, root, init, timeout=120):
        assert got["said"].startswith("CheckpointError: rank "), got
        assert "process group destroyed since it was built" in got["said"], got
        assert "build a new Checkpointer after init_process_group()" in got["said"], got
        assert got["newest"] == ["c", "b"], got
        assert got["left_staged"] == 0, got  # the smp face's old one freed its staging copy (rev69g M3)


_ODD = {
    "quantized": (lambda: torch.quantize_per_tensor(torch.tensor([0.5, -1.0]), 0.05, 0, torch.qint8), "a quantized"),
    "nested": (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "a nested tensor"),
    "meta": (lambda: torch.empty(3, device="meta"), "a meta tensor"),
    "sparse": (lambda: torch.eye(3).to_sparse(), "a torch.sparse_coo tensor"),
}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("kind", sorted(_ODD))
def test_an_async_save_refuses_a_tensor_it_cannot_stage_by_key(tmp_path, kind: str, overlap: bool) -> None:
    """rev69f F5: staging copied a quantized, nested, meta or sparse tensor first and failed in torch's words,
    naming no key; refused by key (as a synchronous save refuses it) before any buffer is made."""
    make, said = _ODD[kind]
    model = torch.nn.Linear(2, 2)
    model.register_buffer("odd", make())
    options = smpckpt.AsyncOptions(enabled=True, overlap_staging=overlap)
    with pytest.raises(smpckpt.SpecError, match=rf"model\.odd: {said}"):
        with smpckpt.Checkpointer(str(tmp_path), async_options=options) as ck:
            ck.save("t", model).result()


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("overlap", [False, True])
def test_an_async_save_stages_an_efficient_zero_tensor_as_its_zeros(tmp_path: Any, overlap: bool) -> None:
    """fix70h: an efficient zero tensor (``torch._efficientzerotensor``: some autograd paths' zero gradients)
    has no storage, and staging failed on it, "invalid python storage", where a synchronous save saves it.
    Now it stages as its zeros; loaded back bit-exact."""
    model = torch.nn.Linear(2, 2)
    model.register_buffer("zero", torch._efficientzerotensor((3, 4)))
    model.register_buffer("zero_too", torch._efficientzerotensor((3, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    options = smpckpt.AsyncOptions(enabled=True, overlap_staging=overlap)
    with smpckpt.Checkpointer(str(tmp_path), async_options=options) as ck:
        ck.save("t", model, opt).result()
    fresh = torch.nn.Linear(2, 2)
    fresh.register_buffer("zero", torch.full((3, 4), 7.0))
    fresh.register_buffer("zero_too", torch.full((3, 4), 7.0))
    resume_from_checkpoint(str(tmp_path), "t", model=fresh)
    assert torch.equal(fresh.zero, torch.zeros(3, 4)) and torch.equal(fresh.zero_too, torch.zeros(3, 4))
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)


_BOUND = 3.0  # the job's process-group timeout in the two tests below: the hung-peer bound


@pytest.mark.parametrize("stopped", [1, 0])
def test_an_async_save_whose_peer_stopped_fails_within_the_jobs_timeout_naming_it(tmp_path: Any, stopped: int) -> None:
    """fix70c: one rank SIGSTOPped at the start of its background write (a vanished node that keeps its TCP
    connections): the other's future waited for the background group's 30 minutes (gloo's wait cannot be
    interrupted). Now a liveness watch fails it within about the job's 3 s timeout naming the stopped rank;
    once that rank is let go, the save commits nothing (rank 0 commits: its own give-up, or the other's
    recorded in the store, refuses it), ``newest`` stays ``a``, and the next save is refused by name."""
    root = str(tmp_path / "ckpt")
    got = run_world(a_peer_stops_or_is_slow, 2, root, f"stop{stopped}", _BOUND, timeout=120, pg_timeout=_BOUND)
    waiter, held = got[1 - stopped], got[stopped]
    assert waiter["said"].startswith(f"CheckpointError: rank {1 - stopped}: rank {stopped} gave no sign of life for 3s")
    assert "its process is stopped or its node is gone" in waiter["said"], waiter
    assert "The background save of checkpoint 'b' was given up: it commits nothing from now on" in waiter["said"]
    assert waiter["took"] < _BOUND + 10, waiter
    assert "given up while a peer was silent" in held["said"], held  # once let go: refused at the commit
    for g in got:
        assert [g["newest"], g["newest_after"], g["tags"]] == ["a", "a", ["a"]], got
    assert waiter["next"].startswith("CheckpointError: ") and "refused: an earlier background save" in waiter["next"]
    assert f"rank {stopped} gave no sign of life" in waiter["next"], waiter
    assert waiter["closed"].startswith("CheckpointError: the background save of checkpoint 'b' failed"), waiter


@pytest.mark.parametrize("mode", [pytest.param("slow", id="writer"), pytest.param("idle", id="idle")])
def test_an_async_save_whose_peer_writes_far_longer_than_the_jobs_timeout_succeeds(tmp_path: Any, mode: str) -> None:
    """fix70c, rev69g: rank 1 writes 6 s longer than rank 0 under a 3 s job timeout: healthy slow I/O, its
    process beating, so the save succeeds and loads back bit-exact (the background groups taking the job's
    timeout failed it). ``idle``: rank 0 alone applies retention 6 s after rank 1's short part ended: rank 1's
    idle was never written (the heartbeat thought the store still held its last idle) and rank 0 called it
    silent, giving a healthy save up (rev70c H1)."""
    root = str(tmp_path / "ckpt")
    got = run_world(a_peer_stops_or_is_slow, 2, root, mode, _BOUND, timeout=120, pg_timeout=_BOUND)
    for g in got:
        assert g["said"] == "no error" and g["newest"] == "b" and g["equal"] is True, got
    assert got[0]["took"] >= 2 * _BOUND, got  # the long part ran (idle: rank 0's own; rank 1 went idle)


def test_liveness_under_tcp_one_store_connection_per_process_and_a_stopped_store_host_fails_a_late_lane(
    tmp_path: Any,
) -> None:
    """fix71f, under ``tcp://`` (rank 0 hosts the store, as in a real job; the other tests rendezvous through
    ``file://``). Every background work's watch cloned a store connection of its own (one connect to the store
    host per work per rank); now liveness keeps one per process, the heartbeat's. And rank 0, the store's
    host, stopped while rank 1's lane starts its part late (rev70g: a clone of a stopped host hung that lane's
    thread, its future never failed): rank 1 fails within seconds saying the store did not answer; rank 0,
    let go, commits nothing (the give-up recorded in the store), ``newest`` stays ``a``."""
    root = str(tmp_path / "ckpt")
    got = run_world(the_store_host_stops, 2, root, timeout=60, pg_timeout=_BOUND, tcp=True)
    for g in got:
        assert g["clones"] == 1 and g["newest"] == "a", got
    assert got[1]["said"].startswith(f"CheckpointError: rank 1: the job's c10d store did not answer for {_BOUND:g}s")
    assert "is stopped or its node is gone" in got[1]["said"] and got[1]["took"] < _BOUND + 5, got
    assert "given up while a peer was silent" in got[0]["said"], got


def test_a_save_after_a_background_collective_timed_out_is_refused_by_name(tmp_path: Any) -> None:
    """fix70c: a background collective that timed out (groups made with 2 s here, torch's 30 minutes in a job)
    leaves its gloo group broken: every later save of that Checkpointer failed with gloo's bare "Application
    timeout caused pair closure" (a RuntimeError naming no rank). Now refused by name, on every rank."""
    root = str(tmp_path / "ckpt")
    for rank, got in enumerate(run_world(a_background_collective_times_out, 2, root, timeout=120, pg_timeout=30)):
        assert got["b"].startswith(f"CheckpointError: rank {rank} of 2: saving checkpoint 'b'"), got
        assert got["d"].startswith(f"CheckpointError: rank {rank} of 2: saving checkpoint 'd'"), got
        assert (
            "refused: the background save of 'b' failed in a collective of this Checkpointer's gloo group" in got["d"]
        )
        assert "which leaves that group broken: end the job" in got["d"] and got["newest"] == "a", got


def test_a_drain_whose_peer_stopped_fails_within_the_jobs_timeout_and_commits_nothing(tmp_path: Any) -> None:
    """fix70c: rank 1 SIGSTOPped in the drain of ``b`` to ``path``: rank 0's wait() waited for the drain group's
    30 minutes. Now it fails within about the job's 3 s timeout naming rank 1; let go, rank 1's drain reaches
    rank 0's commit, which refuses it: ``path`` keeps ``a`` as newest and holds no ``b``."""
    root = str(tmp_path / "ckpt")
    first, second = run_world(a_peer_stops_in_a_drain, 2, root, timeout=120, pg_timeout=_BOUND)
    assert first["said"].startswith("CheckpointError: the drain of checkpoint 'b' to the durable tier failed"), first
    assert "rank 0: rank 1 gave no sign of life for 3s" in first["said"], first
    assert "it commits nothing to `path` from now on" in first["said"], first
    assert first["took"] < _BOUND + 10 and first["newest"] == "a" and first["tags"] == ["a"], first
    assert "given up while a peer was silent" in second["said"], second


class _FakeStore:
    """A store in this process: counts requests; ``hold`` set: every read waits (a stopped store host). Like a
    TCPStore client, one connection serves one request at a time: a request waits for the one before it, a
    stuck read included (rev71f L4: a set let through beside a stuck read hid a set on a caller's thread)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.calls: list[str] = []
        self.hold = threading.Event()
        self.release = threading.Event()
        self.lock = threading.Lock()

    def clone(self) -> _FakeStore:
        self.calls.append("clone")
        return self

    def set(self, key: str, value: bytes) -> None:
        with self.lock:
            self.data[key] = value

    def _read(self, what: str) -> None:
        self.calls.append(what)
        if self.hold.is_set():
            self.release.wait(30)

    def check(self, keys: list[str]) -> bool:
        with self.lock:
            self._read("check")
            return all(k in self.data for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        with self.lock:
            self._read("multi_get")
            return [self.data[k] for k in keys]

    def get(self, key: str) -> bytes:
        with self.lock:
            self._read("get")
            return self.data[key]


def test_liveness_reads_over_the_heartbeats_one_connection_and_a_stuck_read_holds_no_lane(monkeypatch) -> None:
    """fix71f: each watch cloned a store connection of its own and read its peers with two requests a period (a
    check, then a multi-get). Now the heartbeat's one connection (cloned once, on its own thread) serves every
    watch of the process, and once every key was there a read is one multi-get. A read stuck on a stopped
    store host holds that connection, not the lane: ``busy_now`` returns within its bound (a TCPStore client
    serves one request at a time: a set behind a stuck get waited past 40 s), and the watch fails saying the
    store did not answer."""
    from smpckpt.api import _liveness

    store, bound, failed = _FakeStore(), 1.0, []
    store.data[_liveness._KEY.format(1)] = b"1:1"
    monkeypatch.setattr(_liveness, "_store", lambda: store)
    monkeypatch.setattr(_liveness.dist, "is_initialized", lambda: True)
    try:
        heartbeat = _liveness.Heartbeat.ensure(store, 0, _liveness._period(bound), lambda: True)
        _liveness.busy_now()
        assert store.data[_liveness._KEY.format(0)] != _liveness.IDLE  # written before busy_now returned
        lone = _liveness.Watch(heartbeat, [1], 10.0, failed.append)  # reads every 2 s
        lone.start()
        time.sleep(0.1)
        lone.stop()  # its work ended: it ends now, not at the next read (rev71f L2: it lingered up to 30 s)
        lone.join(0.5)
        assert not lone.is_alive() and heartbeat.watches == [], heartbeat.watches
        watches = [_liveness.Watch(heartbeat, [1], bound, failed.append) for _ in range(2)]
        for w in watches:
            w.start()
        deadline, beat = time.monotonic() + 30, 0
        while True:  # rank 1 beats; both watches read it over the one connection (a loaded host reads late)
            store.data[_liveness._KEY.format(1)] = f"1:{beat + 2}".encode()
            beat += 1
            time.sleep(0.2)
            reads = [c for c in list(store.calls) if c != "clone"]
            if (beat >= 6 and reads.count("multi_get") >= 3) or time.monotonic() > deadline:
                break
        assert failed == [] and store.calls.count("clone") == 1, (failed, store.calls)
        assert reads[0] == "check" and reads.count("check") == 1 and reads.count("multi_get") >= 3, reads
        store.hold.set()  # the store host stops: the next read waits
        time.sleep(0.5)
        started = time.monotonic()
        _liveness.busy_now()
        assert time.monotonic() - started < 1.5
        for w in watches:
            w.join(bound + 3)
        assert (
            failed
            == [
                f"the job's c10d store did not answer for {bound:g}s (its host, rank 0 under init_method "
                "tcp:// or env://, is stopped or its node is gone)"
            ]
            * 2
        ), failed
        assert heartbeat.watches == [], heartbeat.watches  # given up: no longer read for (rev71f L3)
    finally:
        heartbeat.stopped.set()
        store.release.set()


def test_liveness_read_period_stretches_with_the_world_so_the_store_host_keeps_up() -> None:
    """rev71f M1: N ranks each reading N keys every 30 s saturated the store host's one thread near 3,400 ranks
    (10.5 ms of its CPU per read at 4,096). The period now stretches to N² x 13 µs where longer (a fifth of that
    thread), never past half the bound; small worlds keep theirs."""
    from smpckpt.api._liveness import _read_period

    assert [_read_period(3.0, 2), _read_period(1800.0, 2), _read_period(1800.0, 1000)] == [0.6, 30.0, 30.0]
    assert _read_period(1800.0, 4096) == 4096 * 4096 * 2.6e-6 * 5  # 218 s
    assert [_read_period(60.0, 4096), _read_period(3.0, 1000)] == [30.0, 1.5]  # half the bound at most

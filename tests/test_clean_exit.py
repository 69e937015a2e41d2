"""Ranks exit 0 after a good save: nothing of the process group outlives it into interpreter shutdown.

The bug (SIGABRT, ``terminate called without an active exception``, after a successful ``dcp.save``):
a rank that exits with its gloo process group still alive leaves gloo's worker threads
(``pt_gloo_runloop``) to interpreter shutdown. A worker that releases a finished collective's tensors
after ``Py_FinalizeEx`` has begun needs the GIL; CPython ends it with ``pthread_exit``, and the
unwind through a ``noexcept`` destructor calls ``std::terminate``. It is a race (a few percent of
two-rank runs on a loaded machine, stock DCP alike), so besides the exit status every rank checks at
``atexit`` that no torch/gloo thread is left (see ``clean_exit_worker.py``): that check fails every
time the teardown is wrong, not only when the race is lost.

The recipe under test is the one the README gives user scripts: the save, then ``dist.barrier()``,
then ``dist.destroy_process_group()``, then a normal exit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.dist,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and /proc/self/task (Linux)"),
]

WORKER = os.path.join(os.path.dirname(__file__), "clean_exit_worker.py")
LEFTOVER_EXIT = 3  # clean_exit_worker.LEFTOVER_EXIT (not imported: the launcher runs in its own process)
RUNS, CONTROL = 20, 2


def _launch(folder, *args: str, timeout: float = 300.0) -> dict:
    """Run the launcher in a fresh interpreter (pytest itself is never forked); its JSON report."""
    proc = subprocess.run(
        [sys.executable, WORKER, "--out", str(folder), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    assert proc.returncode == 0, f"launcher failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report["launcher_threads"]) == 1, f"the launcher must fork from one thread: {report['launcher_threads']}"
    return report


def _describe(run: dict, rank: dict) -> str:
    how = "fresh interpreters" if run["fresh"] else "forked"
    return (
        f"run {run['run']} ({run['teardown']}, {how}, {run['rendezvous']}) rank {rank['rank']}: exit {rank['exit']}, "
        f"threads alive at exit {rank.get('leftover')}\n{rank.get('log_tail', '')}"
    )


def _unclean(runs: list[dict]) -> list[str]:
    return [
        _describe(run, rank) for run in runs for rank in run["ranks"] if rank["exit"] != 0 or rank.get("leftover") != []
    ]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """One launcher: RUNS two-rank saves with the recipe teardown, then CONTROL without any teardown."""
    return _launch(tmp_path_factory.mktemp("clean-exit"), "--runs", str(RUNS), "--control", str(CONTROL))


def test_twenty_two_rank_saves_all_exit_zero(report):
    """20 pairs of rank processes (file:// and TCPStore rendezvous alternating) save with our planner and
    writer, barrier, destroy the group and exit normally: every rank exits 0, no torch/gloo thread alive."""
    runs = [r for r in report["runs"] if r["teardown"] == "recipe"]
    assert len(runs) == RUNS
    bad = _unclean(runs)
    assert not bad, f"{len(bad)} of {2 * RUNS} rank exits not clean:\n" + "\n".join(bad)


def test_exit_without_destroy_is_caught_every_time(report):
    """The control: skip the teardown and gloo's worker threads are still alive when the interpreter
    begins to exit (what aborts at random); the check catches it on every rank, every run (exit 3)."""
    runs = [r for r in report["runs"] if r["teardown"] == "none"]
    assert len(runs) == CONTROL
    for run in runs:
        for rank in run["ranks"]:
            assert rank["exit"] == LEFTOVER_EXIT, _describe(run, rank)
            assert any(name.startswith("pt_gloo") for name in rank["leftover"]), _describe(run, rank)


@pytest.mark.slow
def test_fresh_interpreter_pairs_exit_zero(tmp_path):
    """The same recipe with each rank a brand-new interpreter (as torchrun starts them), 2 pairs."""
    report = _launch(tmp_path, "--runs", "0", "--fresh", "2")
    bad = _unclean(report["runs"])
    assert not bad, "\n".join(bad)

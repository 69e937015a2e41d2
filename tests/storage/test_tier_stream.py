"""The fast tier's replicas sent while they are written (``smpckpt.storage.tier.writer``): two real gloo
ranks, each a node of its own, exchanging the files they write."""

from __future__ import annotations

import json
import multiprocessing
import threading
from pathlib import Path
from typing import Any

import pytest
import tier_stream_workers
from dist_harness import RankFailed, run_world

from smpckpt.storage.tier import Workers


@pytest.mark.dist
def test_files_reach_the_peer_as_written_aborted_and_unsafe_ones_do_not(tmp_path: Path) -> None:
    out = run_world(tier_stream_workers.exchange, 2, str(tmp_path), timeout=120)
    for rank, got in enumerate(out):
        peer = 1 - rank
        names = [f"from{peer}-{n}" for n in ("big.bin", "empty.bin", "small.bin")] + (
            ["from1-after.bin"] if peer else []
        )
        assert got["exact"] == {n: True for n in names}, (rank, got)  # byte-exact, small writes coalesced
        assert got["received"] == sorted(names), (rank, got)
        # the aborted file is discarded (no temp file stays); each rank's own files are its writer's
        assert not [n for n in got["listing"] if ("aborted" in n and n.startswith("from")) or ".recv." in n], got
        own = [f"own-{rank}-{n}" for n in ("big.bin", "empty.bin", "small.bin")] + (
            ["own-1-after", "own-1-escape"] if rank else []
        )
        assert [n for n in got["listing"] if n.startswith("own-")] == sorted(own), got
    # rank 0 refused the climbing name (an error), and kept receiving: rank 1's next file arrived
    assert len(out[0]["errors"]) == 1 and "'../escape'" in out[0]["errors"][0], out[0]["errors"]
    assert out[1]["errors"] == [] and not out[0]["escaped"]


@pytest.mark.dist
def test_a_slow_peer_makes_the_writer_wait_with_at_most_the_cap_queued(tmp_path: Path) -> None:
    """Rank 0 writes 16 MiB while its data sends are held back (cap 4 MiB): the writer waits once the cap
    is queued (without the cap it wrote all 16 MiB into the queue); released, the file arrives whole."""
    out = run_world(tier_stream_workers.bounded_queue, 2, str(tmp_path), timeout=120)
    cap = tier_stream_workers.CAP
    assert out[0]["waited"] is True, out[0]
    assert out[0]["peak_while_held"] == cap, out[0]  # filled to the cap, not past it
    assert 0 < out[0]["peak"] <= cap and "error" not in out[0], out[0]
    assert out[1]["exact"] is True, out[1]  # byte-exact at the peer once the sends went on
    assert out[0]["errors"] == [] and out[1]["errors"] == [], out


@pytest.mark.dist
def test_a_failed_send_wakes_the_waiting_writer_with_an_error(tmp_path: Path) -> None:
    """Rank 0's writer waits on its held-back sends; they fail (the peer's connection lost): the writer
    wakes with an error naming the peer instead of waiting on. Rank 1 then stops (it never got the end of
    rank 0's stream), so it has no result; rank 0's report is a file."""
    with pytest.raises(RankFailed, match="rank 1: no result"):
        run_world(tier_stream_workers.failed_peer, 2, str(tmp_path), timeout=120)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["waited"] is True and report["producer_alive"] is False, report
    assert "sending replicas to rank 1 failed" in report["error"] and "injected" in report["error"], report
    assert report["error"].startswith("CheckpointError"), report
    assert 0 < report["peak"] <= tier_stream_workers.CAP, report
    assert any("sending replicas to rank 1 failed" in e for e in report["errors"]), report  # close() returned


@pytest.mark.dist
def test_two_saves_share_the_workers_threads_and_send_at_most_a_chunk_per_message(tmp_path: Path) -> None:
    """rss61: the channels of both saves ran on the same threads (a receiver's buffer is kept, not
    allocated per save), a write of twice ``CHUNK`` went out in messages of at most ``CHUNK`` bytes and
    arrived byte-exact; none of the threads is left after close."""
    out = run_world(tier_stream_workers.reused_workers, 2, str(tmp_path), timeout=120)
    for got in out:
        assert len(got["threads"][0]) == 2 and got["threads"][0] == got["threads"][1], got
        assert got["after_close"] == [] and got["errors"] == [] and got["exact"] == [True, True], got
        assert 0 < got["largest"] <= got["chunk"], got


def _child(workers: Workers, q: Any) -> None:
    try:
        q.put(workers.pool(2).submit(threading.get_native_id).result(timeout=20))
        workers.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        q.put(f"{type(exc).__name__}: {exc}")


def test_workers_in_a_forked_child_run_on_threads_of_its_own() -> None:
    """A DataLoader-like fork after the pool ran a task: the child's pool is fresh (the parent's threads
    are not in the child; the parent's pool, reused there, never ran the child's task)."""
    workers = Workers("smpckpt-test-fork")
    try:
        parent = workers.pool(2).submit(threading.get_native_id).result(timeout=20)
        fork = multiprocessing.get_context("fork")
        q = fork.Queue()
        child = fork.Process(target=_child, args=(workers, q))
        child.start()
        got = q.get(timeout=60)
        child.join(30)
        assert isinstance(got, int) and got != parent, got
        assert workers.pool(2).submit(threading.get_native_id).result(timeout=20) == parent  # the parent's, reused
    finally:
        workers.close()


def test_workers_forked_while_another_thread_holds_its_lock_do_not_deadlock_the_child() -> None:
    """A DataLoader-like fork while a pool task is inside the pool's bookkeeping (its lock held, as a save
    asking for the pool is): the child's pool is usable at once (a fresh lock), the parent's unharmed. A
    hang fails by the bounded waits (the child is killed), not by hanging the run."""
    workers = Workers("smpckpt-test-fork-lock")
    inside, release = threading.Event(), threading.Event()

    def hold() -> None:  # the lock held as pool() or close() hold it, for as long as the fork takes
        with workers._lock:
            inside.set()
            release.wait(30)

    try:
        task = workers.pool(2).submit(hold)
        assert inside.wait(20)
        fork = multiprocessing.get_context("fork")
        q = fork.Queue()
        child = fork.Process(target=_child, args=(workers, q))
        child.start()
        try:
            got = q.get(timeout=30)
        finally:
            release.set()
            child.join(10)
            if child.is_alive():
                child.kill()
                child.join(10)
        assert isinstance(got, int) and child.exitcode == 0, (got, child.exitcode)
        task.result(timeout=20)
        assert workers.pool(2).submit(threading.get_native_id).result(timeout=20)  # the parent's still serves
    finally:
        release.set()
        workers.close()

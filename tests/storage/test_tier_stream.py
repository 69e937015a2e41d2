"""The fast tier's replicas sent while they are written (``smpckpt.storage.tier.writer``): two real gloo
ranks, each a node of its own, exchanging the files they write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tier_stream_workers
from dist_harness import RankFailed, run_world


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

"""The fast tier's replicas sent while they are written (``smpckpt.storage.tier.writer``): two real gloo
ranks, each a node of its own, exchanging the files they write."""

from __future__ import annotations

from pathlib import Path

import pytest
import tier_stream_workers
from dist_harness import run_world


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

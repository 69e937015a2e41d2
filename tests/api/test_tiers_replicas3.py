"""Tiered checkpoints with ``replicas=3``: 3 simulated nodes x 1 gloo rank (``LOCAL_WORLD_SIZE=1``), each
rank's files streamed to both other nodes while written. Two nodes' folders lost: resumed from the third's
replicas; a damaged copy healed from a peer; a drain whose first two copies of a file are damaged takes the
third; ``smpckpt verify --local`` of the three folders."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import tier_three_workers
from dist_harness import run_world

from smpckpt.tools.cli import main as cli_main


def _cli(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = cli_main(list(argv), stdout=out, stderr=err)
    return rc, out.getvalue() + err.getvalue()


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    base = tmp_path_factory.mktemp("replicas3")
    return base, run_world(tier_three_workers.three_replicas, 3, str(base))


@pytest.mark.dist
def test_replicas3_two_nodes_lost_resume_from_the_third(three: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = three
    names = results[0]["names"]
    for rank, r in enumerate(results):
        assert r["replicated"], rank  # every node held every rank's file, byte-identical
        got = r["two_lost"]
        assert (got["tag"], got["tier"], got["exact"]) == ("s1", "fast", True), (rank, got)
        peers = got["from_peers"]
        assert {src for _, src, _ in peers} == {0}, peers  # node 0 alone survived
        # node 1 read rank 1's file and rank 0's (user_content), node 2 rank 2's and rank 0's
        assert sorted(peers) == sorted([(names[0], 0, 1), (names[1], 0, 1), (names[0], 0, 2), (names[2], 0, 2)]), peers


@pytest.mark.dist
def test_replicas3_a_damaged_copy_heals_from_a_peer(three: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = three
    names = results[0]["names"]
    for rank, r in enumerate(results):
        got = r["healed_resume"]
        assert (got["tag"], got["tier"], got["exact"]) == ("s1", "fast", True), (rank, got)
        assert [(n, dst) for n, _, dst in got["from_peers"]] == [(names[0], 0)], got
    assert results[0]["healed"]


@pytest.mark.dist
def test_replicas3_drain_takes_the_third_copy(three: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = three
    assert len(results[0]["damaged"]) == len(results[1]["damaged"]) == 1 and not results[2]["damaged"]
    for rank, r in enumerate(results):
        assert r["durable"] == ["newest", "s2_partial"], r["durable"]
        assert r["durable_is_node2s"], rank
        got = r["from_path"]
        assert (got["tag"], got["tier"], got["exact"]) == ("s2", "durable", True), (rank, got)


@pytest.mark.dist
def test_replicas3_verify_local_of_the_three_folders(three: tuple[Path, list[dict[str, Any]]]) -> None:
    """s3, saved with the three nodes up: every replica intact. s1, resumed after two nodes were lost:
    those nodes fetched only what their ranks read, so two replicas are missing, each named. s2, whose
    copies of rank 0's file on nodes 0 and 1 were damaged before its drain: both named."""
    base, results = three
    nodes = [str(base / "fast" / f"node{n}") for n in range(3)]
    durable = base / "durable"
    rc, text = _cli("verify", f"{durable}/s3", "--local", *nodes)
    assert rc == 0 and "OK fast tier s3: complete;" in text, text
    assert all(f"node{n}: committed; 3/3 data files (all of ranks 0-2)" in text for n in range(3)), text

    names = results[0]["names"]
    rc, text = _cli("verify", f"{durable}/s1", "--local", *nodes)
    assert rc == 1 and "FAILED fast tier s1: 2 problem(s)" in text, text
    for r in (1, 2):
        assert f"{names[r]} (rank {r}'s data file) is held intact by 2 of the 3 folders replicas=3" in text, text

    rc, text = _cli("verify", f"{durable}/s2", "--local", *nodes)
    assert rc == 1 and text.count("checksum mismatch") == 2, text
    assert f"OK {durable}/s2_partial" in text, text  # the drained copy: node 2's, intact

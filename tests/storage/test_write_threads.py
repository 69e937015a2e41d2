"""The writer's and the reader's default thread counts: 4 per rank, fewer locally when a node's ranks
would oversubscribe its CPUs (measured: 8 ranks x 4 threads on 16 cores saved slower than DCP's single
thread; 4 reader threads on 2 CPUs loaded from the page cache slower than 2)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter, FullArtifactReader
from smpckpt.storage.backends._fs import MAX_WRITE_THREADS, default_read_threads, default_write_threads

CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@pytest.mark.parametrize("ranks", [None, "1", "2", "3", "8", str(4 * max(CPUS, 4))])
def test_local_writers_share_the_cpus_among_the_node_ranks(monkeypatch: pytest.MonkeyPatch, ranks: str | None) -> None:
    """The most threads (at most 4) whose total over the node's ranks fits its CPUs (at least 4), and
    never fewer than one."""
    if ranks is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
    n, budget = int(ranks or 1), max(CPUS, MAX_WRITE_THREADS)
    got = default_write_threads(local=True)
    assert 1 <= got <= MAX_WRITE_THREADS
    assert n * got <= budget or got == 1  # fits the CPUs (one thread each at the least)
    assert n * (got + 1) > budget or got == MAX_WRITE_THREADS  # and no more would still fit
    if n == 1:
        assert got == MAX_WRITE_THREADS  # one rank per node: unchanged from before
    assert default_write_threads(local=False) == MAX_WRITE_THREADS  # uploads wait on the network


def test_a_malformed_local_world_size_counts_as_one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "eight")
    assert default_write_threads(local=True) == MAX_WRITE_THREADS


def test_writer_resolves_its_default_and_keeps_an_explicit_count(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(4 * max(CPUS, 4)))
    assert FsspecStorageWriter(str(tmp_path / "a")).thread_count == 1
    assert FsspecStorageWriter(str(tmp_path / "b"), thread_count=3).thread_count == 3
    with pytest.raises(ValueError, match="thread_count must be >= 1"):
        FsspecStorageWriter(str(tmp_path / "c"), thread_count=0)


@pytest.mark.parametrize("ranks", [None, "1", "2", "8", str(4 * max(CPUS, 4))])
def test_local_readers_use_at_most_the_ranks_cpus_and_at_least_two(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, ranks: str | None
) -> None:
    """A load from the page cache is CPU work (the kernel's copy and the checksum): a local reader's
    default is 4 threads, no more than the CPUs this rank may use, and at least 2 (one reads while
    another verifies); object stores wait on the network and keep 4. An explicit count is kept."""
    if ranks is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
    per_rank = max(1, CPUS // int(ranks or 1))
    want = max(2, min(MAX_WRITE_THREADS, per_rank))
    assert default_read_threads(local=True) == want
    assert default_read_threads(local=False) == MAX_WRITE_THREADS
    assert FsspecStorageReader(str(tmp_path)).thread_count == want
    assert FullArtifactReader(str(tmp_path)).thread_count == want
    assert FsspecStorageReader(str(tmp_path), thread_count=3).thread_count == 3
    assert FullArtifactReader(str(tmp_path), thread_count=5).thread_count == 5
    with pytest.raises(ValueError, match="thread_count must be >= 1"):
        FsspecStorageReader(str(tmp_path), thread_count=0)
    # a count set on the reader outlives a reset (dcp.load(checkpoint_id=...) resets it); the default
    # follows the location
    reader = FsspecStorageReader(str(tmp_path))
    reader.thread_count = 7
    reader.reset(str(tmp_path))
    assert reader.thread_count == 7
    assert FsspecStorageReader("memory://threads").thread_count == MAX_WRITE_THREADS
    # the request cost is settable too (rev71e L1: it became a per-backend default without a setter)
    reader.request_cost_bytes = 0
    assert reader.request_cost_bytes == 0
    reader.request_cost_bytes = None
    assert reader.request_cost_bytes == 16 << 10  # local disk's default
    assert FsspecStorageReader("memory://threads").request_cost_bytes == 1 << 20  # object stores'

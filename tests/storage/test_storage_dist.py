"""Multi-rank save/load with spawned gloo ranks (tests/dist_harness.run_world), local and S3."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_harness import run_world
from storage_dist_fns import full_w, kill_entry, reshard_load, save_load_and_fail

from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter, checkpoint_state, read_manifest

pytestmark = pytest.mark.dist
# No warning filters here: the parent's only warning (DCP's "torch.distributed is disabled" for the
# single-process saves/loads) is ignored by pyproject.toml, and a new warning must stay visible.


def _check(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r == {
            "ok_first": True,
            "returned_index": True,
            "failed_everywhere": True,
            "old_still_loads": True,
            "same_commit": True,
            "state": "committed",
            "files": r["files"],
            "stray_files": [],
            "not_removed": [],
        }
        assert r["files"] >= 2  # both ranks wrote data


def test_two_ranks_local(tmp_path: Any) -> None:
    _check(run_world(save_load_and_fail, 2, str(tmp_path / "ck"), {}, timeout=150))


@pytest.mark.s3
def test_two_ranks_s3(s3: tuple[str, dict[str, Any]]) -> None:
    base, opts = s3
    _check(run_world(save_load_and_fail, 2, f"{base}/dist", opts, timeout=150))


def test_reshard_tp1_to_tp4_reads_only_needed_bytes(tmp_path: Any) -> None:
    url = str(tmp_path / "tp1")
    full = torch.randn(4096, 256, generator=torch.Generator().manual_seed(3))
    # other tensors around it in the file, so "reading everything" would show
    dcp.save({"big": full, "other": torch.randn(1000, 300)}, storage_writer=FsspecStorageWriter(url, thread_count=1))
    results = run_world(reshard_load, 4, url, timeout=150)
    for r in results:
        assert r["equal"]
        assert r["needed"] == r["local_bytes"]
        assert r["read"] <= 1.05 * r["needed"], r


def test_killed_rank_leaves_previous_checkpoint(tmp_path: Any) -> None:
    url = str(tmp_path / "kill")
    old = {"w": torch.zeros(64, 48), "b": torch.zeros(10), "step": None}
    dcp.save({"w": full_w(9), "b": torch.arange(10.0), "step": 9}, storage_writer=FsspecStorageWriter(url))
    save_id = read_manifest(url).save_id
    ctx = mp.get_context("spawn")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    procs = [ctx.Process(target=kill_entry, args=(r, 2, str(tmp_path / "rdzv"), url, str(out_dir))) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    assert not hung, "a rank hung after its peer died"
    assert procs[1].exitcode == 17  # killed mid-write
    report = (out_dir / "rank0.txt").read_text()
    assert report.startswith("error:"), report  # the surviving rank got an error
    assert checkpoint_state(url) == "committed" and read_manifest(url).save_id == save_id
    dcp.load(old, storage_reader=FsspecStorageReader(url))
    assert torch.equal(old["w"], full_w(9)) and torch.equal(old["b"], torch.arange(10.0)) and old["step"] == 9

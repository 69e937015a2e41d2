"""CI smoke of the benchmark driver: ``benchmarks/bench.py --quick`` runs, in one process and under
``torch.distributed.run`` with 2 ranks, and writes its JSON and valid PNGs. No timing assertions: these
machines are shared and the quick sizes are far too small for speed claims (see benchmarks/RESULTS.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench.py"
TIERS = ROOT / "benchmarks" / "bench_tiers.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LOCAL = {
    "raw write+fsync / read",
    "smpckpt partial",
    "smpckpt full",
    "DCP FileSystemWriter defaults",
    "DCP FileSystemWriter thread_count=4",
    "DCP FsspecWriter",
    "torch.save per rank",
}
S3 = {"smpckpt partial", "smpckpt full", "DCP FsspecWriter", "s3torchconnector"}
OP_FIELDS = {"s", "agg_GBps", "per_rank_GBps", "cpu_s", "extra_rss_per_rank", "device_read_frac"}


def _run(cmd: list[str], tmp_path: Path, timeout: int) -> dict[str, Any]:
    out = tmp_path / "out"
    disk = tmp_path / "disk"
    # a session of its own: on a timeout the launcher's ranks and the moto child go with it
    proc = subprocess.Popen(
        [*cmd, "--quick", "--out", str(out), "--disk-dir", str(disk)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"bench.py --quick took over {timeout} s:\n{stdout[-3000:]}{stderr[-3000:]}")
    assert proc.returncode == 0, stdout[-4000:] + stderr[-4000:]
    for name in ("throughput.png", "amplification.png", "planning.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000, name
    assert not [p for p in disk.iterdir() if p.name.startswith("bench-")], "checkpoints left behind"
    return dict(json.loads((out / "bench.json").read_text()))


def _check_storage(res: dict[str, Any], storage: str, expected: set[str], ranks: int) -> None:
    data = res["storages"][storage]
    assert len(data["bytes_per_rank"]) == ranks
    ran, skipped = set(data["records"]), set(data["skipped"])
    assert ran | skipped == expected, (storage, ran, skipped)
    # the package's own contenders and DCP's must run; only optional ones may be skipped (with a reason)
    assert {"smpckpt partial", "smpckpt full", "DCP FsspecWriter"} <= ran, data["skipped"]
    assert all(data["skipped"].values())
    ops = {"save", "load_cold", "load_warm"} if storage == "disk" else {"save", "load_warm"}
    for name in ran:
        summary = res["summary"][storage][name]
        assert set(summary) == ops, (storage, name)
        for row in summary.values():
            assert OP_FIELDS <= set(row) and len(row["per_rank_GBps"]) == ranks
            assert row["agg_GBps"] > 0
    ours = res["summary"][storage]["smpckpt partial"]
    for op in ops - {"save"}:
        assert ours[op]["read_ampl"] == pytest.approx(1.0)  # same layout: exactly what is needed


@pytest.mark.timeout(240)
def test_quick_single_process(tmp_path: Path) -> None:
    res = _run([sys.executable, str(BENCH)], tmp_path, timeout=220)
    assert res["env"]["world_size"] == 1
    _check_storage(res, "disk", LOCAL, 1)
    if os.path.isdir("/dev/shm"):
        _check_storage(res, "shm", LOCAL, 1)
    _check_storage(res, "s3", S3, 1)
    assert res["cold_probe"]["bytes"] > 0
    assert len(res["reshard"]) == 4
    for rows in res["reshard"].values():
        assert set(rows) == {"smpckpt", "DCP FileSystemReader"}
        assert rows["smpckpt"]["stats_ampl"] >= 1.0 and rows["DCP FileSystemReader"]["rchar_ampl"] >= 1.0
    # one resharding rank beside DCP, cold and warm (loaded values checked bit-exact by the script)
    assert len(res["reshard_speed"]) == 3
    for case, row in res["reshard_speed"].items():
        # column cases also time the reader a request per row (request_cost_bytes=0), and a TP=1 full
        # artifact both ways
        full, full_per_row = "smpckpt full artifact", "smpckpt full artifact, a request per row"
        extra = {"smpckpt, a request per row", full, full_per_row} if "dim 1" in case else set()
        assert set(row["readers"]) == {"smpckpt", "DCP FileSystemReader"} | extra, case
        if "bf16" in case:  # short rows: the full artifact streams (few requests), unlike a request per row
            streamed, per_row = (row["readers"][w]["cold"]["stats"]["requests"] for w in (full, full_per_row))
            assert 0 < streamed < per_row, (case, streamed, per_row)
        assert set(row["dcp_over_ours"]) == {"cold", "warm"}
        stats = row["readers"]["smpckpt"]["cold"]["stats"]
        assert stats["bytes_requested"] >= stats["bytes_needed"] == row["needed"] > 0
    goals = res["goals"]
    assert len(goals) >= 10 and all({"goal", "target", "met"} <= set(g) for g in goals)
    assert res["planning"]["rows"]


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_quick_two_ranks_on_disk(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(BENCH), "--storage", "disk", "--contenders", "smpckpt,raw,FileSystemWriter defaults", "--no-reshard"]
    res = _run(cmd, tmp_path, timeout=110)
    assert res["env"]["world_size"] == 2 and res["env"]["backend"] == "gloo"
    data = res["storages"]["disk"]
    assert set(data["records"]) == {
        "raw write+fsync / read",
        "smpckpt partial",
        "smpckpt full",
        "DCP FileSystemWriter defaults",
    }
    for name in data["records"]:
        assert len(res["summary"]["disk"][name]["load_cold"]["per_rank_GBps"]) == 2


@pytest.mark.dist
@pytest.mark.s3
@pytest.mark.timeout(150)
def test_bench_tiers_quick(tmp_path: Path) -> None:
    """``bench_tiers.py --quick``: 4 gloo ranks (2 simulated nodes), every save, drain and resume case
    measured (the script itself checks every resume bit-exact and from the tier it names), its folders
    removed. No timing assertions."""
    out, disk, shm = tmp_path / "tiers.json", tmp_path / "disk", tmp_path / "shm"
    cmd = [sys.executable, str(TIERS), "--quick", "--out", str(out), "--disk-dir", str(disk), "--shm-dir", str(shm)]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=130)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script's session: its ranks and the moto child
        stdout, stderr = proc.communicate()
        pytest.fail(f"bench_tiers.py --quick took over 130 s:\n{stdout[-3000:]}{stderr[-3000:]}")
    assert proc.returncode == 0, stdout[-4000:] + stderr[-4000:]
    res = json.loads(out.read_text())
    assert {"cpus", "platform", "torch", "date"} <= set(res["env"])
    assert res["state_bytes"] == sum(res["raw"]["bytes_per_rank"]) > 0 and len(res["raw"]["bytes_per_rank"]) == 4
    summary = res["summary"]
    cases = {
        "save": {"tier_r2", "tier_r1", "shm", "disk", "s3"},
        "drain": {"drain_disk", "drain_s3"},
        "resume": {"fast", "fast_peer", "disk_cold", "disk_warm", "s3"},
    }
    for phase, keys in cases.items():
        assert set(summary[phase]) == keys | {"_cpu"}, phase
        for key in keys:
            assert summary[phase][key]["s"]["median"] > 0, (phase, key)
            assert len(res["raw"][phase][key]) == res["config"]["rounds"]
        assert summary[phase]["_cpu"]["wall_s"] > 0
    assert all(summary["drain"][k]["drain_s"]["median"] > 0 for k in cases["drain"])
    assert summary["save"]["tier_r2"]["x_shm"]["median"] > 0  # the replicated save beside a plain /dev/shm save
    resume = res["raw"]["resume"]
    for key in cases["resume"]:
        tiers = {out[0] for rec in resume[key] for out in rec["out"]}
        assert tiers == ({"fast"} if key.startswith("fast") else {"durable"}), key
    assert summary["resume"]["fast_peer"]["from_peers_files"] > 0
    assert summary["resume"]["fast"]["from_peers_files"] == 0
    assert not list(disk.iterdir()) and not list(shm.iterdir()), "folders left behind"

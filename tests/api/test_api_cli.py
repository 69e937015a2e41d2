"""The smpckpt CLI on local and S3 (moto) checkpoints: ls, inspect, verify (incl. corruption), prune."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

from smpckpt import ParallelLayout, save_checkpoint
from smpckpt.catalog.root import apply_retention
from smpckpt.storage import open_fs
from smpckpt.tools.cli import main


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = main(list(argv), stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def _populate(root: str, options: dict[str, Any] | None = None) -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2))
    for i in range(3):
        save_checkpoint(root, f"step{i}", model=m, user_content={"step": i, "lr": 0.1}, storage_options=options)


def _corrupt_one_data_file(folder: str, options: dict[str, Any] | None) -> str:
    fs, path = open_fs(folder, options)
    name = sorted(n for n in fs.find(path) if n.endswith(".distcp"))[0]  # data files may sit in prefix folders
    data = bytearray(fs.cat_file(name))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(name, bytes(data))
    return name.rsplit("/", 1)[-1]


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def root(request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, Any], list[str]]:
    """(root URL, storage options, CLI option args) with three committed checkpoints."""
    if request.param == "local":
        url, options = str(tmp_path / "run"), {}
    else:
        url, options = request.getfixturevalue("s3_root")
    _populate(url, options or None)
    args = ["--storage-options", json.dumps(options)] if options else []
    return url, options, args


def test_ls(root: tuple[str, dict[str, Any], list[str]]) -> None:
    url, _, opts = root
    rc, out, _ = _run("ls", url, *opts)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split() == ["TAG", "SEQ", "STATE", "SIZE", "LAYOUT", "SAVED"]
    assert [ln.split()[0] for ln in lines[1:3]] == ["step0", "step1"]
    assert lines[3].split()[:4] == ["*", "step2", "3", "committed"]  # the third save under the root
    assert "tp=1 pp=1 dp=1" in lines[3]
    rc, out, _ = _run("ls", url, "--json", *opts)
    data = json.loads(out)
    assert data["newest"] == "step2"
    assert [c["tag"] for c in data["checkpoints"]] == ["step0", "step1", "step2"]
    assert [c["sequence"] for c in data["checkpoints"]] == [1, 2, 3]
    assert all(c["size"] > 0 and c["layout"]["tp"] == 1 for c in data["checkpoints"])


def test_inspect(root: tuple[str, dict[str, Any], list[str]]) -> None:
    url, _, opts = root
    rc, out, _ = _run("inspect", f"{url}/step1", "--json", *opts)
    assert rc == 0
    info = json.loads(out)
    assert info["tag"] == "step1" and info["state"] == "committed"
    assert info["user_content_keys"] == ["step", "lr"]
    tensors = {t["key"]: t for t in info["tensors"]}
    assert tensors["model.0.weight"] == {
        "key": "model.0.weight",
        "shape": [4, 8],
        "dtype": "float32",
        "chunks": 1,
        "bytes": 128,
    }
    rc, out, _ = _run("inspect", f"{url}/step1_partial", *opts)  # the folder itself works too
    assert rc == 0 and "model.0.weight" in out and "user content: step, lr" in out


def test_verify_ok_and_corrupted(root: tuple[str, dict[str, Any], list[str]]) -> None:
    url, options, opts = root
    rc, out, err = _run("verify", f"{url}/step2", "--progress", "always", *opts)
    assert rc == 0 and out.startswith("OK") and "verify: 100%" in err, err
    bad = _corrupt_one_data_file(f"{url}/step1_partial", options or None)
    rc, out, err = _run("verify", f"{url}/step1", *opts)
    assert rc == 1
    assert "FAILED" in err and bad in err and "checksum mismatch" in err
    rc, _, err = _run("verify", f"{url}/nope", *opts)
    assert rc == 1 and "nothing committed" in err


def test_prune(root: tuple[str, dict[str, Any], list[str]]) -> None:
    url, _, opts = root
    rc, out, _ = _run("prune", url, "--keep", "1", "--dry-run", *opts)
    assert rc == 0 and out.split("\n")[:2] == ["would remove step0", "would remove step1"]
    rc, out, _ = _run("prune", url, "--keep", "2", *opts)
    assert rc == 0 and out.strip() == "removed step0"
    rc, out, _ = _run("ls", url, "--json", *opts)
    assert [c["tag"] for c in json.loads(out)["checkpoints"]] == ["step1", "step2"]
    rc, _, err = _run("prune", url, "--keep", "0", *opts)
    assert rc == 2 and "--keep" in err


def test_prune_names_a_damaged_newest_once(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """rev63f F2: retention reads ``newest`` again before each removal (two jobs in one root), so a damaged one was
    warned about once per tag removed (12 identical warnings over 12 tags): now once per prune, and per pass."""
    root = str(tmp_path)
    _populate(root)
    save_checkpoint(root, "step3", model=nn.Linear(2, 2))
    with open(os.path.join(root, "newest"), "w") as f:
        f.write("bad tag!\n")
    rc, out, _ = _run("prune", root, "--keep", "1", "--dry-run")
    assert rc == 0 and out.splitlines() == [f"would remove step{i}" for i in range(3)], out
    said = [r.getMessage() for r in caplog.records if "which is not a valid tag" in r.getMessage()]
    assert said == [f"{os.path.join(root, 'newest')} holds 'bad tag!', which is not a valid tag; ignoring it"], said
    caplog.clear()
    assert apply_retention(root, 1).removed == ("step0", "step1", "step2")
    assert sum("which is not a valid tag" in r.getMessage() for r in caplog.records) == 1, caplog.records


def test_verify_uncommitted_folder_fails(tmp_path: Any) -> None:
    root = str(tmp_path)
    _populate(root)
    os.remove(os.path.join(root, "step1_partial", "smpckpt.manifest.json"))
    rc, _, err = _run("verify", f"{root}/step1")
    assert rc == 1 and "uncommitted" in err
    rc, out, _ = _run("ls", root)
    assert "uncommitted" in out


def test_ls_says_when_newest_is_behind_what_a_resume_loads(tmp_path: Any) -> None:
    # a job stopped between a commit and the update of 'newest': ls marked the older tag with '*' and said
    # nothing, while a resume without a tag loads the later one
    root = str(tmp_path)
    _populate(root)
    with open(os.path.join(root, "newest"), "w") as f:
        f.write("step0\n")
    rc, out, _ = _run("ls", root)
    assert rc == 0 and out.splitlines()[1].split()[:2] == ["*", "step0"]
    assert (
        "warning: 'newest' names 'step0', but 'step2' was numbered after it: a resume without a tag loads 'step2'"
        in out
    )
    with open(os.path.join(root, "newest"), "w") as f:
        f.write("step2\n")
    assert "warning" not in _run("ls", root)[1]


def test_python_dash_m_entry_point(tmp_path: Any) -> None:
    root = str(tmp_path)
    save_checkpoint(root, "only", model=nn.Linear(2, 2), layout=ParallelLayout())
    proc = subprocess.run(
        [sys.executable, "-m", "smpckpt", "verify", f"{root}/only"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("OK")


def test_closed_pipe_exits_quietly(tmp_path: Any) -> None:
    root = str(tmp_path)
    _populate(root)
    proc = subprocess.Popen(
        [sys.executable, "-m", "smpckpt", "inspect", f"{root}/step1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # like `| head` that already exited: every write hits a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert err == ""

"""A crafted ``.metadata`` cannot make a load build without bound, nor change what the process shares.

Allow-listed callables build what they are given (``frozenset(range(10**12))``), the memo hands one
object to them many times, and one big dict can be the state of many objects: each bomb here is a few
hundred bytes to a few MB and, unbounded, allocates until memory runs out (or hashes for hours). Every
case runs in a child process under an address-space limit (``RLIMIT_AS``: what the child holds after
its imports, plus 1 GiB) and a wall-clock timeout, so a regression fails fast -- the child reports a
raw ``MemoryError``, dies or times out -- instead of eating the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

_PRELUDE = """
import copyreg, json, os, pickle, resource, struct, sys
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import WriteItemType
import torch.serialization
from smpckpt.errors import CheckpointError
from smpckpt.storage.format._safe_pickle import load_metadata

def _vm_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")

_limit = _vm_bytes() + (1 << 30)
resource.setrlimit(resource.RLIMIT_AS, (_limit, _limit))

class R:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args
    def __reduce__(self):
        return (self.fn, self.args)

def md(value):
    return pickle.dumps(Metadata(state_dict_metadata={}, planner_data={"x": value}), protocol=4)

def outcome(data, where):
    try:
        load_metadata(data, where=where)
    except CheckpointError as exc:
        return [type(exc).__name__, str(exc)]
    except BaseException as exc:
        return ["raw " + type(exc).__name__, str(exc)[:200]]
    return ["loaded", ""]
"""


def _child(body: str, *args: str, timeout: float = 90.0) -> Any:
    """Run ``_PRELUDE + body`` in a fresh interpreter under the memory limit; its last stdout line, as JSON."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    code = _PRELUDE + textwrap.dedent(body)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the child did not finish within {timeout} s: unpickling is not bounded")
    assert proc.returncode == 0, f"the child failed (status {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


_BOMBS = """
big = tuple(range(200_000))
text = " " * 1_000_000 + "1"  # one string, memoised: complex() parses it at every call
n_keys, n_builds = 20_000, 20_000
build = bytearray(b"\\x80\\x04}\\x94(")  # one dict of n_keys fields, memoised as 0 ...
for i in range(n_keys):
    key = f"k{i}".encode()
    build += b"\\x8c" + bytes([len(key)]) + key + b"N"
build += b"u\\x8c\\x25torch.distributed.checkpoint.metadata\\x8c\\x14ChunkStorageMetadata\\x93\\x94]\\x94("
build += b"h\\x01)\\x81h\\x00b" * n_builds  # ... the state of n_builds new objects
build += b"e."
bombs = {
    "frozenset_range": md(R(frozenset, (range(10**12),))),
    "reconstructor_set": md(R(copyreg._reconstructor, (set, set, range(10**12)))),
    "size_range": md(R(torch.Size, (range(10**10),))),
    "memo_reuse": md([R(frozenset, (big,)) for _ in range(20_000)]),
    "complex_text": md([R(complex, (text,)) for _ in range(100_000)]),
    "build_reuse": bytes(build),
    "memo_index": b"\\x80\\x04N" + b"r" + struct.pack("<I", 2**31) + b".",
}
print(json.dumps({name: outcome(data, f"/ckpt/{name}/.metadata") for name, data in bombs.items()}))
"""


def test_allocation_bombs_are_refused_as_corrupt_naming_the_file() -> None:
    results = _child(_BOMBS, timeout=120)
    for name, (kind, message) in results.items():
        assert kind == "CheckpointCorrupt", (name, kind, message)
        assert f"/ckpt/{name}/.metadata" in message, (name, message)
    assert "refused to unpickle" in results["frozenset_range"][1]
    assert "fields" in results["build_reuse"][1]
    assert "ran out of memory" in results["memo_index"][1]


_TAMPER = """
member = WriteItemType.TENSOR
before = member.value
# BUILD on an enum member: pickle.dumps of the member, then a state that sets its value
enum_build = pickle.dumps(member, protocol=2)[:-1] + b"}X\\x07\\x00\\x00\\x00_value_K\\x63sb."
# BUILD with slot state on an allow-listed class and on an allow-listed function: set attributes
cls_build = (
    b"\\x80\\x02ctorch.distributed.checkpoint.metadata\\nChunkStorageMetadata\\n"
    b"N}X\\x05\\x00\\x00\\x00smpckK\\x01s\\x86b."
)
fn_build = b"\\x80\\x02ctorch.serialization\\n_get_layout\\nN}X\\x05\\x00\\x00\\x00cacheN}s\\x86b."
out = {
    "enum": outcome(enum_build, "/e/.metadata"),
    "cls": outcome(cls_build, "/c/.metadata"),
    "fn": outcome(fn_build, "/f/.metadata"),
    "enum_kept": WriteItemType.TENSOR.value == before and WriteItemType(before) is member,
    "cls_kept": not hasattr(ChunkStorageMetadata, "smpck"),
    "fn_kept": torch.serialization._get_layout("torch.strided") is torch.strided,
}
print(json.dumps(out))
"""


def test_a_pickle_cannot_change_shared_classes_functions_or_enum_members() -> None:
    """What find_class hands out is per load: a BUILD on it changes nothing the process shares."""
    out = _child(_TAMPER)
    assert out["enum_kept"] and out["cls_kept"] and out["fn_kept"], out
    assert out["enum"][0] == "CheckpointCorrupt" and "enum members" in out["enum"][1], out["enum"]
    for name in ("cls", "fn"):
        assert out[name][0] == "CheckpointCorrupt", out[name]  # holds no Metadata


_TOOLS = """
import contextlib, io
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from smpckpt.storage import FsspecStorageReader, checkpoint_state, verify_checkpoint
from smpckpt.tools.cli import main
from smpckpt.tools.convert import convert_checkpoint

root = sys.argv[1]
url = os.path.join(root, "stock")
dcp.save({"w": torch.arange(6.0)}, storage_writer=FileSystemWriter(url))
with open(os.path.join(url, ".metadata"), "wb") as f:
    f.write(md(R(frozenset, (range(10**12),))))
out = {}

def call(name, fn):
    try:
        fn()
        out[name] = ["ok", ""]
    except CheckpointError as exc:
        out[name] = [type(exc).__name__, str(exc)]
    except BaseException as exc:
        out[name] = ["raw " + type(exc).__name__, str(exc)]  # DCP wraps ours in CheckpointException

call("state", lambda: checkpoint_state(url))
call("verify", lambda: verify_checkpoint(url).raise_if_failed())  # a damaged folder is a report
call("load", lambda: dcp.load({"w": torch.zeros(6)}, storage_reader=FsspecStorageReader(url)))
call("convert", lambda: convert_checkpoint(url, os.path.join(root, "out.pt"), to="torch_save"))
for command in ("inspect", "verify"):
    err = io.StringIO()
    status = main([command, url], stdout=io.StringIO(), stderr=err)
    out["cli_" + command] = [status, err.getvalue()]
print(json.dumps(out))
"""


def test_tools_and_loads_refuse_a_bomb_naming_the_file(tmp_path: Path) -> None:
    """verify, inspect, convert and dcp.load on a (stock, legacy-read) checkpoint whose .metadata is a bomb."""
    out = _child(_TOOLS, str(tmp_path))
    where = str(tmp_path / "stock" / ".metadata")
    for name in ("state", "verify", "load", "convert"):
        kind, message = out[name]
        # torch's dcp.load reports a failed metadata read as an AssertionError carrying our message
        assert kind == ("raw CheckpointException" if name == "load" else "CheckpointCorrupt"), (name, out[name])
        assert f"{where}: refused to unpickle" in message, (name, message)
    for command in ("inspect", "verify"):
        status, err = out["cli_" + command]
        assert status == 1 and f"{where}: refused to unpickle" in err, (command, status, err)

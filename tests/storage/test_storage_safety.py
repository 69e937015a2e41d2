"""No code from a checkpoint runs on load: crafted .metadata and object payloads are refused."""

from __future__ import annotations

import io
import os
import pickle
import re
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from storage_helpers import load, load_error, make_state, save, unwrap
from torch.distributed.checkpoint import FileSystemWriter

from smpckpt.errors import CheckpointCorrupt, UnsafeCheckpoint
from smpckpt.storage import checkpoint_state
from smpckpt.storage.format._safe_pickle import check_weights_only, load_metadata

# os.system pickles as posix.system on POSIX (nt.system on Windows)
_SYSTEM_REFUSED = r"global '(posix|nt|os)\.system' is not allowed in checkpoint metadata"


class Odd:
    """A harmless class that is not a DCP metadata type."""


class Payload:
    """Unpickling this runs ``os.system("touch <marker>")``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def test_crafted_metadata_is_rejected_and_payload_never_runs(tmp_path: Any) -> None:
    url = str(tmp_path / "evil")
    sd = make_state(0)
    dcp.save(sd, storage_writer=FileSystemWriter(url))  # a stock checkpoint ...
    marker = tmp_path / "pwned"
    with open(os.path.join(url, ".metadata"), "wb") as f:  # ... whose metadata is replaced by a payload
        pickle.dump(Payload(str(marker)), f)
    with pytest.raises(UnsafeCheckpoint, match=_SYSTEM_REFUSED):
        checkpoint_state(url)
    assert isinstance(load_error(sd, url), UnsafeCheckpoint)
    assert not marker.exists()
    # the control: plain unpickling of the same bytes does run it (so the test can fail)
    with open(os.path.join(url, ".metadata"), "rb") as f:
        pickle.load(f)
    assert marker.exists()


def test_payload_nested_inside_metadata_is_rejected(tmp_path: Any) -> None:
    url = str(tmp_path / "evil2")
    dcp.save(make_state(0), storage_writer=FileSystemWriter(url))
    with open(os.path.join(url, ".metadata"), "rb") as f:
        md = pickle.load(f)
    marker = tmp_path / "pwned2"
    md.planner_data = {"x": Payload(str(marker))}
    data = pickle.dumps(md)
    with pytest.raises(UnsafeCheckpoint, match=r"^t: refused to load: " + _SYSTEM_REFUSED):
        load_metadata(data, where="t")
    assert not marker.exists()
    # the control: the same metadata without the payload is accepted
    md.planner_data = {"x": 1}
    assert load_metadata(pickle.dumps(md), where="t").planner_data == {"x": 1}


def test_object_values_must_be_weights_only_safe(tmp_path: Any) -> None:
    url = str(tmp_path / "obj")
    marker = tmp_path / "pwned3"
    sd = {"w": torch.ones(3), "evil": Payload(str(marker))}
    save(sd, url)
    out = {"w": torch.zeros(3), "evil": None}
    err = load_error(out, url)
    assert isinstance(err, UnsafeCheckpoint) and "evil" in str(err) and "allow_pickle" in str(err)
    assert not marker.exists()


def _torch_save_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_weights_only_objects_pass(tmp_path: Any) -> None:
    value = {"a": [1, 2.5, "x"], "t": torch.ones(2)}
    assert check_weights_only(_torch_save_bytes(value), where="t") is None
    # the control: the same check refuses an object that needs code to load, naming where it was
    with pytest.raises(UnsafeCheckpoint, match=r"^t: this object is not weights-only safe .*pass allow_pickle=True"):
        check_weights_only(_torch_save_bytes({"a": Odd()}), where="t")
    # what passing the check must produce: the object is loaded (without allow_pickle) exactly as saved
    # (DCP flattens the dict: "obj.a" is stored as one object, "obj.t" as a tensor)
    url = str(tmp_path / "wo")
    save({"obj": value, "w": torch.arange(4.0)}, url)
    out = load({"obj": {"a": None, "t": torch.zeros(2)}, "w": torch.zeros(4)}, url)
    assert set(out) == {"obj", "w"} and torch.equal(out["w"], torch.arange(4.0))
    obj = out["obj"]
    assert set(obj) == {"a", "t"} and obj["a"] == [1, 2.5, "x"]
    assert obj["t"].dtype == torch.float32 and torch.equal(obj["t"], torch.ones(2))


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(_torch_save_bytes({"a": 1})[:40], id="truncated-zip"),
        pytest.param(b"garbage", id="garbage"),
        pytest.param(b"", id="empty"),
    ],
)
def test_unreadable_object_bytes_are_corrupt_not_unsafe(data: bytes) -> None:
    with pytest.raises(
        CheckpointCorrupt, match=r"^t: object bytes (cannot be read|are not a readable torch.save record): "
    ):
        check_weights_only(data, where="t")


def test_writer_refuses_non_dcp_types_in_metadata(tmp_path: Any) -> None:
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.api import CheckpointException

    class OddPlanner(DefaultSavePlanner):
        def create_global_plan(self, all_plans: Any) -> Any:
            plans, md = super().create_global_plan(all_plans)
            md.planner_data = {"odd": Odd()}
            return plans, md

    url = str(tmp_path / "odd")
    refused = r"global '[\w.]*Odd' is not allowed in checkpoint metadata"
    with pytest.raises(CheckpointException, match=refused) as info:
        save(make_state(0), url, planner=OddPlanner())
    err = unwrap(info.value)
    assert type(err) is UnsafeCheckpoint
    assert re.fullmatch(r"metadata being written: refused to load: " + refused, str(err)), str(err)
    # the coordinator refuses in finish, after every rank's data is durable and before any metadata or
    # manifest is written: the data files are left, uncommitted (deterministic, local disk only)
    names = sorted(os.listdir(url))
    assert len(names) == 4 and all(n.endswith(".smp.distcp") for n in names), names  # one per writer thread
    assert checkpoint_state(url) == "uncommitted"


class _Alloc:
    """Unpickling this would call ``bytearray(10**13)``: 10 TB asked for by 30 bytes of metadata."""

    def __reduce__(self) -> Any:
        return (bytearray, (10**13,))


def test_metadata_cannot_allocate_by_an_argument() -> None:
    from torch.distributed.checkpoint.metadata import Metadata

    data = pickle.dumps(Metadata(state_dict_metadata={}, planner_data={"x": _Alloc()}), protocol=2)
    with pytest.raises(UnsafeCheckpoint, match=r"global '(__builtin__|builtins)\.bytearray' is not allowed"):
        load_metadata(data, where="t")


def test_a_file_where_a_checkpoint_folder_would_be_is_named(backend: tuple[str, dict[str, Any]]) -> None:
    """rev68h F3, rev69a L1: a file in a checkpoint folder's place probes "missing", saying it is a file (a
    resume raised a raw NotADirectoryError); an S3 folder marker ``x/`` alone is an empty folder, uncommitted
    as before, not "a file"; on local disk a folder under a file is named so too."""
    from smpckpt.storage import open_fs, probe_checkpoint

    base, opts = backend
    fs, path = open_fs(f"{base}/x_partial", opts)
    fs.pipe_file(path, b"not a folder")
    found = probe_checkpoint(f"{base}/x_partial", opts)
    assert (found.state, found.detail) == ("missing", "a file, not a checkpoint folder")
    if base.startswith("s3://"):
        fs.pipe_file(f"{path[: -len('x_partial')]}m_partial/", b"")  # what consoles and S3A create
        assert probe_checkpoint(f"{base}/m_partial", opts).state == "uncommitted"
    elif "://" not in base:
        found = probe_checkpoint(f"{base}/x_partial/y_partial", opts)
        assert (found.state, found.detail) == ("missing", "under a file, not a folder")

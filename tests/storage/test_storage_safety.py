"""No code from a checkpoint runs on load: crafted .metadata and object payloads are refused."""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from smpckpt.errors import UnsafeCheckpoint
from smpckpt.storage import checkpoint_state
from smpckpt.storage._safe_pickle import check_weights_only, load_metadata
from storage_helpers import load_error, make_state, save


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
    with pytest.raises(UnsafeCheckpoint, match="posix.system|os.system|not allowed"):
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
    with pytest.raises(UnsafeCheckpoint):
        load_metadata(data, where="t")
    assert not marker.exists()


def test_object_values_must_be_weights_only_safe(tmp_path: Any) -> None:
    url = str(tmp_path / "obj")
    marker = tmp_path / "pwned3"
    sd = {"w": torch.ones(3), "evil": Payload(str(marker))}
    save(sd, url)
    out = {"w": torch.zeros(3), "evil": None}
    err = load_error(out, url)
    assert isinstance(err, UnsafeCheckpoint) and "evil" in str(err) and "allow_pickle" in str(err)
    assert not marker.exists()


def test_weights_only_objects_pass(tmp_path: Any) -> None:
    buf = io.BytesIO()
    torch.save({"a": [1, 2.5, "x"], "t": torch.ones(2)}, buf)
    check_weights_only(buf.getvalue(), where="t")


def test_writer_refuses_non_dcp_types_in_metadata(tmp_path: Any) -> None:
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.api import CheckpointException

    class OddPlanner(DefaultSavePlanner):
        def create_global_plan(self, all_plans: Any) -> Any:
            plans, md = super().create_global_plan(all_plans)
            md.planner_data = {"odd": Odd()}
            return plans, md

    url = str(tmp_path / "odd")
    with pytest.raises(CheckpointException) as info:
        save(make_state(0), url, planner=OddPlanner())
    assert "not allowed" in str(info.value)
    assert checkpoint_state(url) in ("uncommitted", "missing")

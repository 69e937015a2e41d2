"""The commit lists only files that are there: a data file removed (or cut short) between its write and
the commit fails the save instead of committing a checkpoint whose data is gone (a ``prune
--uncommitted-older-than`` with too short an age, running beside a save)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from storage_helpers import make_state, unwrap
from torch.distributed.checkpoint.api import CheckpointException

from smpckpt.errors import CheckpointError
from smpckpt.storage import FsspecStorageWriter, checkpoint_state


class _Pruned(FsspecStorageWriter):
    """Something removes (or truncates) one data file of this save just before its commit."""

    def __init__(self, *args: Any, damage: str, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.damage = damage

    def finish(self, metadata: Any, results: Any) -> None:
        folder = self.path
        name = sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))[0]
        if self.damage == "remove":
            os.remove(os.path.join(folder, name))
        else:
            with open(os.path.join(folder, name), "r+b") as f:
                f.truncate(10)
        super().finish(metadata, results)


@pytest.mark.parametrize("damage", ["remove", "truncate"])
def test_a_data_file_gone_before_the_commit_fails_the_save(tmp_path: Path, damage: str) -> None:
    url = str(tmp_path / "c")
    with pytest.raises(CheckpointException) as info:
        dcp.save(make_state(), storage_writer=_Pruned(url, damage=damage))
    err = unwrap(info.value)
    assert isinstance(err, CheckpointError)
    assert "missing or cut short at the commit" in str(err) and "nothing was committed" in str(err)
    assert checkpoint_state(url) == "uncommitted"

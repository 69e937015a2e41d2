"""``verify_checkpoint`` (``smpckpt verify``) racing another process's removal (retention, ``prune``) or
overwrite of the checkpoint it checks: that is no damage, and it must not be reported as such.

hunt73b: a checkpoint removed or replaced while verify read it came back as a report of problems
("<file>: missing" for every data file), which ``smpckpt verify`` prints as a failed verification (exit 1):
a false alarm of corruption for a checkpoint nothing damaged. A load tells the two apart already
(``FsspecStorageReader._gone``, test_storage_reader_safety.py); verify now does the same: removed or
replaced meanwhile -> ``CheckpointError`` saying so ("verify again"); files deleted by hand (the manifest
still there, no removal's mark) stay problems."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from smpckpt import Checkpointer, SaveOptions
from smpckpt.errors import CheckpointCorrupt, CheckpointError
from smpckpt.storage import remove_checkpoint, verify_checkpoint


@pytest.mark.parametrize("how", ["removed", "replaced", "by hand", "full removed"])
def test_verify_tells_a_checkpoint_removed_or_replaced_meanwhile_from_damage(tmp_path: Any, how: str) -> None:
    model = torch.nn.Linear(16, 16)
    with Checkpointer(str(tmp_path)) as ck:
        if how == "full removed":  # a full artifact: its safetensors files are checked by the load's checks
            ck.export("s", model=model)
        else:
            ck.save("s", model)
    url = os.path.join(str(tmp_path), "s" if how == "full removed" else "s_partial")
    data = sorted(n for n in os.listdir(url) if n.endswith(".distcp"))
    fired: list[int] = []

    def meanwhile(done: int, total: int) -> None:  # called once the metadata is checked, before any data file
        if fired:
            return
        fired.append(done)
        if how.endswith("removed"):  # another process's retention or prune
            remove_checkpoint(url)
        elif how == "replaced":  # another process's save(overwrite=True)
            with Checkpointer(str(tmp_path)) as again:
                again.save("s", model, options=SaveOptions(overwrite=True))
        else:
            for name in data:
                os.remove(os.path.join(url, name))

    if how == "by hand":  # damage: reported, as before
        report = verify_checkpoint(url, progress=meanwhile)
        assert fired and sorted(report.problems) == sorted(f"{n}: missing" for n in data), report.problems
        return
    with pytest.raises(CheckpointError) as caught:
        verify_checkpoint(url, progress=meanwhile)
    assert fired
    assert not isinstance(caught.value, CheckpointCorrupt), repr(caught.value)
    assert f"{url} was {how.split()[-1]}" in str(caught.value) and "verify again" in str(caught.value), caught.value
    if how == "replaced":  # and verifying again checks the new generation, which is whole
        report = verify_checkpoint(url)
        assert report.problems == () and report.files_checked == len(data) + 1, report

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

from smpckpt import Checkpointer, Location, SaveOptions
from smpckpt.errors import CheckpointCorrupt, CheckpointError
from smpckpt.storage import remove_checkpoint, verify_checkpoint
from smpckpt.storage.format.manifest import MANIFEST_NAME, REMOVING_NAME


@pytest.mark.parametrize("how", ["removed", "replaced", "by hand", "full removed", "stale mark + by hand"])
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
            for name in data + ([MANIFEST_NAME] if how.startswith("stale") else []):
                os.remove(os.path.join(url, name))

    if how.startswith("stale"):
        # rev73e 2: a removal that crashed after its mark, before the manifest delete, left the checkpoint
        # committed beside the mark; files then deleted by hand read as "removed ... (not damaged)". A mark with
        # the generation's files still there (its metadata) is a removal running or such a stale mark: both said
        with open(os.path.join(url, REMOVING_NAME), "wb") as f:
            f.write(b"removing 0123456789abcdef\n")
        with pytest.raises(CheckpointError) as stale:
            verify_checkpoint(url, progress=meanwhile)
        assert fired and "not damaged" not in str(stale.value), stale.value
        assert "or damaged by hand" in str(stale.value) and data[0] in str(stale.value), stale.value
        return
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


@pytest.mark.s3
@pytest.mark.parametrize("kind", ["partial", "full"])
def test_verify_on_s3_tells_a_removal_inside_a_data_file_read_from_damage(
    s3: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """rev73e 1: on S3 a data file is read in several ranged GETs (16 MiB each; 8 KiB here, so the file is
    small): a removal landing between two of them made the next GET a 404, and verify raised a raw
    ``FileNotFoundError`` (a full artifact's read: ``CheckpointCorrupt`` "data file is missing") that the
    CLI prints as a failed verification: damage, for a checkpoint nothing damaged. Now the file counts as
    missing and generation_gone says "removed ... verify again"."""
    from smpckpt.storage import tools

    monkeypatch.setattr(tools, "_READ_CHUNK", 8 << 10)
    base, opts = s3
    model = torch.nn.Linear(1024, 256)  # 1 MiB of weight: 64 check units of 16 KiB (progress every 16 units)
    with Checkpointer(Location(base, storage_options=opts)) as ck:
        if kind == "full":
            ck.export("s", model=model)
        else:
            ck.save("s", model)
    url = f"{base}/s" + ("" if kind == "full" else "_partial")
    first: list[int] = []
    fired: list[int] = []

    def meanwhile(done: int, total: int) -> None:
        if not first:  # the first call: the metadata checked, no data file read yet
            first.append(done)
        elif not fired and first[0] + (64 << 10) < done < total - (64 << 10):  # inside the weight's bytes
            fired.append(done)
            remove_checkpoint(url, opts)

    with pytest.raises(CheckpointError) as caught:
        verify_checkpoint(url, opts, progress=meanwhile)
    assert fired, (first, fired)
    assert not isinstance(caught.value, CheckpointCorrupt), repr(caught.value)
    assert f"{url} was removed" in str(caught.value) and "verify again" in str(caught.value), caught.value

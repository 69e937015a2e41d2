"""Tiered checkpoints in one process, one node: which save a resume takes -- a tag asked for from the tier
that holds its newest committed copy, nothing or an incomplete copy refused naming both tiers, a damaged newest
reported as corrupt (not missing), a state that does not fit the newest save refused (not an older one loaded)."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from tier_helpers import job as _job
from tier_helpers import linear as _linear
from tier_helpers import same as _same

from smpckpt import (
    CheckpointCorrupt,
    CheckpointError,
    LayoutMismatch,
    last_resume_info,
    resume_from_checkpoint,
    save_checkpoint,
    wait_for_saves,
)


def test_tag_asked_for_comes_from_the_fast_tier_when_its_drain_never_committed(tmp_path: Path) -> None:
    durable, local = tmp_path / "durable", tmp_path / "fast"
    m1, m2 = _linear(1), _linear(2)
    save_checkpoint(durable, "s1", model=m1, local_path=local, replicas=1)
    save_checkpoint(durable, "s2", model=m2, local_path=local, replicas=1)
    wait_for_saves()
    (durable / "s2_partial" / "smpckpt.manifest.json").unlink()  # as a drain killed before its commit
    for tag, want in (("s1", m1), ("s2", m2)):
        got = _linear(9)
        resume_from_checkpoint(durable, tag=tag, model=got, local_path=local)
        info = last_resume_info()
        assert info is not None and (info.tag, info.tier) == (tag, "fast")
        assert _same(got, want)
    with pytest.raises(Exception, match="no checkpoint 's3'"):
        resume_from_checkpoint(durable, tag="s3", model=_linear(9), local_path=local)


def test_tag_asked_for_incomplete_in_the_fast_tier_is_refused_saying_so(tmp_path: Path) -> None:
    """The refusal named only path ("no checkpoint 's1' under ..."), as if the tag had never been saved,
    while the fast tier holds it committed but missing a part (a lost node's): now it says so, by file."""
    durable, local = tmp_path / "durable", tmp_path / "fast"
    save_checkpoint(durable, "s1", model=_linear(1), local_path=local, replicas=1, durable_every=5)
    folder = _job(local, durable) / "s1_partial"
    lost = sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))[0]
    (folder / lost).unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match=f"no checkpoint 's1' under .*committed but incomplete .*{lost}"):
            resume_from_checkpoint(durable, tag="s1", model=_linear(9), local_path=local)


def test_nothing_to_resume_in_either_tier_names_both(tmp_path: Path) -> None:
    """hunt67 note: a fast tier lost before its first drain gave "no committed checkpoint under <path>",
    not naming the fast tier searched; one holding only an incomplete copy said nothing of it either."""
    durable, local = tmp_path / "durable", tmp_path / "fast"
    save_checkpoint(durable, "s1", model=_linear(1), local_path=local, replicas=1, durable_every=5)
    folder = _job(local, durable) / "s1_partial"
    lost = sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))[0]
    (folder / lost).unlink()  # a lost node's part
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(
            CheckpointError, match=f"^no committed checkpoint under {durable}: .*'s1'.*incomplete .*{lost}"
        ):
            resume_from_checkpoint(durable, model=_linear(9), local_path=local)
    shutil.rmtree(local)  # the whole fast tier lost
    with pytest.raises(
        CheckpointError, match=f"^no committed checkpoint under {durable} nor in the fast tier {local}$"
    ):
        resume_from_checkpoint(durable, model=_linear(9), local_path=local)


@pytest.mark.parametrize("missing_ok", [False, True])
def test_a_damaged_newest_in_path_beside_an_incomplete_fast_copy_is_corrupt_not_missing(
    tmp_path: Path, missing_ok: bool
) -> None:
    """rev68a F1: path's newest, damaged, and the fast tier's copy of it incomplete: the incomplete copy's
    "no committed checkpoint" (CheckpointNotFound, which a caller may take for a fresh start) came first."""
    durable, local = tmp_path / "durable", tmp_path / "fast"
    save_checkpoint(durable, "s1", model=_linear(1), local_path=local, replicas=1, durable_every=1)
    wait_for_saves()  # drained
    folder = _job(local, durable) / "s1_partial"
    (folder / sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))[0]).unlink()
    (durable / "s1_partial" / "smpckpt.manifest.json").write_text("{not json")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointCorrupt, match=f"^{durable}/newest names 's1', which is corrupt"):
            resume_from_checkpoint(durable, model=_linear(9), local_path=local, missing_ok=missing_ok)


def test_a_state_that_does_not_fit_the_newest_save_is_refused_not_resumed_from_an_older_one(tmp_path: Path) -> None:
    """s2 saved after the model went bf16; the restarted code builds it fp32. Without the fast tier the
    resume refuses (the dtype, by key); with it, the "this copy failed, try the next" fallback meant for
    damaged copies loaded the older s1, with only a warning. Now refused alike."""
    durable, local = tmp_path / "durable", tmp_path / "fast"
    m1 = _linear(1)
    save_checkpoint(durable, "s1", model=m1, local_path=local, replicas=1, durable_every=5)
    save_checkpoint(durable, "s2", model=_linear(2).to(torch.bfloat16), local_path=local, replicas=1, durable_every=5)
    got = _linear(9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(LayoutMismatch, match="saved as torch.bfloat16 but the destination is torch.float32"):
            resume_from_checkpoint(durable, model=got, local_path=local)
    assert not _same(got, m1)


def test_tag_asked_for_comes_from_the_durable_tier_when_saved_there_again_after_the_fast_copy(tmp_path: Path) -> None:
    """A tag saved through the fast tier, then saved again in ``path`` (``overwrite=True``, by a job
    without the fast tier): the fast tier still holds the older save of that tag. A resume of that tag
    takes the newer durable one, as a resume of the newest does (it once took the fast copy, silently)."""
    durable, local = tmp_path / "durable", tmp_path / "fast"
    m1, m2 = _linear(1), _linear(2)
    save_checkpoint(durable, "final", model=m1, local_path=local, replicas=1)
    wait_for_saves()
    save_checkpoint(durable, "final", model=m2, overwrite=True)
    for tag in (None, "final"):
        got = _linear(9)
        resume_from_checkpoint(durable, tag=tag, model=got, local_path=local)
        info = last_resume_info()
        assert info is not None and (info.tag, info.tier) == ("final", "durable"), (tag, info)
        assert _same(got, m2), tag

"""Listings on S3 are read fresh: s3fs caches every listing in its filesystem object, which fsspec shares
across a process (no ``skip_instance_cache``, as users pass their options), so a process that listed the
root before another process saved resumed from what it had seen, not from what was committed."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from smpckpt import Location, resume_from_checkpoint, save_checkpoint
from smpckpt.catalog import scan_root


def _model(value: float) -> nn.Linear:
    m = nn.Linear(3, 2)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(value)
    return m


def test_a_tagless_resume_sees_a_checkpoint_another_process_committed_after_this_one_listed(
    s3_root: tuple[str, dict[str, Any]],
) -> None:
    root, options = s3_root
    # one filesystem object per process, as users get it (the suite's options skip fsspec's instance cache)
    shared = Location(root, storage_options={k: v for k, v in options.items() if k != "skip_instance_cache"})
    isolated = Location(root, storage_options=options)
    save_checkpoint(shared, "s1", model=_model(1.0), user_content={"tag": "s1"})
    assert resume_from_checkpoint(shared, model=_model(0.0)) == {"tag": "s1"}
    # "another process": a filesystem object of its own, whose writes cannot reach this one's cache
    save_checkpoint(isolated, "s2", model=_model(2.0), user_content={"tag": "s2"})

    assert [r.tag for r in scan_root(root, storage_options=shared.storage_options) if r.committed] == ["s1", "s2"]
    model = _model(0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback: newest names a committed checkpoint
        assert resume_from_checkpoint(shared, model=model) == {"tag": "s2"}
    assert torch.equal(model.weight, torch.full((2, 3), 2.0))

"""Old checkpoints keep loading: tests/data/golden_v1 was written by smpckpt 0.1.0 (before the
one-owner refactor). Its bytes are committed; never regenerate them."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from golden_model import GOLDEN_ROOT, GOLDEN_TAG, GOLDEN_USER_CONTENT, golden_model

from smpckpt import ParallelLayout, last_resume_info, resume_from_checkpoint
from smpckpt.catalog import scan_root
from smpckpt.record import LayoutRecord
from smpckpt.storage import verify_checkpoint

DATA = Path(__file__).with_name("data") / GOLDEN_ROOT


def test_golden_checkpoint_resumes_bit_exact(tmp_path: Path) -> None:
    root = tmp_path / "golden"
    shutil.copytree(DATA, root)  # a copy: resume must not need to write, but never risk the fixture
    expected, expected_opt = golden_model()
    torch.manual_seed(99)
    model, opt = golden_model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    uc = resume_from_checkpoint(str(root), model=model, optimizer=opt)
    assert uc == GOLDEN_USER_CONTENT
    sa, sb = expected.state_dict(), model.state_dict()
    assert list(sa) == list(sb) and len(sa) == 4
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    params_a, params_b = list(expected.parameters()), list(model.parameters())
    for pa, pb in zip(params_a, params_b, strict=True):
        state_a, state_b = expected_opt.state[pa], opt.state[pb]
        assert sorted(state_a) == sorted(state_b) == ["exp_avg", "exp_avg_sq", "step"]
        for name in state_a:
            assert torch.equal(state_a[name], state_b[name]), name
    info = last_resume_info()
    assert info is not None and info.tag == GOLDEN_TAG and info.path_taken == "fast" and not info.layout_changed
    assert set(info.rng_restored) >= {"torch", "python"}


def test_golden_checkpoint_lists_and_verifies(tmp_path: Path) -> None:
    records = scan_root(str(DATA))
    assert [(r.tag, r.state) for r in records] == [(GOLDEN_TAG, "committed")]
    # 0.1.0 kept the layout loose in the manifest's extra; the one record type still reads it
    record = LayoutRecord.from_manifest(records[0].manifest)
    assert record is not None and record.layout == ParallelLayout() and record.rank_local == ("rng.*", "user_content")
    report = verify_checkpoint(str(DATA / f"{GOLDEN_TAG}_partial"))
    assert report.ok and report.problems == () and report.warnings == ()

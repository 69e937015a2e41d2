"""Old checkpoints keep loading: tests/data/golden_v1 was written by smpckpt 0.1.0 (before the
one-owner refactor). Its bytes are committed; never regenerate them."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch
from golden_model import GOLDEN_ROOT, GOLDEN_TAG, GOLDEN_USER_CONTENT, golden_model

from smpckpt import ParallelLayout, last_resume_info, resume_from_checkpoint
from smpckpt.catalog.root import scan_root
from smpckpt.model.layout import LayoutRecord
from smpckpt.storage import verify_checkpoint

DATA = Path(__file__).with_name("data") / GOLDEN_ROOT


def _stored_tensors() -> dict[str, torch.Tensor]:
    """Every tensor of the golden checkpoint, decoded from its committed bytes without our reader: the
    stock ``.metadata`` gives each item's file, offset and length, and raw items are the tensor's bytes.
    (Not recomputed by training: float results differ between CPUs, e.g. AVX2 and AVX-512 hosts.)"""
    folder = DATA / f"{GOLDEN_TAG}_partial"
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own committed fixture, not untrusted input
    out = {}
    for index, info in metadata.storage_data.items():
        tensor_md = metadata.state_dict_metadata[index.fqn]
        if not hasattr(tensor_md, "chunks"):
            continue  # a pickled object (param_groups, user_content, RNG)
        assert list(info.transform_descriptors or ()) == ["smpckpt.raw/1"] and len(tensor_md.chunks) == 1
        data = (folder / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        dtype = tensor_md.properties.dtype
        out[index.fqn] = torch.frombuffer(bytearray(data), dtype=dtype).reshape(tensor_md.size)
    return out


def test_golden_checkpoint_resumes_bit_exact(tmp_path: Path) -> None:
    root = tmp_path / "golden"
    shutil.copytree(DATA, root)  # a copy: resume must not need to write, but never risk the fixture
    stored = _stored_tensors()
    expected, expected_opt = golden_model()  # the training that wrote it, equal up to the CPU's rounding
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
        assert torch.equal(stored[f"model.{k}"], sb[k]), k
        torch.testing.assert_close(sa[k], sb[k], rtol=1e-5, atol=1e-6)
    names = {p: n for n, p in model.named_parameters()}
    params_a, params_b = list(expected.parameters()), list(model.parameters())
    for pa, pb in zip(params_a, params_b, strict=True):
        state_a, state_b = expected_opt.state[pa], opt.state[pb]
        assert sorted(state_a) == sorted(state_b) == ["exp_avg", "exp_avg_sq", "step"]
        for name in state_a:
            assert torch.equal(stored[f"optim.state.{names[pb]}.{name}"], state_b[name]), name
            torch.testing.assert_close(state_a[name], state_b[name], rtol=1e-5, atol=1e-6)
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


def test_format_tags_are_pinned() -> None:
    """Strings written into checkpoints never change with the code around them (a module move once
    renamed the full API's tag): old checkpoints are read, and old readers read new ones, by these."""
    from smpckpt.model.layout import API_RECORD, API_RECORD_V1, FULL_API_RECORD, METADATA_KEY, RECORD_VERSION
    from smpckpt.storage.format.manifest import MANIFEST_NAME, RAW_DESCRIPTOR

    assert (API_RECORD, API_RECORD_V1, FULL_API_RECORD) == (
        "smpckpt.save_checkpoint/2",
        "smpckpt.save_checkpoint/1",
        "smpckpt.api.full/1",
    )
    assert (MANIFEST_NAME, RAW_DESCRIPTOR, METADATA_KEY, RECORD_VERSION) == (
        "smpckpt.manifest.json",
        "smpckpt.raw/1",
        "__smpckpt__",
        1,
    )


def test_golden_checkpoint_orders_before_every_numbered_one(tmp_path: Path) -> None:
    """A 0.1.0 manifest has no sequence number: it counts as 0, so a root holding it numbers its first new
    save 1 and orders it after (tag-less resume, retention), whatever either save time says. A stock DCP
    folder beside them is listed as legacy, never ordered or removed by retention."""
    import torch.distributed.checkpoint as dcp

    from smpckpt import save_checkpoint
    from smpckpt.catalog.root import apply_retention

    root = tmp_path / "golden"
    shutil.copytree(DATA, root)
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(root / "stock_partial"), no_dist=True)
    model, opt = golden_model()
    save_checkpoint(str(root), "step4", model=model, optimizer=opt, user_content={"step": 4})
    records = scan_root(str(root))
    assert [(r.tag, r.state, r.order[0]) for r in records] == [
        ("stock", "legacy", 0),
        (GOLDEN_TAG, "committed", 0),
        ("step4", "committed", 1),
    ]
    (root / "newest").unlink()  # the fallback orders by sequence number alone
    back, back_opt = golden_model()
    with pytest.warns(UserWarning, match="newest is missing"):
        assert resume_from_checkpoint(str(root), model=back, optimizer=back_opt) == {"step": 4}
    assert apply_retention(str(root), 1).removed == (GOLDEN_TAG,)
    assert [(r.tag, r.state) for r in scan_root(str(root))] == [("stock", "legacy"), ("step4", "committed")]


def test_golden_user_content_is_the_saved_dict_after_consolidate_convert_and_export(tmp_path: Path) -> None:
    """0.1.0 wrapped user_content's bytes in a second pickle, unwrapped only by the partial resume:
    consolidate, export and convert passed the wrapped bytes on, so a full resume of the artifact (and
    the converted file) gave ``b'PK...'`` instead of the saved dict, with no error (hunt60t F1)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from smpckpt import Checkpointer, consolidate_checkpoint
    from smpckpt.tools.convert import convert_checkpoint

    root = tmp_path / "root"
    shutil.copytree(Path(__file__).with_name("data") / GOLDEN_ROOT, root)
    consolidate_checkpoint(root / GOLDEN_TAG, tmp_path / "full", progress=False)
    assert torch.load(tmp_path / "full" / "user_content.pt", weights_only=True) == GOLDEN_USER_CONTENT
    model, _ = golden_model()
    assert resume_from_checkpoint(str(tmp_path / "full"), partial=False, model=model) == GOLDEN_USER_CONTENT
    with Checkpointer(str(root)) as ckpt:
        ckpt.export(GOLDEN_TAG, str(tmp_path / "exported"))
    assert torch.load(tmp_path / "exported" / "user_content.pt", weights_only=True) == GOLDEN_USER_CONTENT
    convert_checkpoint(root / GOLDEN_TAG, tmp_path / "c.pt")
    assert torch.load(tmp_path / "c.pt", weights_only=True)["user_content"] == GOLDEN_USER_CONTENT
    convert_checkpoint(root / GOLDEN_TAG, tmp_path / "dcp", to="dcp")
    dcp_to_torch_save(str(tmp_path / "dcp"), str(tmp_path / "d.pt"))
    assert torch.load(tmp_path / "d.pt", weights_only=True)["user_content"] == GOLDEN_USER_CONTENT

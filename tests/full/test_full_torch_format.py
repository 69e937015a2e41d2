"""Full checkpoints in ``torch.save`` format (``FullOptions(format="torch_save")``, ``save_checkpoint(...,
partial=False, format="torch_save")``, ``smpckpt consolidate --format torch_save``).

Each file must be what ``torch.save`` writes for a flat dict: the stock ``torch.load`` (weights-only, and
with ``mmap=True``) reads it with nothing of ours; our reader loads it into any layout, verifying what it
reads; damage to tensor bytes or to the archive around them is found. Multi-rank and swapped writes are in
``test_full_dist.py``, S3 (one owner streaming the archive) here.
"""

from __future__ import annotations

import io
import json
import os
from typing import Any

import pytest
import torch
from full_models import assert_state_equal, optim_state, trained_model
from s3_env import reset_moto, s3_options

from smpckpt import CheckpointCorrupt, consolidate_checkpoint, resume_from_checkpoint, save_checkpoint
from smpckpt.storage import open_fs, verify_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_torch_save_artifact_loads_with_torch_load_and_resumes(tmp_path: Any) -> None:
    m, o = trained_model(0)
    save_checkpoint(
        str(tmp_path), "t", partial=False, model=m, optimizer=o, include_optimizer=True, user_content={"step": 2},
        format="torch_save",
    )  # fmt: skip
    folder = tmp_path / "t"
    names = set(os.listdir(folder))
    assert {"pytorch_model.bin", "optimizer.bin", "user_content.pt", "smpckpt.manifest.json"} <= names, names
    assert not any(n.endswith(".safetensors") for n in names), names
    want = {k: v.detach() for k, v in m.state_dict().items()}
    for mmap in (False, True):
        assert_state_equal(want, torch.load(folder / "pytorch_model.bin", weights_only=True, mmap=mmap))
    assert_state_equal(optim_state(m, o), torch.load(folder / "optimizer.bin", weights_only=True))
    assert verify_checkpoint(str(folder)).ok

    fresh, fresh_opt = trained_model(1)
    fresh_opt.step()  # Adam state exists to be overwritten
    uc = resume_from_checkpoint(str(tmp_path), "t", partial=False, model=fresh, optimizer=fresh_opt)
    assert uc == {"step": 2}
    assert_state_equal(want, dict(fresh.state_dict()))
    assert_state_equal(optim_state(m, o), optim_state(fresh, fresh_opt))


def test_torch_save_artifacts_of_one_state_are_the_same_bytes(tmp_path: Any) -> None:
    """The archive inside is named after the file, as ``torch.save(state, "pytorch_model.bin")`` names it, so
    two exports of one state are the same bytes (the layout was laid out in a temporary file whose random
    name went into every record: ``smpckpt-torch-layout-6dk59cyg/data.pkl``). Not byte-equal to
    ``torch.save``'s own file: a FakeTensor's device string is pickled afresh where torch memoises it."""
    import zipfile

    m, _ = trained_model(0)
    for tag in ("a", "b"):
        save_checkpoint(str(tmp_path), tag, partial=False, model=m, format="torch_save")
    torch.save({k: v.detach() for k, v in m.state_dict().items()}, tmp_path / "pytorch_model.bin")
    a, b = (tmp_path / "a" / "pytorch_model.bin"), (tmp_path / "b" / "pytorch_model.bin")
    assert zipfile.ZipFile(a).namelist() == zipfile.ZipFile(tmp_path / "pytorch_model.bin").namelist()
    assert a.read_bytes() == b.read_bytes()


class _Buffers(torch.nn.Module):
    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for k, v in values.items():
            self.register_buffer(k, v)


def test_torch_save_artifact_with_dtypes_safetensors_lacks_resumes(tmp_path: Any) -> None:
    """``torch.save`` files hold complex tensors (safetensors has no such dtype); our reader read the
    artifact's description through safetensors' dtype table only, so such an artifact, committed and
    verified, could not be resumed (``CheckpointCorrupt: malformed full artifact description``)."""
    gen = torch.Generator().manual_seed(0)
    values = {
        "c64": torch.randn(3, 2, dtype=torch.complex64, generator=gen),
        "c128": torch.randn(5, dtype=torch.complex128, generator=gen),
        "f32": torch.randn(4, generator=gen),
    }
    save_checkpoint(str(tmp_path), "t", partial=False, model=_Buffers(values), format="torch_save")
    got = _Buffers({k: torch.zeros_like(v) for k, v in values.items()})
    resume_from_checkpoint(str(tmp_path), "t", partial=False, model=got)
    assert_state_equal(values, dict(got.state_dict()))


def test_torch_save_shards_and_index(tmp_path: Any) -> None:
    m, _ = trained_model(0)
    save_checkpoint(str(tmp_path), "t", partial=False, model=m, format="torch_save", max_shard_size=300)
    folder = tmp_path / "t"
    index = json.loads((folder / "pytorch_model.bin.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files == [f"pytorch_model-{i + 1:05d}-of-{len(files):05d}.bin" for i in range(len(files))]
    got: dict[str, torch.Tensor] = {}
    for name in files:
        part = torch.load(folder / name, weights_only=True)
        assert all(index["weight_map"][k] == name for k in part)
        got.update(part)
    assert_state_equal({k: v.detach() for k, v in m.state_dict().items()}, got)
    fresh, _ = trained_model(1)
    resume_from_checkpoint(str(tmp_path), "t", partial=False, model=fresh)
    assert_state_equal({k: v.detach() for k, v in m.state_dict().items()}, dict(fresh.state_dict()))


def _tensor_span(path: str, key: str) -> tuple[int, int]:
    """(first byte, length) of ``key``'s data in a torch.save file, from torch's own record offsets."""
    t = torch.load(path, weights_only=True, mmap=True)[key]
    reader: Any = torch._C.PyTorchFileReader(path)
    for name in reader.get_all_records():
        if name.startswith("data/") and reader.get_record_size(name) == t.untyped_storage().nbytes():
            start = int(reader.get_record_offset(name))
            with open(path, "rb") as f:
                f.seek(start)
                if f.read(t.untyped_storage().nbytes()) == bytes(t.untyped_storage()):
                    return start, t.untyped_storage().nbytes()
    raise AssertionError(key)


def test_damage_to_tensor_bytes_or_archive_is_found(tmp_path: Any) -> None:
    m, _ = trained_model(0)
    save_checkpoint(str(tmp_path), "t", partial=False, model=m, format="torch_save")
    path = str(tmp_path / "t" / "pytorch_model.bin")
    start, _ = _tensor_span(path, "0.weight")
    pristine = open(path, "rb").read()

    damaged = bytearray(pristine)
    damaged[start + 5] ^= 0x40
    open(path, "wb").write(damaged)
    fresh, _ = trained_model(1)
    with pytest.raises(CheckpointCorrupt, match="pytorch_model.bin"):
        resume_from_checkpoint(str(tmp_path), "t", partial=False, model=fresh)
    assert not verify_checkpoint(str(tmp_path / "t")).ok

    damaged = bytearray(pristine)
    damaged[40] ^= 0x01  # inside the pickle (the first record): not tensor data
    open(path, "wb").write(damaged)
    report = verify_checkpoint(str(tmp_path / "t"))
    assert any("pytorch_model.bin: header checksum mismatch" in p for p in report.problems), report.problems


def test_consolidate_to_torch_save(tmp_path: Any) -> None:
    m, o = trained_model(0)
    save_checkpoint(str(tmp_path / "ck"), "p", model=m, optimizer=o)
    report = consolidate_checkpoint(
        str(tmp_path / "ck" / "p_partial"), str(tmp_path / "out"), include_optimizer=True, format="torch_save",
        progress=False,
    )  # fmt: skip
    assert set(report["files"]) == {"pytorch_model.bin", "optimizer.bin"}, report["files"]
    assert_state_equal(
        {k: v.detach() for k, v in m.state_dict().items()},
        torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True),
    )
    assert_state_equal(optim_state(m, o), torch.load(tmp_path / "out" / "optimizer.bin", weights_only=True))


@pytest.mark.s3
def test_torch_save_artifact_on_s3(moto_endpoint: str) -> None:
    """One process on S3: the file's owner streams the archive front to back, pieces between tensors."""
    bucket = "smpckpt-full-torch"
    reset_moto(moto_endpoint, bucket)
    options = s3_options(moto_endpoint)
    root = f"s3://{bucket}/run"
    m, _ = trained_model(0)
    save_checkpoint(root, "t", partial=False, model=m, format="torch_save", max_shard_size=300, storage_options=options)
    assert verify_checkpoint(f"{root}/t", options).ok
    fs, path = open_fs(f"{root}/t", options)
    index = json.loads(fs.cat_file(f"{path}/pytorch_model.bin.index.json"))
    got: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        got.update(torch.load(io.BytesIO(fs.cat_file(f"{path}/{name}")), weights_only=True))
    want = {k: v.detach() for k, v in m.state_dict().items()}
    assert_state_equal(want, got)
    fresh, _ = trained_model(1)
    resume_from_checkpoint(root, "t", partial=False, model=fresh, storage_options=options)
    assert_state_equal(want, dict(fresh.state_dict()))


@pytest.mark.s3
@pytest.mark.parametrize("file_format", ["safetensors", "torch_save"])
def test_consolidate_to_s3(moto_endpoint: str, tmp_path: Any, file_format: str) -> None:
    """Offline consolidation straight into S3 (one process: every file streamed as one upload)."""
    bucket = "smpckpt-consolidate"
    reset_moto(moto_endpoint, bucket)
    options = s3_options(moto_endpoint)
    m, _ = trained_model(0)
    save_checkpoint(str(tmp_path), "p", model=m)
    out = f"s3://{bucket}/out"
    consolidate_checkpoint(
        str(tmp_path / "p_partial"), out, format=file_format, out_storage_options=options, progress=False
    )
    assert verify_checkpoint(out, options).ok
    fresh, _ = trained_model(1)
    resume_from_checkpoint(out, None, partial=False, model=fresh, storage_options=options)
    assert_state_equal({k: v.detach() for k, v in m.state_dict().items()}, dict(fresh.state_dict()))

"""Full checkpoints on S3 (a real S3-protocol server on loopback): each artifact file is streamed by its
owner rank, which receives the other ranks' shard bytes over the process group."""

from __future__ import annotations

from typing import Any

import full_workers
import pytest
import torch
from dist_harness import run_world
from s3_env import reset_moto, s3_options
from safetensors.torch import load, load_file

from smpckpt.storage import open_fs, verify_checkpoint

pytestmark = [pytest.mark.dist, pytest.mark.s3]

BUCKET = "smpckpt-full-s3"


def test_full_save_and_resume_on_s3_with_two_ranks(moto_endpoint: str, tmp_path: Any) -> None:
    reset_moto(moto_endpoint, BUCKET)
    options = s3_options(moto_endpoint)
    root = f"s3://{BUCKET}/run"
    results = run_world(full_workers.s3_full_world, 2, root, options, str(tmp_path), timeout=240)
    for r, out in enumerate(results):
        for key, value in out["saved"].items():
            assert torch.equal(out["loaded"][key], value), (r, key)
    report = verify_checkpoint(f"{root}/f", options)
    assert report.ok, report.problems
    fs, path = open_fs(f"{root}/f", options)
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
    shards = [n for n in names if n.startswith("model-") and n.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in names, names
    assert any(n.startswith("optimizer") and n.endswith(".safetensors") for n in names), names
    tensors: dict[str, Any] = {}
    for n in shards:
        tensors.update(load(fs.cat_file(f"{path}/{n}")))  # the reference reader, straight from the objects
    # the same tensors as the artifact the POSIX path wrote from the same state
    local = load_file(str(tmp_path / "f" / "model.safetensors"))
    assert set(tensors) == set(local)
    for key, t in local.items():
        assert torch.equal(tensors[key], t), key


def test_a_tie_held_apart_split_differently_on_s3_is_read_back_and_warned(moto_endpoint: str) -> None:
    """The objects each owner rank streamed are read back at the commit (the two keys' units differ)."""
    import json

    from test_full_api import _export_split_apart

    reset_moto(moto_endpoint, BUCKET)
    options = s3_options(moto_endpoint)
    said = run_world(_export_split_apart, 2, f"s3://{BUCKET}/tie", 0.5, options, timeout=240)
    assert "'head.weight' and 'embed.weight' differ at element 63 of 64" in said[0][0] and said[1] == [], said
    fs, path = open_fs(f"s3://{BUCKET}/tie/w2d0.5", options)
    assert json.loads(fs.cat_file(f"{path}/config.json"))["tie_word_embeddings"] is True


class _OneTensor(torch.nn.Module):
    def __init__(self, fill: bool) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.arange(1 << 18, dtype=torch.float32) if fill else torch.zeros(1 << 18))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_box_past_the_span_limit_streamed_from_s3_is_checked(
    tmp_path: Any, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """A box larger than a span streams its GET body straight into the destination (no ``bytes`` copy):
    a flipped byte is still found by its check unit, and an object cut short by the byte count. A guard:
    only ``[truncate]``'s words come from the streamed path (one GET held on the old path too)."""
    from s3_env import serve_full_artifact

    from smpckpt import resume_from_checkpoint, save_checkpoint
    from smpckpt.errors import CheckpointCorrupt

    save_checkpoint(tmp_path, "f", partial=False, model=_OneTensor(True))
    path = tmp_path / "f" / "model.safetensors"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) - 5000] ^= 0x10
    else:
        del data[-8:]
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    opts, gets = serve_full_artifact(monkeypatch, tmp_path / "f", moto_endpoint, "streamed-box", 4096)
    with pytest.raises(CheckpointCorrupt) as info:
        resume_from_checkpoint("s3://streamed-box/ck", partial=False, model=_OneTensor(False), storage_options=opts)
    want = {
        "flip": "streamed-box/ck/model.safetensors: checksum mismatch in tensor 'w' at box [258048]+[4096]",
        "truncate": "streamed-box/ck/model.safetensors: short read at offset 128 (1048568 of 1048576 bytes)",
    }[damage]
    assert want in str(info.value), str(info.value)
    assert gets == [("streamed-box/ck/model.safetensors", 128, 128 + (4 << 18))]  # one GET, the whole tensor

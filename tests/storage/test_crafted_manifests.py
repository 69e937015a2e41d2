"""Bounded parsing of untrusted folders: a crafted manifest (resealed with its own checksum, as anyone
can) is refused as corrupt in bounded time and memory -- a tiling of 2**40 tiles, a size of 1e400,
JSON nested thousands deep -- and one such sibling never stops ``ls``, retention or a tag-less resume
from seeing the good checkpoints beside it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from smpckpt import last_resume_info, resume_from_checkpoint, save_checkpoint
from smpckpt.catalog.root import scan_root
from smpckpt.errors import CheckpointCorrupt, UnsafeCheckpoint
from smpckpt.storage.format.manifest import _DIGEST_KEY, Manifest, _pack, _self_digest

MANIFEST = "smpckpt.manifest.json"


def _reseal(obj: dict[str, Any]) -> bytes:
    obj.pop(_DIGEST_KEY, None)
    obj[_DIGEST_KEY] = f"{_self_digest(obj):016x}"
    return json.dumps(obj).encode()


def _good(root: Path, tag: str) -> dict[str, Any]:
    torch.manual_seed(0)
    save_checkpoint(str(root), tag, model=nn.Linear(4, 3), save_rng=False)
    return json.loads((root / f"{tag}_partial" / MANIFEST).read_text())


def _crafts(base: dict[str, Any]) -> dict[str, bytes]:
    tiled = json.loads(json.dumps(base))
    tiled["format_version"] = 2
    tiled["files"][0].update(  # blocks that cover the claimed size: only the tiling is wrong
        tilings=_pack([0, 2**40, 2, 2, 1]), size=2**40, block_ends=_pack([2**40]), block_digests=_pack([0])
    )
    huge = json.loads(json.dumps(base))
    huge["files"][0]["size"] = 1e400
    nested = json.loads(json.dumps(base))
    crafted = {"tiling": _reseal(tiled), "size": _reseal(huge)}
    deep = _reseal(nested)
    crafted["nested"] = deep.replace(b'"extra": {', b'"extra": {"x": ' + b"[" * 100_000 + b"]" * 100_000 + b", ", 1)
    return crafted


def test_crafted_manifests_are_corrupt_in_bounded_time(tmp_path: Path) -> None:
    base = _good(tmp_path, "g")
    for name, data in _crafts(base).items():
        start = time.monotonic()
        with pytest.raises(CheckpointCorrupt):
            Manifest.from_bytes(data, where=name)
        assert time.monotonic() - start < 5, name


def test_a_crafted_sibling_stops_nothing(tmp_path: Path) -> None:
    base = _good(tmp_path, "a")
    model = nn.Linear(4, 3)
    for name, data in _crafts(base).items():
        folder = tmp_path / f"evil-{name}_partial"
        folder.mkdir()
        (folder / MANIFEST).write_bytes(data)
    records = {r.tag: r for r in scan_root(str(tmp_path))}
    assert records["a"].committed
    assert all(records[f"evil-{n}"].state == "corrupt" for n in ("tiling", "size", "nested")), records
    (tmp_path / "newest").unlink()  # a tag-less resume must choose among the folders itself
    with pytest.warns(UserWarning, match="newest is missing or unreadable; resuming from the newest committed"):
        resume_from_checkpoint(str(tmp_path), model=model)
    assert last_resume_info().tag == "a"


def test_a_tiling_of_tiny_rows_is_refused_before_any_checksum(tmp_path: Path) -> None:
    """2-byte rows cut into 1-byte column segments over a sparse file: checking them costs a hash call per
    byte (32 MiB: minutes). No writer tiles rows under a page per segment, so the manifest is corrupt."""
    from smpckpt.storage import verify_checkpoint
    from smpckpt.storage.format._check_units import Tiling

    base = _good(tmp_path, "t")
    folder = tmp_path / "t_partial"
    rec = base["files"][0]
    size = 2 << 20
    with open(folder / rec["name"], "r+b") as f:
        f.truncate(size)  # sparse: reading it costs nothing
    tiling = Tiling(0, size, 2, 2, 1 << 16)
    ends = tiling.tile_ends()
    rec.update(
        size=size, tilings=_pack([0, size, 2, 2, 1 << 16]), block_ends=_pack(ends), block_digests=_pack([0] * len(ends))
    )
    base["format_version"] = 2
    (folder / MANIFEST).write_bytes(_reseal(base))
    report = verify_checkpoint(str(folder))
    assert not report.ok and len(report.problems) == 1, report.problems
    assert f"manifest entry {rec['name']}: tiling" in report.problems[0], report.problems
    assert "row segments of 1 bytes" in report.problems[0], report.problems


def test_an_unsafe_file_name_is_unsafe_whatever_else_its_entry_gets_wrong(tmp_path: Path) -> None:
    # rev67c F1: inlining the tiling unpack ahead of the name check made '../evil' + a malformed tiling corrupt
    base = _good(tmp_path, "g")
    for bad in ({"tilings": _pack([7])}, {"rank": "x"}, {"tilings": _pack([7]), "block_ends": "%%%"}, {"size": -1}):
        crafted = json.loads(json.dumps(base))
        crafted["files"][0].update(name="../evil.distcp", **bad)
        with pytest.raises(UnsafeCheckpoint, match=r"'\.\./evil\.distcp' is not a plain name"):
            Manifest.from_bytes(_reseal(crafted), where="m")

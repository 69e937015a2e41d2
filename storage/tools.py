"""Checkpoint-level helpers for the API and CLI layers: state, manifest, verification, removal."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

from smpckpt.errors import CheckpointCorrupt, CheckpointNotFound
from smpckpt.storage import _names
from smpckpt.storage._checksum import hash_bytes
from smpckpt.storage._errors import translate_errors
from smpckpt.storage._fs import join, open_fs
from smpckpt.storage._state import CheckpointState, probe
from smpckpt.storage.manifest import Manifest

__all__ = ["checkpoint_state", "read_manifest", "verify_checkpoint", "VerifyReport", "remove_checkpoint"]

_READ_CHUNK = 16 << 20


def checkpoint_state(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> CheckpointState:
    """``"committed"`` (manifest present), ``"uncommitted"`` (files but no manifest: a failed or
    running save), ``"legacy"`` (a stock DCP checkpoint: ``.metadata``, no manifest) or ``"missing"``."""
    fs, path = open_fs(url, storage_options)
    return probe(fs, path).state


def read_manifest(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The committed manifest as a JSON dict (``"extra"`` holds what the writer was given).

    Raises :class:`~smpckpt.errors.CheckpointNotFound` when the folder holds no committed checkpoint.
    """
    import json

    fs, path = open_fs(url, storage_options)
    found = probe(fs, path, list_when_empty=False)
    if found.manifest is None:
        raise CheckpointNotFound(f"no committed smpckpt checkpoint at {os.fspath(url)} (state: {found.state})")
    result: dict[str, Any] = json.loads(found.manifest.to_bytes())
    return result


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """Result of :func:`verify_checkpoint`. ``ok`` is true when ``problems`` is empty."""

    url: str
    state: CheckpointState
    files_checked: int
    bytes_checked: int
    problems: tuple[str, ...]
    checksummed: bool  # False for legacy checkpoints (sizes/references only)

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_if_failed(self) -> None:
        if self.problems:
            raise CheckpointCorrupt(f"{self.url}: " + "; ".join(self.problems[:10]))


def verify_checkpoint(
    url: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Check every file of a committed checkpoint: presence, size and every block checksum.

    ``progress(done_bytes, total_bytes)`` is called as bytes are checked. A legacy (stock DCP)
    checkpoint has no checksums: its referenced files are checked for presence and size only.
    Raises :class:`~smpckpt.errors.CheckpointNotFound` when there is no checkpoint to verify.
    """
    url = os.fspath(url)
    fs, path = open_fs(url, storage_options)
    found = probe(fs, path)
    if found.state in ("missing", "uncommitted"):
        raise CheckpointNotFound(f"{url}: nothing committed to verify (state: {found.state}) {found.detail}".rstrip())
    problems: list[str] = []
    if found.manifest is None:
        return _verify_legacy(fs, path, url, found.legacy_metadata, progress)
    manifest: Manifest = found.manifest
    total = manifest.total_bytes
    done = 0
    md_path = join(fs, path, manifest.metadata.name)
    try:
        with translate_errors(md_path):
            md = bytes(fs.cat_file(md_path))
        if len(md) != manifest.metadata.size or hash_bytes(md) != manifest.metadata.digest:
            problems.append(f"{manifest.metadata.name}: size or checksum differs from the manifest")
    except FileNotFoundError:
        problems.append(f"{manifest.metadata.name}: missing")
    done += manifest.metadata.size
    if progress:
        progress(done, total)
    for rec in manifest.files:
        fpath = join(fs, path, rec.name)
        try:
            with translate_errors(fpath):
                size = int(fs.size(fpath))
        except FileNotFoundError:
            problems.append(f"{rec.name}: missing")
            done += rec.size
            continue
        if size != rec.size:
            problems.append(f"{rec.name}: size {size}, manifest says {rec.size}")
            done += rec.size
            continue
        with translate_errors(fpath), fs.open(fpath, "rb", block_size=_READ_CHUNK, cache_type="none") as f:
            for i, end in enumerate(rec.block_ends):
                start = rec.block_start(i)
                block = f.read(end - start)
                if hash_bytes(block) != rec.block_digests[i]:
                    problems.append(f"{rec.name}: checksum mismatch in bytes {start}..{end} (block {i})")
                done += end - start
                if progress and (i % 16 == 15 or i == len(rec.block_ends) - 1):
                    progress(done, total)
    return VerifyReport(url, "committed", len(manifest.files) + 1, done, tuple(problems), True)


def _verify_legacy(fs: Any, path: str, url: str, metadata: Any, progress: Callable[[int, int], None] | None) -> VerifyReport:
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = str(info.relative_path)
        needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    problems: list[str] = []
    total = sum(needed.values())
    done = 0
    for name, end in sorted(needed.items()):
        fpath = join(fs, path, name)
        try:
            with translate_errors(fpath):
                size = int(fs.size(fpath))
            if size < end:
                problems.append(f"{name}: {size} bytes, records need {end}")
        except FileNotFoundError:
            problems.append(f"{name}: missing")
        done += end
        if progress:
            progress(done, total)
    return VerifyReport(url, "legacy", len(needed), 0, tuple(problems), False)


def remove_checkpoint(
    url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None, *, missing_ok: bool = True
) -> None:
    """Delete a checkpoint folder. The manifest goes first, so an interrupted removal leaves an
    uncommitted folder (refused by readers), never a committed one with files missing."""
    fs, path = open_fs(url, storage_options)
    manifest_path = join(fs, path, _names.MANIFEST_NAME)
    try:
        with translate_errors(manifest_path):
            fs.rm_file(manifest_path)
    except FileNotFoundError:
        pass
    try:
        with translate_errors(path):
            fs.rm(path, recursive=True)
    except FileNotFoundError:
        if not missing_ok:
            raise CheckpointNotFound(f"no checkpoint at {os.fspath(url)}") from None


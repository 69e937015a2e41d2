"""What a checkpoint folder holds: committed, uncommitted, legacy (stock DCP) or missing.

One GET for the manifest; only without one, a GET of ``.metadata``; only without both, a LIST (to
tell an uncommitted save from an empty location). Nothing here runs on the save hot path except the
coordinator's single overwrite check.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from smpckpt.errors import UnsafeCheckpoint
from smpckpt.storage.backends._fs import confine, join, read_bytes_or_none, translate_errors
from smpckpt.storage.format import _names
from smpckpt.storage.format._safe_pickle import load_metadata
from smpckpt.storage.format.manifest import Manifest

__all__ = ["CheckpointState", "Probe", "probe"]

CheckpointState = Literal["committed", "uncommitted", "legacy", "missing"]


@dataclasses.dataclass(frozen=True)
class Probe:
    state: CheckpointState
    manifest: Manifest | None = None
    legacy_metadata: Any = None  # DCP Metadata of a stock checkpoint
    detail: str = ""
    #: the manifest's bytes as read (what an overwrite replaces, exactly: ``commit(replace=...)``)
    raw: bytes | None = None

    def generation_files(self) -> list[str]:
        """Base names of the files of the checkpoint found (to remove after an overwrite commits)."""
        if self.manifest is not None:
            return [f.name for f in self.manifest.files] + [self.manifest.metadata.name]
        if self.legacy_metadata is not None:
            names = {
                getattr(info, "relative_path", None) for info in (self.legacy_metadata.storage_data or {}).values()
            }
            # a crafted name must never reach a delete: refuse the checkpoint instead
            return sorted(_names.check_member_name(n, where="legacy .metadata") for n in names)
        return []


def _plain_names(metadata: Any) -> list[str]:
    names = []
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        try:
            names.append(_names.check_member_name(getattr(info, "relative_path", None), where=""))
        except UnsafeCheckpoint:
            continue
    return names


def _refers_to_our_files(metadata: Any) -> bool:
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        if _names.RAW_DESCRIPTOR in (getattr(info, "transform_descriptors", None) or ()):
            return True
        if _names.is_smpckpt_file(str(getattr(info, "relative_path", ""))):
            return True
    return False


def probe(fs: Any, folder: str, *, list_when_empty: bool = True) -> Probe:
    """Classify ``folder``. Raises :class:`~smpckpt.errors.CheckpointCorrupt` for a malformed manifest
    and :class:`~smpckpt.errors.UnsafeCheckpoint` for a ``.metadata`` that needs code to load, or (local
    disk) files reached through a link leading out of the folder: nothing reads or deletes through it."""
    where = join(folder, _names.MANIFEST_NAME)
    data = read_bytes_or_none(fs, where)
    if data is not None:
        found = Probe("committed", manifest=Manifest.from_bytes(data, where=where), raw=data)
        confine(fs, folder, found.generation_files(), where=folder)  # links out of the folder: unsafe
        return found
    md_path = join(folder, _names.METADATA_NAME)
    md_bytes = read_bytes_or_none(fs, md_path)
    if md_bytes is not None:
        metadata = load_metadata(md_bytes, where=md_path)
        if _refers_to_our_files(metadata):
            return Probe("uncommitted", detail=f"{md_path} exists but {_names.MANIFEST_NAME} does not")
        # plain names only: a crafted one is refused where it is read, naming its key
        confine(fs, folder, _plain_names(metadata), where=folder)
        return Probe("legacy", legacy_metadata=metadata)
    if not list_when_empty:
        return Probe("missing")
    try:
        with translate_errors(folder):
            entries = fs.ls(folder, detail=False)
    except (FileNotFoundError, NotADirectoryError):
        entries = []
    if entries:
        return Probe("uncommitted", detail=f"{len(entries)} file(s) but no {_names.MANIFEST_NAME} and no .metadata")
    return Probe("missing")

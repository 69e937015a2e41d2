"""Removing what a failed save wrote (partial or full), so that a retry leaves none of it behind.

``dcp.save`` reports a failure to every rank only after every rank's ``write_data`` returned, so by
then nothing of that save is still being written. Each rank then removes the data files it wrote for
the failed save id (the coordinator also that save's metadata copy) -- unless the commit landed after
all, which the manifest's save id tells. Only names created for that save id are touched, so a save
racing in the same folder keeps its files. Debris of *killed* saves cannot be told from a save still
running; it is left to ``remove_uncommitted_older_than`` and ``smpckpt prune``, which judge by age.

A full save's files have fixed names (no save id in them); its in-progress marker holds the save id,
so the coordinator removes the folder's files only while the marker still names the failed save.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

from smpckpt.errors import CheckpointError
from smpckpt.storage import _names
from smpckpt.storage._fs import is_local, join, read_bytes_or_none, remove_files
from smpckpt.storage._full_commit import folder_names
from smpckpt.storage._full_plan import WRITING_MARKER
from smpckpt.storage._prefixes import remove_empty_folders
from smpckpt.storage._state import probe
from smpckpt.storage.manifest import Manifest

__all__ = ["FailedSaveFiles", "committed_by", "discard_generation", "discard_failed_full_save"]

log = logging.getLogger(__name__)


def _manifest_save_id(fs: Any, path: str) -> str | None:
    """The save id of the manifest at ``path`` (None: no manifest); raises when it cannot be read."""
    found = probe(fs, path, list_when_empty=False)
    return found.manifest.save_id if found.manifest is not None else None


def committed_by(fs: Any, path: str, save_id: str) -> bool:
    """After a refused exclusive commit: is the manifest there this save's own (a retried request whose
    first attempt landed)? An unreadable one is not."""
    try:
        return _manifest_save_id(fs, path) == save_id
    except CheckpointError:
        return False


def discard_generation(fs: Any, path: str, manifest: Manifest) -> None:
    """(coordinator, after losing a commit race) Remove the files of the refused save's ``manifest``."""
    failed = remove_files(fs, [join(path, f.name) for f in manifest.files] + [join(path, manifest.metadata.name)])
    if failed:
        log.warning("could not remove %d file(s) of the refused save: %s", len(failed), failed[:5])


class FailedSaveFiles:
    """The files one rank wrote for one save (partial mode), to remove if that save fails.

    Call order: :meth:`begin` (``write_data``, every rank) -> :meth:`add` per file created (writer
    threads; also the coordinator's metadata copy in ``finish``) -> :meth:`discard` (every rank, after
    ``dcp.save`` raised). A later :meth:`begin` forgets the previous save's names."""

    def __init__(self) -> None:
        self.save_id: str | None = None
        self.names: list[str] = []

    def begin(self, save_id: str) -> None:
        self.save_id, self.names = save_id, []

    def add(self, name: str) -> None:
        if self.save_id is not None:
            self.names.append(name)  # list.append is atomic: writer threads call this concurrently

    def discard(self, fs: Any, path: str, url: str) -> list[str]:
        """Remove the recorded files unless ``path``'s manifest is this save's; the paths that could
        not be removed (all of them when the folder's state cannot be read: nothing is removed blind)."""
        save_id, names = self.save_id, self.names
        self.save_id, self.names = None, []
        if save_id is None or not names:
            return []
        paths = [join(path, n) for n in names]
        try:
            committed = _manifest_save_id(fs, path)
        except (CheckpointError, OSError) as exc:
            log.warning(
                "%s: the failed save's %d file(s) were left: the folder could not be read (%s)", url, len(paths), exc
            )
            return paths
        if committed == save_id:
            return []  # the commit landed: these files are the checkpoint
        failed = remove_files(fs, paths)
        if is_local(fs):
            remove_empty_folders(path, paths)
            _rmdir_if_empty(fs, path)
        if failed:
            log.warning("%s: could not remove %d file(s) of the failed save: %s", url, len(failed), failed[:5])
        return failed


def _rmdir_if_empty(fs: Any, path: str) -> None:
    # the folder the save made, once nothing is left in it: the rank that removes the last file
    # succeeds, the others find it not empty yet
    if is_local(fs):
        with contextlib.suppress(OSError):
            os.rmdir(path)


def discard_failed_full_save(fs: Any, path: str, url: str, save_id: str | None) -> list[str]:
    """(coordinator, after a failed full save) Remove the folder's files, the in-progress marker last,
    while that marker names ``save_id`` and no manifest is there; the paths that could not be removed.
    The folder held nothing else when the save began (``clear_for_full_save`` saw to that). ``None``
    (other ranks; no save prepared): nothing to do."""
    if save_id is None or read_bytes_or_none(fs, join(path, WRITING_MARKER)) != save_id.encode():
        return []  # committed (the marker goes at the commit), or another save took the folder over
    names = folder_names(fs, path)
    if _names.MANIFEST_NAME in names:
        return []
    failed = remove_files(fs, [join(path, n) for n in sorted(names - {WRITING_MARKER})])
    if not failed:  # the marker keeps the folder recognisable as debris until the rest is gone
        failed = remove_files(fs, [join(path, WRITING_MARKER)])
    if failed:
        log.warning("%s: could not remove %d file(s) of the failed full save: %s", url, len(failed), failed[:5])
    else:
        _rmdir_if_empty(fs, path)
    return failed

"""Removing what a failed save wrote (partial or full), so that a retry leaves none of it behind.

``dcp.save`` reports a failure to every rank only after every rank's ``write_data`` returned (and the
coordinator's ``finish``, when it ran, returned or raised), so by then nothing of that save is still
being written. Each rank then removes the files it recorded for the failed save: a partial save's data
files (named with its save id) and the coordinator's metadata copy; on object stores a full save's
artifact, side files and metadata copy (the coordinator: it laid them out), its in-progress marker last
and only while the marker still names that save (on POSIX a full save's staging folder goes whole:
``FullArtifactWriter.discard_failed_save``). Every removal goes through the protocol's folder, never
through a link. Nothing is removed when a manifest shows the commit landed (partial: this
save's id; full: any manifest), when the folder cannot be read, or when the commit request failed in a
way that does not tell whether it landed (:class:`CommitUncertain`, object stores). The folder itself
goes only if this save made it and it is empty. Debris of *killed* saves cannot be told from a save still
running; it is left to ``remove_uncommitted_older_than`` and ``smpckpt prune``, which judge by age.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

from smpckpt.errors import CheckpointError
from smpckpt.storage.backends._folder import remove_files
from smpckpt.storage.backends._fs import is_local, join, read_bytes_or_none
from smpckpt.storage.format._names import WRITING_MARKER, marker_owner
from smpckpt.storage.format.commit import CommitUncertain, commit_uncertain
from smpckpt.storage.format.manifest import probe

# CommitUncertain and commit_uncertain live with the commit protocol (storage/format/commit.py)
__all__ = ["CommitUncertain", "FailedSaveFiles", "commit_uncertain", "folder_is_new"]

log = logging.getLogger(__name__)


def _manifest_save_id(fs: Any, path: str) -> str | None:
    """The save id of the manifest at ``path`` (None: no manifest); raises when it cannot be read."""
    found = probe(fs, path, list_when_empty=False)
    return found.manifest.save_id if found.manifest is not None else None


class FailedSaveFiles:
    """The files one rank wrote for one save, to remove if that save fails.

    Call order: a new instance per save (``storage_writer.storage_meta``, DCP's first call) ->
    :meth:`begin` (partial: ``write_data``, every rank; full: ``prepare_global_plan``, coordinator) ->
    :meth:`add` per file created (writer threads too) -> :meth:`discard` (every rank, after
    ``dcp.save`` raised)."""

    def __init__(self) -> None:
        self.save_id: str | None = None
        self.names: list[str] = []
        self.new_folder = False  # the folder did not exist when the save began (local paths)

    def begin(self, save_id: str, *, new_folder: bool, names: tuple[str, ...] = ()) -> None:
        self.save_id, self.names, self.new_folder = save_id, list(names), new_folder

    def add(self, name: str) -> None:
        if self.save_id is not None:
            self.names.append(name)  # list.append is atomic: writer threads call this concurrently

    def discard(self, fs: Any, path: str, url: str, *, full: bool) -> list[str]:
        """Remove the recorded files (see the module docstring for when not); the paths that could
        not be removed (all of them when the folder's state cannot be read: nothing is removed blind)."""
        save_id, names = self.save_id, list(dict.fromkeys(self.names))
        self.save_id, self.names = None, []
        if save_id is None or not names:
            return []
        paths = [join(path, n) for n in names]
        try:
            committed = _manifest_save_id(fs, path)
            marker = read_bytes_or_none(fs, join(path, WRITING_MARKER)) if full else None
        except (CheckpointError, OSError) as exc:
            log.warning(
                "%s: the failed save's %d file(s) were left: the folder could not be read (%s)", url, len(paths), exc
            )
            return paths
        if committed == save_id or (full and (committed is not None or marker_owner(marker) != save_id)):
            return []  # the commit landed (these files are the checkpoint), or another save took the folder
        failed = remove_files(fs, paths, within=path)
        if full and not failed:  # the marker keeps the folder recognisable as debris until the rest is gone
            failed = remove_files(fs, [join(path, WRITING_MARKER)])
        if failed:
            log.warning("%s: could not remove %d file(s) of the failed save: %s", url, len(failed), failed[:5])
        elif is_local(fs):
            if self.new_folder:
                # the rank that removes the last file succeeds; the others find it not empty yet
                with contextlib.suppress(OSError):
                    os.rmdir(path)
        return failed


def folder_is_new(fs: Any, path: str) -> bool:
    """(coordinator, before a save writes anything) Whether the save will make its folder (local paths)."""
    return is_local(fs) and not os.path.isdir(path)

"""Partial mode, the coordinator around its commit: before the save, a folder without a committed checkpoint
settled (``FsspecStorageWriter.prepare_global_plan``); before the manifest, every data file the ranks
wrote is there at its size; after it, the stock ``.metadata`` copy and the removal of the previous
generation's files (an overwrite)."""

from __future__ import annotations

import logging
from typing import Any

from smpckpt.errors import CheckpointError, CheckpointExists
from smpckpt.storage.backends._fs import (
    file_sizes,
    is_local,
    join,
    read_bytes_or_none,
    remove_files,
    remove_tree,
    write_bytes_atomic,
)
from smpckpt.storage.backends._prefixes import remove_empty_folders
from smpckpt.storage.format import _names
from smpckpt.storage.format.manifest import FileRecord, Manifest

__all__ = ["settle_uncommitted_folder", "check_data_files", "after_commit"]

log = logging.getLogger("smpckpt.storage.write.writer")


def settle_uncommitted_folder(fs: Any, path: str, url: str) -> None:
    """(coordinator, before a partial save writes into a folder with no committed checkpoint; two small
    GETs, not a listing: on S3 listing an absent folder lists its parent, the whole root)

    * Refuse a folder holding a full save's in-progress marker: that save may still be running, and if
      it was killed its fixed-name files (``model.safetensors``, ...) would sit beside the partial
      checkpoint, where a Hugging Face loader would read their unwritten zeros. The API never meets this
      (full saves go to ``{tag}``, partial ones to ``{tag}_partial``); ``dcp.save`` callers mixing modes
      in a folder do.
    * Finish an interrupted removal (its marker is there) first: otherwise a later retention or prune,
      which finishes such folders, would delete this save's files, and the removed checkpoint's leftovers
      would outlive this save's commit."""
    marker = read_bytes_or_none(fs, join(path, _names.WRITING_MARKER))
    if marker is not None:
        raise CheckpointExists(
            f"{url} holds an unfinished full save ({_names.WRITING_MARKER} names save {marker[:40]!r}, no "
            f"{_names.MANIFEST_NAME}): one running there, or one that failed or was killed. Save under "
            "another folder, or remove that one first (smpckpt.storage.remove_checkpoint)"
        )
    if read_bytes_or_none(fs, join(path, _names.REMOVING_NAME)) is not None:
        log.warning("%s: finishing an interrupted removal before saving here", url)
        failed = remove_tree(fs, path)
        if failed:
            raise CheckpointError(f"{url}: could not finish the interrupted removal found here: {failed[:5]}")


def check_data_files(fs: Any, path: str, url: str, files: list[FileRecord]) -> None:
    """(before the commit) Every data file the ranks report is there, at its size: a commit must never
    list a file that is gone (a ``prune --uncommitted-older-than`` running during the save removed some;
    the save then returned OK with its data missing). One listing of the folder."""
    found = file_sizes(fs, path)
    bad = [
        f"{f.name} ({found.get(f.name, 'missing')} bytes, {f.size} written)"
        for f in files
        if found.get(f.name) != f.size
    ]
    if bad:
        raise CheckpointError(
            f"{url}: {len(bad)} data file(s) of this save are missing or cut short at the commit: "
            f"{', '.join(bad[:5])}; nothing was committed. Did something remove files here during the save "
            "(a prune of uncommitted folders with too short an age)?"
        )


def after_commit(
    fs: Any, path: str, url: str, manifest: Manifest, md_bytes: bytes, old_files: list[str], *, sync: bool
) -> None:
    """(after the commit) The stock ``.metadata`` name, for stock readers (our reader follows the
    manifest) -- written only now, so the loser of a race can never replace the winner's copy; then the
    previous generation's files, when this save replaced one. Failures are logged: the save is committed."""
    try:
        write_bytes_atomic(fs, join(path, _names.METADATA_NAME), md_bytes, sync=sync)
    except OSError as exc:
        log.warning(
            "%s is committed, but its stock .metadata copy could not be written (stock DCP readers cannot "
            "load it; smpckpt can): %s",
            url,
            exc,
        )
    if old_files:
        keep = {f.name for f in manifest.files} | {manifest.metadata.name, _names.METADATA_NAME, _names.MANIFEST_NAME}
        stale = [join(path, n) for n in old_files if n not in keep]
        failed = remove_files(fs, stale, within=path)
        if failed:
            log.warning("could not remove %d file(s) of the previous generation: %s", len(failed), failed[:5])
        if is_local(fs):
            remove_empty_folders(path, stale)

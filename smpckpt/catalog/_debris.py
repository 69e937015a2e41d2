"""Debris that no folder-level state shows, for ``prune --uncommitted-older-than AGE`` and
``save_checkpoint(remove_uncommitted_older_than=...)``. Whole uncommitted ``{tag}_partial`` folders are
retention's (:mod:`smpckpt.catalog.retention`); this sweeps what a kill leaves elsewhere:

* **inside a committed partial folder**: data and ``.metadata.<id>`` files of another save id than the
  manifest's -- a killed save whose retry under the same tag committed, a killed overwrite's new
  generation, the old generation of an overwrite killed after its commit;
* **killed full saves**: a ``{tag}`` folder holding our in-progress marker and no manifest (retention
  sees ``*_partial`` folders only), removed whole;
* a **stale marker in a committed full folder** (a kill between the commit and the marker's removal);
* **temp files** of an interrupted atomic write in the root (``newest.tmp.*``).

Only what nothing has written for ``AGE`` goes, and never a file a committed manifest lists: a save in
flight writes continually, and an age above the longest save never reaches one. Costs a listing per
folder (opt-in, like the rest of stale-debris removal).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping
from typing import Any

from smpckpt.catalog.listing import CheckpointRecord
from smpckpt.catalog.tags import NEWEST_NAME, open_root, tag_of_partial_dirname
from smpckpt.storage import probe_checkpoint, remove_checkpoint
from smpckpt.storage.backends._fs import join
from smpckpt.storage.backends._paths import remove_files
from smpckpt.storage.format._names import MANIFEST_NAME, WRITING_MARKER, generation_metadata_name, is_smpckpt_file
from smpckpt.storage.tools import _mtime  # the one reader of fsspec's per-backend time fields

__all__ = ["sweep_debris"]

log = logging.getLogger(__name__)


def _mtimes(fs: Any, path: str) -> dict[str, float]:
    """Relative name -> modification time (epoch seconds) of every file under ``path``."""
    base = str(fs._strip_protocol(path)).rstrip("/") + "/"
    try:
        found = fs.find(path, detail=True)
    except FileNotFoundError:
        return {}
    out = {}
    for p, info in found.items():
        t = _mtime(info)
        if str(p).startswith(base) and info.get("type") != "directory" and t is not None:
            out[str(p)[len(base) :]] = t
    return out


def sweep_debris(
    root_url: str,
    records: list[CheckpointRecord],
    older_than_s: float,
    *,
    storage_options: Any = None,
    protected: Collection[str] = (),
    dry_run: bool = False,
) -> list[str]:
    """(rank 0) Remove the debris above that nothing wrote for ``older_than_s``; the paths removed."""
    fs, root_path = open_root(root_url, storage_options)
    now = time.time()
    doomed: list[str] = []

    def old(t: float | None) -> bool:
        return t is not None and now - t >= older_than_s

    for r in records:  # dead generations beside a committed partial checkpoint
        if not r.committed or r.manifest is None:
            continue  # (a protected tag too: its listed files stay, whatever else is there goes)
        listed = {f.name for f in r.manifest.files} | {generation_metadata_name(r.manifest.save_id)}
        folder = join(root_path, f"{r.tag}_partial")
        for name, t in _mtimes(fs, folder).items():
            if name not in listed and is_smpckpt_file(name) and old(t):
                doomed.append(join(folder, name))
    try:
        entries = fs.ls(root_path, detail=True)
    except FileNotFoundError:
        entries = []
    for e in entries:  # temp files of interrupted atomic writes
        if e.get("type") != "directory" and ".tmp." in _name(e) and old(_mtime(e)):
            doomed.append(join(root_path, _name(e)))
    removed = doomed if dry_run else [p for p in doomed if p not in remove_files(fs, doomed)]
    removed += _full_debris(fs, entries, root_path, root_url, old, storage_options, protected, dry_run)
    for p in removed:
        log.info("prune: %s %s", "would remove" if dry_run else "removed", p)
    return removed


def _name(entry: Mapping[str, Any]) -> str:
    """The last component of a listing entry's name."""
    return str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]


def _full_debris(
    fs: Any,
    entries: list[Mapping[str, Any]],
    root_path: str,
    root_url: str,
    old: Any,
    storage_options: Any,
    protected: Collection[str],
    dry_run: bool,
) -> list[str]:
    """Killed full saves (marker, no manifest) among the root's ``entries`` removed whole; a committed
    full folder's stale marker."""
    removed: list[str] = []
    for e in entries:
        name = _name(e)
        if e.get("type") != "directory" or tag_of_partial_dirname(name) is not None or name == NEWEST_NAME:
            continue
        if name in protected:
            continue
        folder = join(root_path, name)
        times = _mtimes(fs, folder)
        if WRITING_MARKER not in times or not old(times[WRITING_MARKER]):
            continue  # not ours, or a save in flight (it keeps its marker fresh)
        url = join(root_url.rstrip("/"), name)
        if MANIFEST_NAME in times:  # committed: only the marker a kill after the commit left goes
            if probe_checkpoint(url, storage_options).state == "committed":
                if dry_run or not remove_files(fs, [join(folder, WRITING_MARKER)], within=folder):
                    removed.append(join(folder, WRITING_MARKER))
            continue
        if not all(old(t) for t in times.values()):
            continue  # written to within AGE
        if not dry_run:
            remove_checkpoint(url, storage_options)
        removed.append(folder)
    return removed

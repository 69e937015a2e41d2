"""Debris that no folder-level state shows, for ``prune --uncommitted-older-than AGE`` and
``save_checkpoint(remove_uncommitted_older_than=...)``. Whole uncommitted ``{tag}_partial`` folders are
retention's (:mod:`smpckpt.catalog.root`); this sweeps what a kill leaves elsewhere:

* inside a committed partial folder: data and ``.metadata.<id>`` files of another save id than the
  manifest's, and temporary files of an interrupted write (``*.tmp.<pid>.<hex>``, ``*.recv.<pid>.<hex>``);
* killed full saves: staging (``.smpckpt-staging.<id>``, taken away by a rename first) and trash
  folders, and a ``{tag}`` folder holding only an unfinished save of ours and no manifest, removed whole
  only if still uncommitted once marked for removal;
* a stale marker or temporary file in a committed full folder; temp files in the root (``newest.tmp.*``).

Only what nothing has written for ``AGE`` goes, never a file a committed manifest lists. Costs a
listing per folder (opt-in). The README's "CLI" (``prune``) lists every case.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from smpckpt.catalog.root import NEWEST_NAME, open_root, tag_of_partial_dirname
from smpckpt.errors import CheckpointError
from smpckpt.storage import abort_stale_uploads, last_activity, probe_checkpoint, remove_checkpoint
from smpckpt.storage.backends._folder import remove_files
from smpckpt.storage.backends._fs import is_local, join, ls_fresh, translate_errors
from smpckpt.storage.format.commit import remove_staged
from smpckpt.storage.format.manifest import (
    MANIFEST_NAME,
    TRASH_PREFIX,
    WRITING_MARKER,
    generation_metadata_name,
    is_smpckpt_file,
    is_staging_name,
    is_temp_name,
    unfinished_full_save,
)
from smpckpt.storage.tools import _mtime, _s3_uploads, file_times  # the one reader of fsspec's per-backend time fields

if TYPE_CHECKING:  # retention imports this module (its sweep): the type only
    from smpckpt.catalog.root import CheckpointRecord

__all__ = ["sweep_debris", "sweep_stale", "select_stale_uncommitted", "run_each"]

log = logging.getLogger(__name__)


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

    removed: list[str] = []
    for r in records:  # dead generations and temporary files beside a committed partial checkpoint
        if not r.committed or r.manifest is None:
            continue  # (a protected tag too: its listed files stay, whatever else is there goes)
        listed = {f.name for f in r.manifest.files} | {generation_metadata_name(r.manifest.save_id)}
        folder = join(root_path, f"{r.tag}_partial")
        dead = [
            join(folder, name)
            for name, t in file_times(fs, folder).items()
            if name not in listed and (is_smpckpt_file(name) or is_temp_name(name)) and old(t)
        ]
        # resolved inside the tag's folder without following links (a folder swapped for a link is not entered)
        removed += dead if dry_run else [p for p in dead if p not in remove_files(fs, dead, within=folder)]
    try:
        with translate_errors(root_path):
            entries = ls_fresh(fs, root_path, detail=True)
    except FileNotFoundError:
        entries = []
    for e in entries:  # temp files of interrupted atomic writes
        if e.get("type") != "directory" and is_temp_name(_name(e)) and old(_mtime(e)):
            doomed.append(join(root_path, _name(e)))
    removed += doomed if dry_run else [p for p in doomed if p not in remove_files(fs, doomed)]
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
    """Killed full saves among the root's ``entries`` removed whole (staging folders; ``{tag}`` folders of
    an unfinished save of ours without a manifest); a committed full folder's stale marker and
    temporary files."""
    removed: list[str] = []
    for e in entries:
        name = _name(e)
        if e.get("type") != "directory" or tag_of_partial_dirname(name) is not None or name == NEWEST_NAME:
            continue
        if name in protected:
            continue
        folder = join(root_path, name)
        times = file_times(fs, folder)
        url = join(root_url.rstrip("/"), name)
        if MANIFEST_NAME in times and not is_staging_name(name):
            # committed (or about to be): only a marker or temporary a kill left, once old, goes
            stray = [n for n, t in times.items() if (n == WRITING_MARKER or is_temp_name(n)) and old(t)]
            if stray and probe_checkpoint(url, storage_options).state == "committed":
                paths = [join(folder, n) for n in stray]
                removed += paths if dry_run else [p for p in paths if p not in remove_files(fs, paths, within=folder)]
            continue
        names = {n.rpartition("/")[2] for n in times}
        staged = is_staging_name(name) or name.startswith(TRASH_PREFIX)
        if not (staged or unfinished_full_save(names)):
            continue  # not ours (a Hugging Face folder, a partial save's files under a full tag: left alone)
        if (not times and not name.startswith(TRASH_PREFIX)) or not all(old(t) for t in times.values()):
            continue  # written to within AGE (an empty folder: nothing says how old it is)
        if dry_run:
            removed.append(folder)
        elif staged and is_local(fs):
            # taken away by a rename first: a save publishing it meanwhile wins (commit.remove_staged)
            if remove_staged(fs, root_path, name) == []:
                removed.append(folder)
        elif remove_checkpoint(url, storage_options, uncommitted_only=True):
            removed.append(folder)
    return removed


def select_stale_uncommitted(
    records: Sequence[CheckpointRecord], activity: Mapping[str, float | None], older_than_s: float, now: float
) -> list[str]:
    """Tags of uncommitted folders with no activity (``activity``: tag -> newest modification time under
    its folder, ``None``: nothing there) for ``older_than_s`` seconds; ``corrupt`` and ``unsafe`` folders
    are left for a human."""
    return [
        r.tag
        for r in records
        if r.state == "uncommitted" and ((t := activity.get(r.tag)) is None or now - t >= older_than_s)
    ]


def sweep_stale(
    root_url: str,
    records: list[CheckpointRecord],
    older_than_s: float,
    remove: Callable[..., bool],
    storage_options: Any,
    protected: Collection[str],
    dry_run: bool,
) -> tuple[list[str], list[str], list[str]]:
    """(rank 0, retention's ``uncommitted_older_than``) Remove uncommitted folders (through retention's
    ``remove``) nothing wrote to for ``older_than_s``, S3 multipart uploads under the root started that long
    ago, and the debris above: (tags removed, uploads aborted, paths removed). A folder is removed only if
    still uncommitted once marked for removal (``storage.format.commit``): too short an age fails a save,
    never empties a committed checkpoint."""
    fs, root_path = open_root(root_url, storage_options)
    folders = {r.tag: r for r in records if r.tag not in protected and r.state == "uncommitted"}
    uploads = _s3_uploads(fs, root_path) if folders else None  # the root's, once (not once per folder: hunt66b r4)

    def one(tag: str) -> bool:  # its last activity, then (stale) its removal: marked first (commit.remove_folder)
        when = {tag: last_activity(folders[tag].url, storage_options, uploads)}
        # the clock read after the activity: a file written between the two is never "from the future" (fresh)
        old = select_stale_uncommitted([folders[tag]], when, older_than_s, time.time())
        return bool(old) and remove(tag, "stale uncommitted folder", uncommitted_only=True)

    stale = run_each(fs, list(folders), one)  # 8 folders at once on object stores
    debris: list[str] = []
    aborted: list[str] = []
    try:
        debris = sweep_debris(
            root_url,
            [r for r in records if r.tag not in stale],
            older_than_s,
            storage_options=storage_options,
            protected=protected,
            dry_run=dry_run,
        )
    except (OSError, CheckpointError) as exc:
        log.warning("retention: could not sweep stale debris under %s: %s", root_url, exc)
    if not dry_run:
        try:
            aborted = abort_stale_uploads(root_url, older_than_s, storage_options, uploads)
        except OSError as exc:
            log.warning("retention: could not list or abort multipart uploads under %s: %s", root_url, exc)
    return stale, aborted, debris


def run_each(fs: Any, items: Sequence[str], fn: Callable[[str], bool], parallel: bool = True) -> list[str]:
    """The ``items`` ``fn`` returned true for, in order; a store's backlog (independent folders, each its
    own steps in order): 8 at once (hunt66b), one by one on local disk or when not ``parallel``."""
    many = parallel and len(items) > 1 and not is_local(fs)
    with concurrent.futures.ThreadPoolExecutor(8 if many else 1, thread_name_prefix="smpckpt-retention") as pool:
        return [item for item, ok in zip(items, (pool.map if many else map)(fn, items)) if ok]

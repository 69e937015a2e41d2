"""What a checkpoint root holds: one :class:`CheckpointRecord` per ``{tag}_partial`` folder.

Used by resume (fallback when ``newest`` is unusable), retention and ``smpckpt ls``; always on one
rank (rank 0), whose answer is broadcast -- 512 ranks listing S3 at once get throttled.

Cost: one LIST of the root plus one GET (the manifest) per committed folder (several in flight on
object stores); a folder without a manifest costs up to one more GET and a LIST to tell "uncommitted"
from "legacy"/"missing". A hostile or broken sibling folder is listed as such, never fatal.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import datetime
import logging
from collections.abc import Mapping
from typing import Any, Literal

from smpckpt.catalog.tags import join_url, list_partial_tags, open_root, read_newest, sequence_of
from smpckpt.errors import CheckpointCorrupt, CheckpointError, UnsafeCheckpoint
from smpckpt.storage import Manifest, probe_checkpoint, removal_marked
from smpckpt.storage.backends._fs import is_local

__all__ = ["CheckpointRecord", "RecordState", "scan_root", "record_order", "newest_tag", "highest_sequence"]

log = logging.getLogger(__name__)


#: States a folder under a root can be in. ``unsafe``: its ``.metadata`` or manifest must not be
#: trusted (a pickle payload, names escaping the folder); ``unreadable``: probing failed (I/O error).
#: ``removing``: an interrupted removal (retention, prune) left it: garbage, finished by the next retention.
RecordState = Literal["committed", "uncommitted", "removing", "legacy", "missing", "corrupt", "unsafe", "unreadable"]


@dataclasses.dataclass(frozen=True)
class CheckpointRecord:
    """One partial checkpoint folder under a root.

    ``order`` sorts records oldest first: ``(sequence, save time, save_id)`` (:func:`record_order`);
    ``committed`` is true only with a valid manifest (the commit marker). ``detail`` says why a folder is
    not usable.
    """

    tag: str
    committed: bool
    order: tuple[int, int, str] = (0, 0, "")
    url: str = ""
    state: RecordState = "committed"
    manifest: Manifest | None = None
    detail: str = ""

    @property
    def extra(self) -> Mapping[str, Any]:
        return self.manifest.extra if self.manifest is not None else {}

    @property
    def size(self) -> int | None:
        """Bytes of the committed generation (metadata + data files), from the manifest."""
        return self.manifest.total_bytes if self.manifest is not None else None


def record_order(manifest: Manifest | Mapping[str, Any] | None) -> tuple[int, int, str]:
    """Sort key of a committed checkpoint, oldest first: its sequence number (``smpckpt.catalog.tags``;
    0 for checkpoints written before sequence numbers), then -- only among equal numbers, so only among
    those older checkpoints or two jobs racing in one root -- the save time (our nanosecond stamp, else the
    manifest's ``created``), then the save id."""
    if manifest is None:
        return (0, 0, "")
    created: Any
    if isinstance(manifest, Manifest):
        extra, created, save_id = manifest.extra, manifest.created, manifest.save_id
    else:
        if not manifest:
            return (0, 0, "")
        extra, created, save_id = manifest.get("extra") or {}, manifest.get("created"), str(manifest.get("save_id", ""))
    ns = extra.get("saved_at_ns")
    if not isinstance(ns, int) or isinstance(ns, bool):
        ns = 0
        if isinstance(created, str):
            with contextlib.suppress(ValueError, OverflowError):  # not a date: 0
                ns = int(datetime.datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp() * 1e9)
    return (sequence_of(extra), ns, str(save_id))


def _record(tag: str, url: str, storage_options: Any) -> CheckpointRecord:
    """Probe one folder; never raises for what the folder holds (one bad sibling must not break a root)."""
    try:
        found = probe_checkpoint(url, storage_options)
    except UnsafeCheckpoint as exc:
        log.warning("%s: refusing an unsafe checkpoint folder: %s", url, exc)
        return CheckpointRecord(tag, False, url=url, state="unsafe", detail=str(exc))
    except CheckpointCorrupt as exc:
        log.warning("%s: unreadable manifest, treating the checkpoint as uncommitted: %s", url, exc)
        return CheckpointRecord(tag, False, url=url, state="corrupt", detail=str(exc))
    except (CheckpointError, OSError) as exc:
        log.warning("%s: could not probe the checkpoint folder: %s", url, exc)
        return CheckpointRecord(tag, False, url=url, state="unreadable", detail=str(exc))
    if found.manifest is None:
        if found.state == "uncommitted" and removal_marked(url, storage_options):
            return CheckpointRecord(tag, False, url=url, state="removing", detail="an interrupted removal left it")
        return CheckpointRecord(tag, False, url=url, state=found.state, detail=found.detail)
    return CheckpointRecord(tag, True, record_order(found.manifest), url, "committed", found.manifest)


def scan_root(root_url: str, *, storage_options: Any = None) -> list[CheckpointRecord]:
    """Every ``{tag}_partial`` folder under ``root_url``, oldest first (uncommitted ones first of all).

    A folder that cannot be trusted or read is listed with its state (``unsafe``, ``corrupt``,
    ``unreadable``) and a warning; the scan carries on with the others.
    """
    fs, root_path = open_root(root_url, storage_options)
    tags = sorted(list_partial_tags(fs, root_path).items())
    jobs = [(tag, join_url(root_url, name)) for tag, name in tags]
    if len(jobs) > 1 and not is_local(fs):
        # one GET per folder: a few in flight on object stores
        with concurrent.futures.ThreadPoolExecutor(min(8, len(jobs)), thread_name_prefix="smpckpt-scan") as pool:
            records = list(pool.map(lambda job: _record(job[0], job[1], storage_options), jobs))
    else:
        records = [_record(tag, url, storage_options) for tag, url in jobs]
    records.sort(key=lambda r: (r.committed, r.order, r.tag))
    return records


def newest_tag(root_url: str, *, storage_options: Any = None) -> str | None:
    """The validated content of ``{root}/newest``, or ``None``."""
    fs, root_path = open_root(root_url, storage_options)
    return read_newest(fs, root_path)


def highest_sequence(root: str, storage_options: Any = None) -> int:
    """(rank 0) The highest sequence number committed under ``root`` (one listing; 0 when there is none)."""
    return max((r.order[0] for r in scan_root(root, storage_options=storage_options) if r.committed), default=0)

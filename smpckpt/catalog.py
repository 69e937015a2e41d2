"""What a checkpoint root holds: one :class:`CheckpointRecord` per ``{tag}_partial`` folder.

Used by resume (fallback when ``newest`` is unusable), retention and ``smpckpt ls``; always on one
rank (rank 0), whose answer is broadcast -- 512 ranks listing S3 at once get throttled.

Cost: one LIST of the root plus one GET (the manifest) per committed folder; a folder without a
manifest costs up to one more GET and a LIST to tell "uncommitted" from "legacy"/"missing".
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections.abc import Mapping
from typing import Any

from smpckpt.errors import CheckpointCorrupt, CheckpointNotFound
from smpckpt.storage import checkpoint_state, read_manifest
from smpckpt.tags import join_url, list_partial_tags, open_root, read_newest

__all__ = ["CheckpointRecord", "scan_root", "record_order", "API_RECORD"]

log = logging.getLogger(__name__)

#: ``manifest["extra"]["api"]`` of checkpoints written by :func:`smpckpt.save_checkpoint`.
API_RECORD = "smpckpt.save_checkpoint/1"


@dataclasses.dataclass(frozen=True)
class CheckpointRecord:
    """One partial checkpoint folder under a root.

    ``order`` sorts records by save time (oldest first): ``(saved_at_ns, save_id)``; ``committed`` is
    true only with a valid manifest (the commit marker).
    """

    tag: str
    committed: bool
    order: tuple[int, str] = (0, "")
    url: str = ""
    state: str = "committed"  #: committed / uncommitted / legacy / missing / corrupt
    manifest: Mapping[str, Any] | None = None

    @property
    def extra(self) -> Mapping[str, Any]:
        return (self.manifest or {}).get("extra") or {}

    @property
    def size(self) -> int | None:
        """Bytes of the committed generation (metadata + data files), from the manifest."""
        if not self.manifest:
            return None
        files = self.manifest.get("files") or []
        return int(self.manifest.get("metadata", {}).get("size", 0)) + sum(int(f.get("size", 0)) for f in files)


def record_order(manifest: Mapping[str, Any] | None) -> tuple[int, str]:
    """Sort key of a committed checkpoint: our nanosecond save time, else the manifest's ``created``."""
    if not manifest:
        return (0, "")
    extra = manifest.get("extra") or {}
    ns = extra.get("saved_at_ns")
    if not isinstance(ns, int):
        ns = 0
        created = manifest.get("created")
        if isinstance(created, str):
            try:
                ns = int(datetime.datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp() * 1e9)
            except ValueError:
                ns = 0
    return (ns, str(manifest.get("save_id", "")))


def scan_root(root_url: str, *, storage_options: Any = None) -> list[CheckpointRecord]:
    """Every ``{tag}_partial`` folder under ``root_url``, oldest first (uncommitted ones first of all)."""
    fs, root_path = open_root(root_url, storage_options)
    records: list[CheckpointRecord] = []
    for tag, name in sorted(list_partial_tags(fs, root_path).items()):
        url = join_url(root_url, name)
        try:
            manifest = read_manifest(url, storage_options)
        except CheckpointNotFound:
            state = checkpoint_state(url, storage_options)
            records.append(CheckpointRecord(tag, False, url=url, state=state))
            continue
        except CheckpointCorrupt as exc:
            log.warning("%s: unreadable manifest, treating the checkpoint as uncommitted: %s", url, exc)
            records.append(CheckpointRecord(tag, False, url=url, state="corrupt"))
            continue
        records.append(CheckpointRecord(tag, True, record_order(manifest), url, "committed", manifest))
    records.sort(key=lambda r: (r.committed, r.order, r.tag))
    return records


def newest_tag(root_url: str, *, storage_options: Any = None) -> str | None:
    """The validated content of ``{root}/newest``, or ``None``."""
    fs, root_path = open_root(root_url, storage_options)
    return read_newest(fs, root_path)

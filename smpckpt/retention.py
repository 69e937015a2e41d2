"""Retention: which partial checkpoints to keep (a pure policy) and applying it (rank 0 only).

The policy works on :class:`CheckpointRecord` values and touches no filesystem, so it is unit-tested
on its own. :func:`apply_retention` scans the root, asks the policy and deletes, tolerating failures.

Rules (issue 4):

* only **committed** partial checkpoints count and are ever deleted; an uncommitted folder may be a
  save in progress (or debris a human should look at) and is left alone;
* the ``keep`` newest committed ones (by save time) stay;
* the tag ``newest`` names is never deleted, even if clocks made it look old;
* a failed delete is logged and the rest continue; it never fails the save that triggered it.

``keep=1`` is allowed (torchtitan forbids it because its purge may run while the new checkpoint is
still being written); here deletion starts only after the new checkpoint committed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Sequence
from typing import Any

from smpckpt.catalog import CheckpointRecord, scan_root
from smpckpt.storage import remove_checkpoint

__all__ = ["KeepLatestN", "select_for_removal", "apply_retention", "RetentionResult", "validate_keep"]

log = logging.getLogger(__name__)


def validate_keep(keep: Any, what: str = "num_kept_partial_checkpoints") -> int | None:
    """``None`` (keep everything) or a positive int; anything else raises :class:`ValueError`."""
    if keep is None:
        return None
    if isinstance(keep, bool) or not isinstance(keep, int):
        raise ValueError(f"{what} must be a positive int or None, got {keep!r}")
    if keep < 1:
        raise ValueError(f"{what} must be >= 1 (it counts the checkpoints kept, the new one included), got {keep}")
    return keep


@dataclasses.dataclass(frozen=True)
class KeepLatestN:
    """Keep the ``n`` newest committed checkpoints and every protected tag; keep uncommitted ones."""

    n: int

    def __post_init__(self) -> None:
        validate_keep(self.n, "KeepLatestN.n")

    def should_preserve(self, records: Sequence[CheckpointRecord], protected: Collection[str] = ()) -> list[bool]:
        """One bool per record (same order): ``True`` = keep."""
        committed = sorted(
            (i for i, r in enumerate(records) if r.committed), key=lambda i: records[i].order, reverse=True
        )
        newest = set(committed[: self.n])
        return [
            (not r.committed) or i in newest or r.tag in protected
            for i, r in enumerate(records)
        ]


def select_for_removal(records: Sequence[CheckpointRecord], keep: int, protected: Collection[str] = ()) -> list[str]:
    """Tags to delete, oldest first."""
    preserve = KeepLatestN(keep).should_preserve(records, protected)
    doomed = [r for r, p in zip(records, preserve) if not p]
    return [r.tag for r in sorted(doomed, key=lambda r: r.order)]


@dataclasses.dataclass(frozen=True)
class RetentionResult:
    removed: tuple[str, ...]
    failed: tuple[str, ...]  #: tags whose removal raised (logged); retried by the next save


def apply_retention(
    root_url: str,
    keep: int,
    *,
    storage_options: Any = None,
    protected: Collection[str] = (),
    dry_run: bool = False,
) -> RetentionResult:
    """(rank 0 only) Delete the committed partial checkpoints beyond the ``keep`` newest.

    Each removal deletes the manifest first (see :func:`smpckpt.storage.remove_checkpoint`), so an
    interrupted removal leaves an uncommitted folder that readers refuse, never a half-deleted
    "committed" one.
    """
    records = scan_root(root_url, storage_options=storage_options)
    doomed = select_for_removal(records, keep, protected)
    removed: list[str] = []
    failed: list[str] = []
    by_tag = {r.tag: r for r in records}
    for tag in doomed:
        if dry_run:
            removed.append(tag)
            continue
        try:
            remove_checkpoint(by_tag[tag].url, storage_options)
            removed.append(tag)
            log.info("retention: removed checkpoint %s", by_tag[tag].url)
        except Exception as exc:  # noqa: BLE001 - a failed delete must not fail the save
            failed.append(tag)
            log.warning("retention: could not remove %s (will retry on the next save): %s", by_tag[tag].url, exc)
    return RetentionResult(tuple(removed), tuple(failed))

"""The root's copy of what roll-backs abandoned (``{path}/smpckpt.abandoned``, beside ``newest``): written by
the first save carrying a new range, read by retention, ``prune``, ``ls`` and the resume's fallback when its save
is numbered above every committed checkpoint (its manifest, which held the record, lost). The record itself, the
history and sequence numbers are :mod:`smpckpt.catalog.root`'s (README, "The Checkpointer"). Retention's choice
(:func:`select_for_removal`): the history's newest kept, what a roll-back abandoned never counted."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from smpckpt.catalog.root import (
    ABANDONED_KEY,
    ABANDONED_NAME,
    SEQUENCE_KEY,
    CheckpointRecord,
    Ranges,
    abandoned_of,
    join_url,
    open_root,
    sequence_of,
    validate_keep,
)
from smpckpt.errors import CheckpointError
from smpckpt.storage import write_bytes_atomic
from smpckpt.storage.backends._fs import translate_errors

__all__ = ["write_abandoned", "read_abandoned", "decided_by_copy", "KeepLatestN", "select_for_removal", "split_lineage"]
__all__ += ["lineage", "warn_kept"]
log = logging.getLogger("smpckpt.catalog.retention")  # root.py's: logging configured for it applies

_MAX_BYTES = 4096  #: the copy is a small JSON object; more is not ours and is not read whole


def split_lineage(
    records: Sequence[CheckpointRecord], abandoned: Ranges = ()
) -> tuple[list[CheckpointRecord], list[CheckpointRecord]]:
    """The committed records, newest first: ``(history, abandoned)``. The newest heads the history; an older
    one is abandoned when a newer member (or ``abandoned``) records its number so; unrecorded: history."""
    ranges, history, dropped = set(abandoned), [], []  # a set: a carried range counts once (rev60c F4)
    for r in sorted((r for r in records if r.committed), key=lambda r: r.order, reverse=True):
        if any(lo <= r.order[0] <= hi for lo, hi in ranges):
            dropped.append(r)
        else:
            history.append(r)
            ranges.update(p for p in abandoned_of(r.extra) if p[1] < r.order[0])  # a save abandons only numbers below
    return history, dropped


def write_abandoned(root: str, storage_options: Any, tag: str, extra: Mapping[str, Any]) -> None:
    """(rank 0, before ``newest`` names ``tag``) The root's copy of the record, when it lacks its newest range."""
    seq, ranges = sequence_of(extra), abandoned_of(extra)
    if ranges and ranges[0] not in abandoned_of(_root_copy(root, storage_options)):
        fs, root_path = open_root(root, storage_options)
        body = json.dumps({"tag": tag, SEQUENCE_KEY: seq, ABANDONED_KEY: [list(r) for r in ranges]}).encode()
        write_bytes_atomic(fs, join_url(root_path, ABANDONED_NAME), body)


def decided_by_copy(records: Sequence[CheckpointRecord], copy: Ranges) -> bool:
    """Whether the root's copy's ranges (:func:`read_abandoned`) drop a checkpoint the saves' own records
    keep: only then do the fallback's refusal and ``ls`` name the file (rev60d F3)."""
    if not copy:
        return False
    alone = {r.tag for r in split_lineage(records)[1]}
    return any(r.tag not in alone for r in split_lineage(records, copy)[1])


def read_abandoned(root: str, storage_options: Any, records: Sequence[CheckpointRecord]) -> tuple[tuple[int, int], ...]:
    """(rank 0) The root's copy's ranges, when its save is numbered above every committed one of ``records``
    (damaged, its manifest lost); retention, ``prune``, ``ls`` and the fallback call it alike."""
    top, body = max((r.order[0] for r in records if r.committed), default=0), _root_copy(root, storage_options)
    return tuple(p for p in abandoned_of(body) if p[1] < sequence_of(body)) if sequence_of(body) > top else ()


def lineage(
    root: str, storage_options: Any, records: Sequence[CheckpointRecord]
) -> tuple[Ranges, list[CheckpointRecord], list[CheckpointRecord], str | None]:
    """(rank 0) ``(the root's copy's ranges, history, abandoned)`` of :func:`split_lineage` with the root's copy, and
    the copy's URL when it decided (:func:`decided_by_copy`; else ``None``): the fallback and ``ls`` name it."""
    copy = read_abandoned(root, storage_options, records)
    history, dropped = split_lineage(records, copy)
    return copy, history, dropped, f"{root.rstrip('/')}/{ABANDONED_NAME}" if decided_by_copy(records, copy) else None


def _root_copy(root: str, storage_options: Any) -> dict[str, Any]:
    try:  # the root's smpckpt.abandoned; empty when missing or unreadable
        fs, root_path = open_root(root, storage_options)
        with translate_errors(path := join_url(root_path, ABANDONED_NAME)):
            body = json.loads(fs.cat_file(path, start=0, end=_MAX_BYTES))
    except (OSError, CheckpointError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


@dataclasses.dataclass(frozen=True)
class KeepLatestN:
    """Keep the ``n`` newest committed checkpoints and every protected tag; keep uncommitted ones."""

    n: int

    def __post_init__(self) -> None:
        validate_keep(self.n, "KeepLatestN.n")

    def should_preserve(
        self, records: Sequence[CheckpointRecord], protected: Collection[str] = (), abandoned: Ranges = ()
    ) -> list[bool]:
        """One bool per record (same order): ``True`` = keep. Only the history counts (:func:`split_lineage`,
        with the root's copy ``abandoned``); what a roll-back abandoned is kept, never counted."""
        history, dropped = split_lineage(records, abandoned)
        kept = {id(r) for r in (*history[: self.n], *dropped)}
        return [(not r.committed) or id(r) in kept or r.tag in protected for r in records]


def select_for_removal(
    records: Sequence[CheckpointRecord], keep: int, protected: Collection[str] = (), abandoned: Ranges = ()
) -> list[str]:
    """Tags to delete, the oldest first."""
    preserve = KeepLatestN(keep).should_preserve(records, protected, abandoned)
    return [r.tag for r in sorted((r for r, p in zip(records, preserve) if not p), key=lambda r: r.order)]


def warn_kept(root: str, committed: Sequence[CheckpointRecord]) -> None:
    """A job that resumed none of ``root``'s ``committed`` checkpoints (another job's or run's, oldest first)
    keeps them as abandoned (``SequenceCounter``): said once, at its first save."""
    bare = [r.tag for r in committed if not r.order[0]]  # no number: no range can mark them (rev69c 6)
    log.warning(
        "%s holds %d checkpoint(s) of another job or run (the newest %r, sequence %d) and this job resumed "
        "none: the numbered ones are kept as abandoned, never counted nor removed by retention (a job still "
        "saving there is refused at its next save; remove them by hand once settled)%s",
        *(root, len(committed), committed[-1].tag, committed[-1].order[0]),
        f"; {bare[:5]} carry no sequence number (older versions, convert's outputs): they count as this "
        "job's oldest and retention removes them: move them away first to keep them"
        if bare
        else "",
    )

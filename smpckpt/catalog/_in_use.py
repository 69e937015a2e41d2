"""The refusal of a save or a tag-less resume while another job saves into the root (README, "The Checkpointer":
a second job saving into the root), imported only when one is refused: its history and numbers are
:mod:`smpckpt.catalog.root`'s (:class:`~smpckpt.catalog.root.SequenceCounter`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from smpckpt.errors import RootInUse

if TYPE_CHECKING:
    from smpckpt.catalog.root import CheckpointRecord

__all__ = ["refused"]


def refused(root: str, theirs: CheckpointRecord, tag: str, seq: int, what: str = "save", late: str = "") -> RootInUse:
    """The error refusing ``what`` ("save" or "resume") into ``root``: ``theirs`` committed after this job's last
    save ``tag`` (sequence ``seq``); ``late``: the tag the job resumed, ``theirs`` the late save of the job it replaced."""
    why = (
        "nothing applied (it would take that job's state as this job's): pass tag= to take it deliberately, "
        f"or the tag of this job's own (its last save, {tag!r}, if that one committed)"
        if what == "resume"
        else "nothing written (its retention would remove that job's checkpoints, and a tag-less resume take "
        "the other's state): give each job its own path"
    )
    head = f"another job is saving into {root}: its"
    head = f"the job this one replaced (it resumed {late!r}): its late" if late else head
    return RootInUse(
        f"{head} checkpoint {theirs.tag!r} (sequence {theirs.order[0]}) "
        f"committed after this job's last save {tag or '(none)'!r} (sequence {seq}); this {what} is refused, {why}"
        + (f" (or tag={late!r}, the one it resumed)" if late else "")
    )

"""Resume internals: choosing the checkpoint (rank 0), the key-aware load planner, decoding user_content."""

from __future__ import annotations

import dataclasses
import io
import logging
import pickle
import re
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from smpckpt._args import RNG_PREFIX, USER_CONTENT
from smpckpt.catalog import scan_root
from smpckpt.errors import CheckpointCorrupt, CheckpointNotFound, LayoutMismatch, SpecError, UnsafeCheckpoint
from smpckpt.layout import ParallelLayout
from smpckpt.planners import ParallelLoadPlanner
from smpckpt.storage import probe_checkpoint
from smpckpt.tags import open_root, partial_url, read_newest

log = logging.getLogger("smpckpt.api")


@dataclasses.dataclass(frozen=True)
class Target:
    tag: str
    url: str
    extra: Mapping[str, Any]
    fell_back: bool


def resolve_target(root: str, tag: str | None, storage_options: Any) -> Target | None:
    """(rank 0) The committed checkpoint to resume; ``None`` when nothing committed exists.

    With ``tag=None``: the tag ``newest`` names, unless a checkpoint committed *after* it exists --
    a job killed between a commit and the ``newest`` update -- or ``newest`` is unusable; then the
    newest committed tag, with a warning. So a restarted job never replays steps into a tag that
    is already committed.
    """
    if tag is not None:
        url = partial_url(root, tag)
        found = probe_checkpoint(url, storage_options)
        if found.manifest is None:
            if found.state == "missing":
                return None
            raise CheckpointNotFound(
                f"checkpoint {tag!r} at {url} is {found.state}: it has no commit marker (a failed or running save)"
                if found.state == "uncommitted"
                else f"checkpoint {tag!r} at {url} was not written by smpckpt ({found.state}); load it with dcp.load"
            )
        return Target(tag, url, found.manifest.extra, False)
    fs, root_path = open_root(root, storage_options)
    newest = read_newest(fs, root_path)
    records = scan_root(root, storage_options=storage_options)
    committed = [r for r in records if r.committed]
    if not committed:
        return None
    latest = max(committed, key=lambda r: r.order)
    named = next((r for r in committed if r.tag == newest), None)
    if named is not None and named.order >= latest.order:
        return Target(named.tag, named.url, named.extra, False)
    if named is not None:
        reason = (
            f"{root}/newest names {newest!r}, but {latest.tag!r} was committed after it (the job probably "
            "stopped between that commit and the update of 'newest')"
        )
    elif newest is None:
        reason = f"{root}/newest is missing or unreadable"
    else:
        state = next((r.state for r in records if r.tag == newest), "missing")
        reason = f"{root}/newest names {newest!r}, which is not a committed checkpoint ({state})"
    message = f"{reason}; resuming from the newest committed checkpoint {latest.tag!r}"
    log.warning(message)
    warnings.warn(message, stacklevel=3)
    return Target(latest.tag, latest.url, latest.extra, True)


class ApiLoadPlanner(ParallelLoadPlanner):
    """ParallelLoadPlanner whose key checks know our own keys.

    RNG keys and absent parts (no model/optimizer passed) are optional; everything else is strict
    (unless ``strict=False``), checked before any data is read, so a refused load leaves the model
    untouched.
    """

    def __init__(self, *args: Any, strict: bool, ignore_unexpected: re.Pattern[str], **kwargs: Any) -> None:
        super().__init__(*args, allow_partial_load=True, **kwargs)
        self.strict = strict
        self.ignore_unexpected = ignore_unexpected
        self.real_missing: tuple[str, ...] = ()
        self.real_unexpected: tuple[str, ...] = ()

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()
        report = self.report
        missing = tuple(k for k in (report.missing_keys if report else ()) if not optional_key(k))
        if missing and self.strict:
            raise LayoutMismatch(
                f"rank {self.rank}: {len(missing)} key(s) of the model/optimizer are not in the checkpoint: "
                f"{', '.join(missing[:20])}{' ...' if len(missing) > 20 else ''} (strict=False skips them)"
            )
        self.real_missing = missing
        return plan

    def create_global_plan(self, global_plan: Any) -> Any:
        plans = super().create_global_plan(global_plan)
        report = self.report
        unexpected = tuple(
            k for k in (report.unexpected_keys if report else ()) if not self.ignore_unexpected.match(k)
        )
        if unexpected and self.strict:
            raise LayoutMismatch(
                f"{len(unexpected)} checkpoint key(s) are loaded by no rank: {', '.join(unexpected[:20])}"
                f"{' ...' if len(unexpected) > 20 else ''}: the model or layout does not match the checkpoint "
                "(strict=False ignores them)"
            )
        self.real_unexpected = unexpected
        return plans


def optional_key(key: str) -> bool:
    return key.startswith(RNG_PREFIX) or key == USER_CONTENT


def saved_layout(extra: Mapping[str, Any]) -> ParallelLayout | None:
    record = extra.get("layout")
    if not isinstance(record, Mapping):
        return None
    try:
        return ParallelLayout.from_dict(record)
    except (KeyError, TypeError, ValueError, SpecError):
        return None


def decode_user_content(value: Any, missing: bool, allow_pickle: bool) -> Any:
    if missing or value is None or value == b"":
        return None
    if not isinstance(value, (bytes, bytearray)):
        raise CheckpointCorrupt(f"user_content is stored as {type(value).__name__}, expected bytes")
    try:
        return torch.load(io.BytesIO(value), weights_only=not allow_pickle)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpoint(
            f"user_content needs arbitrary code to unpickle ({exc}); pass allow_pickle=True only if you trust "
            "this checkpoint"
        ) from exc

"""What every ``smpckpt`` command shares: storage options, sizes, layouts, resolving ``PATH/TAG``."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from smpckpt.catalog.root import NEWEST_NAME, PARTIAL_SUFFIX, open_root
from smpckpt.errors import CheckpointError
from smpckpt.model.layout import LayoutRecord
from smpckpt.storage import checkpoint_state
from smpckpt.storage.backends._fs import translate_errors

__all__ = ["ENV_OPTIONS", "UsageError", "storage_options_arg", "human", "layout_text", "layout_json"]
__all__ += ["resolve_checkpoint_url", "check_root"]

ENV_OPTIONS = "SMPCKPT_STORAGE_OPTIONS"


class UsageError(Exception):
    pass


def storage_options_arg(text: str | None) -> dict[str, Any]:
    raw = text if text is not None else os.environ.get(ENV_OPTIONS)
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise UsageError(f"storage options are not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise UsageError("storage options must be a JSON object")
    return value


def human(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def layout_text(record: Any) -> str:
    if not isinstance(record, Mapping):
        return "-"
    text = f"tp={record.get('tp')} pp={record.get('pp')} dp={record.get('dp')}"
    if record.get("pp_layers"):
        text += f" pp_layers={list(record['pp_layers'])}"
    return text


def layout_json(manifest: Any) -> dict[str, Any] | None:
    try:
        record = LayoutRecord.from_manifest(manifest)
    except CheckpointError:
        return None
    return record.layout.to_dict() if record is not None else None


def resolve_checkpoint_url(spec: str, storage_options: Mapping[str, Any]) -> str:
    """``PATH/TAG`` -> ``PATH/TAG_partial`` when that exists; else ``spec`` itself (a checkpoint folder)."""
    spec = spec.rstrip("/") or spec
    if not spec.endswith(PARTIAL_SUFFIX):
        candidate = spec + PARTIAL_SUFFIX
        if checkpoint_state(candidate, storage_options) != "missing":
            return candidate
    return spec


def check_root(path: str, storage_options: Mapping[str, Any]) -> None:
    """``smpckpt ls`` lists a root: a file (``ROOT/newest``) or a checkpoint (its folder, or ``ROOT/TAG``)
    given instead is refused, saying what to run, rather than listed as an empty root."""
    fs, fpath = open_root(path, storage_options)  # the location itself first (an s3:// without a bucket)
    spec = path.rstrip("/")
    if not spec or spec.endswith(":"):  # "/" or a bare scheme: nothing to strip
        spec = path
    parent, _, name = spec.rpartition("/")
    parent = parent or "."
    with translate_errors(fpath):
        is_file = fs.isfile(fpath)
    if is_file:
        what = "the file naming the root's newest checkpoint" if name == NEWEST_NAME else "a file"
        raise UsageError(f"{spec} is {what}, not a checkpoint root: `smpckpt ls {parent}` lists that root")
    candidates = [spec] if spec.endswith(PARTIAL_SUFFIX) else [spec, spec + PARTIAL_SUFFIX]
    for candidate in candidates:
        try:
            state = checkpoint_state(candidate, storage_options)
        except CheckpointError:
            state = "committed"  # a damaged checkpoint folder is a checkpoint folder all the same
        if state in ("committed", "legacy"):
            tag = spec.rsplit("/", 1)[-1].removesuffix(PARTIAL_SUFFIX)
            raise UsageError(
                f"{candidate} is a checkpoint, not a root of checkpoints: `smpckpt inspect {parent}/{tag}` shows "
                f"it, `smpckpt ls {parent}` lists it with the others"
            )
        if candidate == spec and state != "missing":
            return  # a folder of its own: a root (ROOT/TAG_partial is asked about only when ROOT/TAG is not one)

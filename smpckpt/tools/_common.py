"""What every ``smpckpt`` command shares: storage options, sizes, layouts, resolving ``PATH/TAG``."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from smpckpt.catalog.tags import PARTIAL_SUFFIX
from smpckpt.errors import CheckpointError
from smpckpt.model.record import LayoutRecord
from smpckpt.storage import checkpoint_state

__all__ = [
    "ENV_OPTIONS",
    "UsageError",
    "storage_options_arg",
    "human",
    "layout_text",
    "layout_json",
    "resolve_checkpoint_url",
]

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

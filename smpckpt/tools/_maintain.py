"""The ``smpckpt`` commands that change storage: ``prune`` and ``convert``."""

from __future__ import annotations

import argparse
import dataclasses
from types import MappingProxyType
from typing import TextIO

from smpckpt.catalog.root import apply_retention, newest_tag, validate_keep
from smpckpt.hf import TRANSLATIONS as _FAMILIES
from smpckpt.tools._common import UsageError, human, resolve_checkpoint_url

__all__ = ["cmd_prune", "cmd_convert", "cmd_consolidate", "duration", "DTYPES", "TRANSLATIONS"]

DTYPES = MappingProxyType(
    {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
)
#: ``--translation`` choices: HF ``config.model_type`` of every family in :mod:`smpckpt.hf`
TRANSLATIONS = tuple(sorted(_FAMILIES))

_DURATION_UNITS = MappingProxyType({"s": 1, "m": 60, "h": 3600, "d": 86400})


def duration(text: str) -> float:
    """``"90"``, ``"90s"``, ``"30m"``, ``"6h"``, ``"2d"`` -> seconds."""
    text = text.strip().lower()
    unit = _DURATION_UNITS.get(text[-1:], None)
    number = text[:-1] if unit is not None else text
    try:
        value = float(number) * (unit or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (use e.g. 90s, 30m, 6h, 2d)") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"duration must be >= 0, got {text!r}")
    return value


def cmd_prune(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    if args.keep is None and args.uncommitted_older_than is None:
        raise UsageError("give --keep N, --uncommitted-older-than AGE, or both")
    try:
        keep = validate_keep(args.keep, "--keep")
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    newest = newest_tag(args.path, storage_options=args.storage_options)
    result = apply_retention(
        args.path,
        keep,
        storage_options=args.storage_options,
        protected={newest} if newest else set(),
        dry_run=args.dry_run,
        uncommitted_older_than=args.uncommitted_older_than,
    )
    verb = "would remove" if args.dry_run else "removed"
    out.writelines(f"{verb} {tag}\n" for tag in result.removed)
    out.writelines(f"{verb} {tag} (uncommitted, stale)\n" for tag in result.removed_uncommitted)
    out.writelines(f"aborted multipart upload {key}\n" for key in result.aborted_uploads)
    out.writelines(f"{verb} {path} (debris of a killed save)\n" for path in result.removed_debris)
    err.writelines(f"could not remove {tag}\n" for tag in result.failed)
    if not any(dataclasses.astuple(result)):  # every field is a tuple of what was done
        out.write("nothing to remove\n")
    return 1 if result.failed else 0


def cmd_convert(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from smpckpt.tools.convert import convert_checkpoint

    src = resolve_checkpoint_url(args.checkpoint, args.storage_options)
    report = convert_checkpoint(
        src,
        args.out,
        to=args.to,
        keep_view_shapes=args.keep_view_shapes,
        storage_options=args.storage_options,
        out_storage_options=args.storage_options,
        allow_pickle=args.allow_pickle,
        overwrite=args.overwrite,
    )
    out.write(
        f"wrote {report['out']} ({args.to}): {report['tensors']} tensors, {human(report['bytes'])}, "
        f"{report['objects']} objects\n"
    )
    if report["reshaped"]:
        out.write(f"original shapes restored for: {', '.join(report['reshaped'])}\n")
    return 0


def cmd_consolidate(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    import json
    import pathlib

    import torch

    from smpckpt.tools.consolidate import consolidate_checkpoint

    src = resolve_checkpoint_url(args.checkpoint, args.storage_options)
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    translation = _FAMILIES[args.translation] if args.translation else None
    hf_config = json.loads(pathlib.Path(args.hf_config).read_text(encoding="utf-8")) if args.hf_config else None
    report = consolidate_checkpoint(
        src,
        args.out,
        include_optimizer=args.include_optimizer,
        dtype=dtype,
        max_shard_size=args.max_shard_size,
        translation=translation,
        hf_config=hf_config,
        storage_options=args.storage_options,
        progress=not args.no_progress,
        format=args.format,
    )
    out.write(
        f"wrote {report['out']}: {report['tensors']} tensors, {human(report['bytes'])} in "
        f"{', '.join(report['files'])}\n"
    )
    return 0

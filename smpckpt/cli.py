"""``smpckpt`` command line: ``ls``, ``inspect``, ``verify``, ``prune``, ``convert`` (also ``python -m smpckpt``).

Every command takes local paths and URLs (``s3://bucket/run``). fsspec options come from
``--storage-options '{"key": ..., "client_kwargs": {"endpoint_url": ...}}'`` or, when that is not
given, from the ``SMPCKPT_STORAGE_OPTIONS`` environment variable (same JSON); S3 endpoints also follow
botocore's own ``AWS_ENDPOINT_URL``.

``PATH/TAG`` (inspect, verify) is a checkpoint root plus a tag and resolves to ``PATH/TAG_partial``;
the checkpoint folder itself is accepted too.

Exit status: 0 success; 1 a problem was found (verify) or the command failed; 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from tqdm import tqdm

from smpckpt.catalog import newest_tag, scan_root
from smpckpt.errors import CheckpointError
from smpckpt.record import LayoutRecord
from smpckpt.retention import apply_retention, validate_keep
from smpckpt.storage import FsspecStorageReader, checkpoint_state, verify_checkpoint
from smpckpt.tags import PARTIAL_SUFFIX

__all__ = ["main", "build_parser", "resolve_checkpoint_url"]

_ENV_OPTIONS = "SMPCKPT_STORAGE_OPTIONS"
#: ``--progress auto`` draws a bar for checkpoints at least this large.
_PROGRESS_MIN_BYTES = 256 << 20


class _UsageError(Exception):
    pass


def _storage_options(text: str | None) -> dict[str, Any]:
    raw = text if text is not None else os.environ.get(_ENV_OPTIONS)
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise _UsageError(f"storage options are not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise _UsageError("storage options must be a JSON object")
    return value


def _human(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def _layout_text(record: Any) -> str:
    if not isinstance(record, Mapping):
        return "-"
    text = f"tp={record.get('tp')} pp={record.get('pp')} dp={record.get('dp')}"
    if record.get("pp_layers"):
        text += f" pp_layers={list(record['pp_layers'])}"
    return text


def _layout_json(manifest: Any) -> dict[str, Any] | None:
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


# -- commands ----------------------------------------------------------------------------------------
def _cmd_ls(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    options = _storage_options(args.storage_options)
    records = scan_root(args.path, storage_options=options)
    newest = newest_tag(args.path, storage_options=options)
    rows: list[dict[str, Any]] = []
    for r in records:
        rows.append(
            {
                "tag": r.tag,
                "state": r.state,
                "newest": r.tag == newest,
                "size": r.size,
                "layout": _layout_json(r.manifest),
                "saved_at": r.extra.get("saved_at") or (r.manifest.created if r.manifest is not None else None),
                "detail": r.detail,
            }
        )
    if args.json:
        json.dump({"path": args.path, "newest": newest, "checkpoints": rows}, out, indent=1)
        out.write("\n")
        return 0
    if not rows:
        out.write(f"no partial checkpoints under {args.path}\n")
        return 0
    header = ("", "TAG", "STATE", "SIZE", "LAYOUT", "SAVED")
    table: list[tuple[str, ...]] = [header] + [
        (
            "*" if row["newest"] else "",
            row["tag"],
            row["state"],
            _human(row["size"]),
            _layout_text(row["layout"]),
            row["saved_at"] or "-",
        )
        for row in rows
    ]
    widths = [max(len(str(line[i])) for line in table) for i in range(len(header))]
    for line in table:
        out.write("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() + "\n")
    for r in records:
        if r.state in ("unsafe", "corrupt", "unreadable"):
            out.write(f"warning: {r.tag} is {r.state}: {r.detail}\n")
    if newest is None:
        out.write("(no valid 'newest' file)\n")
    elif newest not in {r.tag for r in records if r.committed}:
        out.write(f"warning: 'newest' names {newest!r}, which is not a committed checkpoint\n")
    return 0


def _cmd_inspect(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    options = _storage_options(args.storage_options)
    url = resolve_checkpoint_url(args.checkpoint, options)
    reader = FsspecStorageReader(url, storage_options=options)
    metadata = reader.read_metadata()
    extra: Mapping[str, Any] = reader.manifest.extra if reader.manifest is not None else {}
    record = LayoutRecord.from_manifest(reader.manifest) or LayoutRecord.from_metadata(metadata)
    world_size = reader.manifest.world_size if reader.manifest is not None else None
    tensors: list[dict[str, Any]] = []
    objects: list[str] = []
    for key, md in sorted(metadata.state_dict_metadata.items()):
        if not isinstance(md, TensorStorageMetadata):
            objects.append(key)
            continue
        size, dtype = md.size, md.properties.dtype
        tensors.append(
            {
                "key": key,
                "shape": [int(s) for s in size],
                "dtype": str(dtype).replace("torch.", ""),
                "chunks": len(md.chunks),
                "bytes": math.prod(size) * dtype.itemsize,
            }
        )
    tensor_bytes = sum(int(t["bytes"]) for t in tensors)
    info: dict[str, Any] = {
        "checkpoint": url,
        "state": reader.state,
        "tag": extra.get("tag"),
        "layout": record.layout.to_dict() if record is not None else None,
        "saved_at": extra.get("saved_at"),
        "world_size": world_size,
        "user_content_keys": extra.get("user_content_keys"),
        "user_content_type": extra.get("user_content_type"),
        "tensors": tensors,
        "objects": objects,
        "tensor_bytes": tensor_bytes,
    }
    if args.json:
        json.dump(info, out, indent=1)
        out.write("\n")
        return 0
    out.write(f"checkpoint: {url} ({reader.state})\n")
    if extra:
        out.write(f"tag: {extra.get('tag')}  saved: {extra.get('saved_at')}  world size: {world_size}\n")
        out.write(f"layout: {_layout_text(info['layout'])}\n")
        keys = extra.get("user_content_keys")
        out.write(
            f"user content: {', '.join(keys) if keys else '(none)'}"
            f"{'' if keys is not None else ' [' + str(extra.get('user_content_type')) + ']'}\n"
        )
    width = max([len(t["key"]) for t in tensors] + [3])
    out.write(f"{'KEY'.ljust(width)}  {'SHAPE':<18}  {'DTYPE':<9}  {'CHUNKS':>6}  BYTES\n")
    for t in tensors:
        shape = "[" + ", ".join(map(str, t["shape"])) + "]"
        out.write(f"{t['key'].ljust(width)}  {shape:<18}  {t['dtype']:<9}  {t['chunks']:>6}  {t['bytes']}\n")
    out.write(f"{len(tensors)} tensors, {_human(tensor_bytes)}; {len(objects)} objects\n")
    return 0


class _ProgressBar:
    """A tqdm byte bar on ``stream`` (``--progress``: auto draws it for large checkpoints only)."""

    def __init__(self, stream: TextIO, mode: str) -> None:
        self.stream = stream
        self.mode = mode
        self._bar: tqdm | None = None

    def __call__(self, done: int, total: int) -> None:
        if self.mode == "never" or (self.mode == "auto" and total < _PROGRESS_MIN_BYTES):
            return
        if self._bar is None:
            self._bar = tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc="verify",
                file=self.stream,
                mininterval=0.1,
                dynamic_ncols=True,
            )
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _cmd_verify(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    options = _storage_options(args.storage_options)
    url = resolve_checkpoint_url(args.checkpoint, options)
    bar = _ProgressBar(err, args.progress)
    try:
        report = verify_checkpoint(url, options, progress=bar)
    finally:
        bar.close()
    for warning in report.warnings:
        err.write(f"warning: {warning}\n")
    if report.ok:
        kind = "checksums verified" if report.checksummed else "legacy checkpoint: sizes only, no checksums"
        out.write(f"OK {url}: {report.files_checked} files, {_human(report.bytes_checked)} ({kind})\n")
        return 0
    err.write(f"FAILED {url}: {len(report.problems)} problem(s)\n")
    for problem in report.problems:
        err.write(f"  {problem}\n")
    return 1


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _duration(text: str) -> float:
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


def _cmd_prune(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    options = _storage_options(args.storage_options)
    if args.keep is None and args.uncommitted_older_than is None:
        raise _UsageError("give --keep N, --uncommitted-older-than AGE, or both")
    try:
        keep = validate_keep(args.keep, "--keep")
    except ValueError as exc:
        raise _UsageError(str(exc)) from exc
    newest = newest_tag(args.path, storage_options=options)
    result = apply_retention(
        args.path,
        keep,
        storage_options=options,
        protected={newest} if newest else set(),
        dry_run=args.dry_run,
        uncommitted_older_than=args.uncommitted_older_than,
    )
    verb = "would remove" if args.dry_run else "removed"
    for tag in result.removed:
        out.write(f"{verb} {tag}\n")
    for tag in result.removed_uncommitted:
        out.write(f"{verb} {tag} (uncommitted, stale)\n")
    for key in result.aborted_uploads:
        out.write(f"aborted multipart upload {key}\n")
    for tag in result.failed:
        err.write(f"could not remove {tag}\n")
    if not (result.removed or result.removed_uncommitted or result.aborted_uploads or result.failed):
        out.write("nothing to remove\n")
    return 1 if result.failed else 0


def _cmd_convert(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from smpckpt.convert import convert_checkpoint

    options = _storage_options(args.storage_options)
    src = resolve_checkpoint_url(args.checkpoint, options)
    report = convert_checkpoint(
        src,
        args.out,
        to=args.to,
        keep_view_shapes=args.keep_view_shapes,
        storage_options=options,
        out_storage_options=options,
        allow_pickle=args.allow_pickle,
        overwrite=args.overwrite,
    )
    out.write(
        f"wrote {report['out']} ({args.to}): {report['tensors']} tensors, {_human(report['bytes'])}, "
        f"{report['objects']} objects\n"
    )
    if report["reshaped"]:
        out.write(f"original shapes restored for: {', '.join(report['reshaped'])}\n")
    return 0


# -- entry point -----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="smpckpt", description="Inspect and maintain smpckpt checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--storage-options",
        metavar="JSON",
        default=None,
        help=f"fsspec storage options as JSON (default: ${_ENV_OPTIONS})",
    )

    p = sub.add_parser("ls", parents=[common], help="list the tags under a checkpoint root")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_ls)

    p = sub.add_parser("inspect", parents=[common], help="tensors, shapes, dtypes, chunks of one checkpoint")
    p.add_argument("checkpoint", metavar="PATH/TAG")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("verify", parents=[common], help="check completeness and every checksum")
    p.add_argument("checkpoint", metavar="PATH/TAG")
    p.add_argument(
        "--progress",
        choices=("auto", "always", "never"),
        default="auto",
        help=f"progress bar on stderr (auto: checkpoints of {_human(_PROGRESS_MIN_BYTES)} or more)",
    )
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser(
        "prune",
        parents=[common],
        help="keep the N newest committed partial checkpoints; remove stale debris of failed saves",
    )
    p.add_argument("path")
    p.add_argument("--keep", type=int, default=None, metavar="N", help="committed checkpoints to keep (N >= 1)")
    p.add_argument(
        "--uncommitted-older-than",
        type=_duration,
        default=None,
        metavar="AGE",
        help="also remove uncommitted folders with no write for AGE (e.g. 6h; make it longer than any save) "
        "and abort S3 multipart uploads started that long ago",
    )
    p.add_argument("--dry-run", action="store_true", help="print what would be removed")
    p.set_defaults(func=_cmd_prune)
    p = sub.add_parser(
        "convert",
        parents=[common],
        help="export a checkpoint for stock tools: one torch.save file, or a stock-readable DCP folder",
    )
    p.add_argument("checkpoint", metavar="PATH/TAG")
    p.add_argument("out", metavar="OUT")
    p.add_argument("--to", choices=("torch_save", "dcp"), default="torch_save", help="output format")
    p.add_argument("--keep-view-shapes", action="store_true", help="keep fused views in their stored shape")
    p.add_argument("--allow-pickle", action="store_true", help="objects that need code to load (trusted only)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT")
    p.set_defaults(func=_cmd_convert)
    return parser


def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Run the CLI; returns the exit status (the console script exits with it)."""
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args, out, err))
    except BrokenPipeError:
        # the reader went away (`smpckpt inspect ... | head`): stop quietly, like any Unix tool
        _silence_stdout(out)
        return 0
    except _UsageError as exc:
        err.write(f"smpckpt {args.command}: {exc}\n")
        return 2
    except (CheckpointError, OSError, ValueError, ImportError) as exc:
        err.write(f"smpckpt {args.command}: {type(exc).__name__}: {exc}\n")
        return 1


def _silence_stdout(out: TextIO) -> None:
    """Point the closed stdout at /dev/null so the interpreter's final flush does not complain."""
    if out is not sys.stdout:
        return
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _console() -> None:  # pragma: no cover - thin wrapper
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    _console()

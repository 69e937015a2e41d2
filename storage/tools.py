"""Checkpoint-level helpers for the API and CLI layers: state, manifest, verification, removal."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import _validate_global_plan
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from smpckpt.errors import CheckpointCorrupt, CheckpointError, CheckpointNotFound
from smpckpt.storage.backends._fs import is_local, join, open_fs, read_bytes_or_none, translate_errors
from smpckpt.storage.format._checksum import hash_rows
from smpckpt.storage.format.commit import generation_gone, remove_folder
from smpckpt.storage.format.manifest import (  # the two openers by URL live with the probe they wrap
    MANIFEST_NAME,
    METADATA_NAME,
    REMOVING_NAME,
    CheckpointState,
    FileRecord,
    Manifest,
    check_member_name,
    probe,
    probe_checkpoint,
    read_manifest,
)
from smpckpt.storage.read._fetch import unit_rows, unit_text

__all__ = ["checkpoint_state", "probe_checkpoint", "read_manifest", "verify_checkpoint", "VerifyReport"]
__all__ += ["remove_checkpoint", "last_activity", "abort_stale_uploads", "removal_marked", "load_problems"]
__all__ += ["file_times"]

_READ_CHUNK = 16 << 20


def checkpoint_state(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> CheckpointState:
    """``"committed"`` (manifest present), ``"uncommitted"`` (files but no manifest: a failed or
    running save), ``"legacy"`` (a stock DCP checkpoint: ``.metadata``, no manifest) or ``"missing"``."""
    return probe_checkpoint(url, storage_options).state


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """Result of :func:`verify_checkpoint`. ``ok`` is true when ``problems`` is empty.

    ``warnings`` are findings that do not make the checkpoint unusable by smpckpt: a missing or stale
    stock ``.metadata`` copy (a crash between the commit and that copy leaves one; stock DCP readers
    then cannot load the checkpoint, or would load the previous generation).
    """

    url: str
    state: CheckpointState
    files_checked: int
    bytes_checked: int
    problems: tuple[str, ...]
    checksummed: bool  # False for legacy checkpoints (sizes/references only)
    warnings: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_if_failed(self) -> None:
        if self.problems:
            raise CheckpointCorrupt(f"{self.url}: " + "; ".join(self.problems[:10]))


def verify_checkpoint(
    url: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Check every file of a committed checkpoint (presence, size, every block checksum), the manifest's
    own checksum, everything a load checks before reading (:func:`load_problems`), and (as a warning) that
    the stock ``.metadata`` copy equals the committed generation's metadata. A legacy (stock DCP)
    checkpoint's referenced files are checked for presence and size only. ``progress(done_bytes,
    total_bytes)`` is called as bytes are checked. Raises :class:`~smpckpt.errors.CheckpointNotFound`
    when there is no checkpoint to verify."""
    url = os.fspath(url)
    fs, path = open_fs(url, storage_options)
    try:
        found = probe(fs, path)
    except CheckpointCorrupt as exc:
        # the manifest itself is damaged (its own checksum covers its file list, digests and extra)
        return VerifyReport(url, "committed", 1, 0, (str(exc),), True)
    if found.state in ("missing", "uncommitted"):
        raise CheckpointNotFound(f"{url}: nothing committed to verify (state: {found.state}) {found.detail}".rstrip())
    problems: list[str] = []
    if found.manifest is None:
        return _verify_legacy(fs, path, url, found.legacy_metadata, progress)
    manifest: Manifest = found.manifest
    total = manifest.total_bytes
    md = read_bytes_or_none(fs, join(path, manifest.metadata.name))
    if md is None:
        problems.append(f"{manifest.metadata.name}: missing")
    elif not manifest.metadata.matches(md):
        problems.append(f"{manifest.metadata.name}: size or checksum differs from the manifest")
    # the stock .metadata copy of a partial checkpoint missing or stale: a warning, not an error (a crash
    # between the commit and that copy leaves exactly this, and smpckpt still loads it); a full artifact
    # is read by safetensors/transformers, not by stock DCP: it has no stock copy
    stock = None if manifest.kind == "full" else read_bytes_or_none(fs, join(path, METADATA_NAME))
    warnings = []
    if manifest.kind != "full" and stock is None:
        warnings.append(f"{METADATA_NAME}: missing (stock DCP readers cannot load this checkpoint; smpckpt can)")
    elif stock is not None and not manifest.metadata.matches(stock):
        warnings.append(
            f"{METADATA_NAME}: differs from the committed {manifest.metadata.name} (stock DCP readers would "
            "load another generation or fail)"
        )
    count = _Count(manifest.metadata.size, total, progress)
    count.report()
    for rec in manifest.files:
        fpath = join(path, rec.name)
        size = _size(fs, fpath)
        if size != rec.size:
            problems.append(f"{rec.name}: " + ("missing" if size is None else f"size {size}, manifest says {rec.size}"))
            count.done += rec.size
            continue
        try:
            check_blocks(fs, fpath, rec, rec.name, problems, count.tick)
        except FileNotFoundError:
            # gone since its size was read: S3 reads a file in several ranged GETs, and a removal or overwrite
            # landing between two made the next a 404 that escaped raw, as damage (rev73e 1); missing now, and
            # generation_gone below tells a removal from a deletion by hand
            problems.append(f"{rec.name}: missing")
        count.report()
    if not problems:
        # what a load would refuse before reading (records, files, chunks; a full artifact's HF index),
        # then a full artifact's safetensors files (they have no block list: their bytes are counted there)
        problems += load_problems(url, fs, path, manifest, storage_options, count.tick)
        count.report()
    # a generation another save replaced, or a removal took, while this verify read it is no damage: said so,
    # as a load says it, not reported as files missing (hunt73b); files deleted by hand stay problems
    if problems and (gone := generation_gone(fs, path, url, manifest, "verify")) is not None:
        raise gone
    return VerifyReport(url, "committed", len(manifest.files) + 1, count.done, tuple(problems), True, tuple(warnings))


class _Count:
    """``verify_checkpoint``'s bytes checked so far, passed to ``progress`` every 16 check units and on
    :meth:`report` (a unit is a block, a row group of tiles, or a full artifact's header or tensor box)."""

    __slots__ = ("done", "total", "units", "progress")

    def __init__(self, done: int, total: int, progress: Callable[[int, int], None] | None) -> None:
        self.done, self.total, self.units, self.progress = done, total, 0, progress

    def tick(self, nbytes: int) -> None:
        self.done, self.units = self.done + nbytes, self.units + 1
        if self.progress and self.units % 16 == 0:
            self.progress(self.done, self.total)

    def report(self) -> None:
        if self.progress:
            self.progress(self.done, self.total)


def check_blocks(
    fs: Any,
    fpath: str,
    rec: FileRecord,
    where: str,
    problems: list[str],
    tick: Callable[[int], None],
    *,
    copy_to: Callable[[memoryview], None] | None = None,
    reserve: Callable[[int], None] | None = None,
) -> bool:
    """Every block checksum of the data file ``rec`` at ``fpath``: a problem per mismatch (``where`` names
    the file), ``tick(bytes)`` after each unit read; ``True`` when all match. ``copy_to`` (the fast
    tier's drain) is given the file's bytes in order, each run only once all its blocks matched, as a
    view it may keep; the first mismatch ends the check. ``reserve(bytes)`` before each read (the
    drain's memory budget: it may wait there)."""
    ok = True
    with translate_errors(fpath), fs.open(fpath, "rb", block_size=_READ_CHUNK, cache_type="none") as f:
        # consecutive units (a block, or a row group of tiles) are read together, up to _READ_CHUNK a
        # request: a request per unit made small-unit checkpoints slow on object stores
        for first, last, units in _unit_batches(rec, _READ_CHUNK):
            if reserve is not None:
                reserve(last - first)
            f.seek(first)
            data = memoryview(f.read(last - first))
            if len(data) != last - first:  # the file shrank since its size was checked
                problems.append(f"{where}: bytes {first}..{last} came back short ({len(data)} bytes)")
                return False
            for start, end, blocks in units:
                for i in blocks:
                    unit = unit_rows(rec, i)  # (first, rows, run, stride): a tile's rows hashed at once
                    if hash_rows(data, unit[0] - first, *unit[1:]) != rec.block_digests[i]:
                        ok = False
                        problems.append(f"{where}: checksum mismatch in {unit_text(i, *unit)}")
                tick(end - start)
            if copy_to is not None:
                if not ok:
                    return False
                copy_to(data)
            # let go of this read before the next is made (one read per file held, not two: the drain's
            # budget gives a read back once written)
            del data
    return ok


def _unit_batches(rec: FileRecord, limit: int) -> Iterator[tuple[int, int, list[tuple[int, int, range]]]]:
    """``rec``'s check units as ``(first byte, end, units)`` runs of adjacent units of at most ``limit``
    bytes (a unit larger than ``limit`` alone)."""
    batch: list[tuple[int, int, range]] = []
    for unit in rec.unit_ranges():
        if batch and (unit[0] != batch[-1][1] or unit[1] - batch[0][0] > limit):
            yield batch[0][0], batch[-1][1], batch
            batch = []
        batch.append(unit)
    if batch:
        yield batch[0][0], batch[-1][1], batch


def _size(fs: Any, fpath: str) -> int | None:
    """The size of file ``fpath``; ``None`` when it is missing."""
    try:
        with translate_errors(fpath):
            return int(fs.size(fpath))
    except FileNotFoundError:
        return None


def _verify_legacy(
    fs: Any, path: str, url: str, metadata: Any, progress: Callable[[int, int], None] | None
) -> VerifyReport:
    needed: dict[str, int] = {}
    problems: list[str] = []
    for index, info in (metadata.storage_data or {}).items():
        name = check_member_name(getattr(info, "relative_path", None), where=f"{url}/.metadata")
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0):
            problems.append(
                f"{name}: record of {getattr(index, 'fqn', index)!r} has offset {offset!r}, length {length!r}"
            )
            continue
        needed[name] = max(needed.get(name, 0), offset + length)
    total = sum(needed.values())
    done = 0
    for name, end in sorted(needed.items()):
        size = _size(fs, join(path, name))
        if size is None or size < end:
            problems.append(f"{name}: " + ("missing" if size is None else f"{size} bytes, records need {end}"))
        done += end
        if progress:
            progress(done, total)
    return VerifyReport(url, "legacy", len(needed), total, tuple(problems), False)


def remove_checkpoint(
    url: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    missing_ok: bool = True,
    uncommitted_only: bool = False,
) -> bool:
    """Delete a checkpoint folder (``storage.format.commit.remove_folder``): marked first, the manifest
    next (an interrupted removal leaves an uncommitted folder, never a committed one with files missing),
    then exactly what it finds (never a glob), never following a link (POSIX). ``uncommitted_only``: a
    folder found committed after the mark is left as it is (``False`` returned). Raises :class:`OSError`
    naming what could not be removed."""
    fs, path = open_fs(url, storage_options)
    try:
        failed = remove_folder(fs, path, os.fspath(url), uncommitted_only=uncommitted_only)
    except FileNotFoundError:
        if not missing_ok:
            raise CheckpointNotFound(f"no checkpoint at {os.fspath(url)}") from None
        return True
    if failed:
        raise OSError(f"could not remove {len(failed)} path(s) of {os.fspath(url)}: {failed[:5]}")
    return not (uncommitted_only and read_bytes_or_none(fs, join(path, MANIFEST_NAME)) is not None)


def _mtime(info: Mapping[str, Any]) -> float | None:
    """Modification time (epoch seconds) from an fsspec listing entry, on any backend."""
    for key in ("mtime", "LastModified", "last_modified", "created"):
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, datetime.datetime):
            if value.tzinfo is None:
                value = value.replace(tzinfo=datetime.timezone.utc)
            return value.timestamp()
        try:
            return float(value)
        except (TypeError, ValueError):
            continue
    return None


def _s3_uploads(fs: Any, path: str) -> list[dict[str, Any]]:
    """Open multipart uploads whose key lies under ``path`` (S3 only; ``[]`` elsewhere)."""
    if not any(p in ("s3", "s3a") for p in ((fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol)):
        return []
    bucket, _, prefix = path.partition("/")
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    uploads: list[dict[str, Any]] = []
    kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
    for _ in range(10_000):  # bounded paging
        with translate_errors(path):
            page = fs.call_s3("list_multipart_uploads", **kwargs)
        uploads.extend(page.get("Uploads", []))
        if not page.get("IsTruncated"):
            break
        kwargs.update(KeyMarker=page.get("NextKeyMarker"), UploadIdMarker=page.get("NextUploadIdMarker"))
    return uploads


def removal_marked(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> bool:
    """Whether an interrupted :func:`remove_checkpoint` left this folder (its marker is there)."""
    fs, path = open_fs(url, storage_options)
    with translate_errors(path):
        fs.invalidate_cache(path)  # s3fs answers from a cached listing of the folder, however old
        return bool(fs.exists(join(path, REMOVING_NAME)))


def last_activity(
    url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None, uploads: Any = None
) -> float | None:
    """The newest modification time (epoch seconds) of anything under a checkpoint folder: its files, on
    local disk its folders' own times when it holds no file (a save that made them and wrote no file yet
    is active; not otherwise: a removal that failed midway bumps them, and must stay stale to be retried,
    rev62j F1), and, on S3, the start of any multipart upload still open there. ``None`` when nothing is
    there (on S3 also a prefix holding no object: it has no time of its own). ``uploads``: the open multipart
    uploads of a root above (``_s3_uploads``), listed once for its many folders."""
    fs, path = open_fs(url, storage_options)
    prefix = path.partition("/")[2].rstrip("/") + "/"
    mine = _s3_uploads(fs, path) if uploads is None else [u for u in uploads if str(u["Key"]).startswith(prefix)]
    uploads = (_mtime({"created": upload.get("Initiated")}) for upload in mine)
    files = list(file_times(fs, path).values())
    empty = not files and is_local(fs)
    folders = [_folder_mtime(d) for d, _, _ in os.walk(fs._strip_protocol(path))] if empty else []
    found = [*files, *uploads, *folders]
    return max([t for t in found if t is not None], default=None)


def _folder_mtime(path: str) -> float | None:
    try:
        return os.lstat(path).st_mtime  # a linked tag folder: the link's own time, not its target's
    except OSError:  # removed while walked
        return None


def file_times(fs: Any, path: str) -> dict[str, float]:
    """Relative name -> modification time (epoch seconds) of every file under the folder ``path``."""
    base = str(fs._strip_protocol(path)).rstrip("/") + "/"
    try:
        with translate_errors(path):
            found = fs.find(path, detail=True)
    except FileNotFoundError:
        return {}
    out = {}
    for p, info in found.items():
        t = _mtime(info)
        if str(p).startswith(base) and info.get("type") != "directory" and t is not None:
            out[str(p)[len(base) :]] = t
    return out


def abort_stale_uploads(
    url: str | os.PathLike[str],
    older_than_s: float,
    storage_options: Mapping[str, Any] | None = None,
    uploads: Any = None,
) -> list[str]:
    """Abort S3 multipart uploads under ``url`` started more than ``older_than_s`` seconds ago (they are
    left by killed saves and billed until aborted). Returns their keys; a no-op on other backends.
    ``uploads``: those under ``url`` as listed already (``_s3_uploads``)."""
    fs, path = open_fs(url, storage_options)
    bucket = path.partition("/")[0]
    now = time.time()
    aborted: list[str] = []
    for upload in _s3_uploads(fs, path) if uploads is None else uploads:
        started = _mtime({"created": upload.get("Initiated")})
        if started is None or now - started < older_than_s:
            continue
        try:
            with translate_errors(f"{bucket}/{upload['Key']}"):
                fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
        except FileNotFoundError:  # completed or aborted since ``uploads`` were listed (NoSuchUpload): gone
            continue
        aborted.append(f"{bucket}/{upload['Key']}")
    return aborted


_SHOWN = 20
_HF_INDEXES = ("model.safetensors.index.json", "optimizer.safetensors.index.json", "pytorch_model.bin.index.json")


def load_problems(
    url: str,
    fs: Any,
    path: str,
    manifest: Manifest,
    storage_options: Mapping[str, Any] | None,
    tick: Callable[[int], None] | None = None,
) -> list[str]:
    """What a load of this committed checkpoint would refuse (as messages; empty when nothing): checksums
    say nothing of a metadata that a resealed manifest vouches for but no loader accepts. Runs the
    reader's own metadata checks and plans a read of every chunk and object of every key without reading
    tensor data; for a full artifact, checks the Hugging Face index (which transformers follows), then,
    with ``tick``, every header and tensor box its metadata lists (``tick(bytes)`` after each)."""
    from smpckpt.storage.read.reader import FsspecStorageReader

    reader = FsspecStorageReader(url, storage_options=storage_options, verify_checksums=False)
    try:
        metadata = reader.read_metadata()
        reader.set_up_storage_reader(metadata, True)
    except CheckpointError as exc:
        return [str(exc)]
    if manifest.kind == "full":
        # its Hugging Face index (what from_pretrained follows) names only the artifact's own listed files: a
        # resealed index pointing elsewhere would load other weights without our reader
        listed = {f.name for f in manifest.files}
        problems = []
        for name in (n for n in _HF_INDEXES if n in listed):
            data = read_bytes_or_none(fs, join(path, name))
            try:
                weight_map = json.loads(data or b"")["weight_map"]
                files = {check_member_name(v, where=name) for v in weight_map.values()}
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError, CheckpointError) as exc:
                problems.append(f"{name}: malformed or unsafe: {exc}")
                continue
            if unlisted := sorted(files - listed):
                problems.append(f"{name}: names files the manifest does not list: {unlisted[:5]}")
        if problems or not tick or not reader.source:
            return problems
        try:
            return reader.source.verify_all(tick)
        except CheckpointCorrupt as exc:
            # a file gone (or cut short) between its GETs (rev73e 1): a problem, so verify asks whether a
            # removal or an overwrite took it rather than raising it as damage
            return [str(exc)]
    problems = [str(e) for e in _validate_global_plan([None, None], metadata)]  # type: ignore[list-item]
    for fqn, md in metadata.state_dict_metadata.items():
        # a read of every stored piece of the key, as a load plans them
        reads = []
        if isinstance(md, BytesStorageMetadata):
            index = MetadataIndex(fqn)
            reads = [ReadItem(LoadItemType.BYTE_IO, index, torch.Size([0]), index, torch.Size([0]), torch.Size([0]))]
        for chunk in md.chunks if isinstance(md, TensorStorageMetadata) else ():
            index, zeros = MetadataIndex(fqn, chunk.offsets), torch.Size([0] * len(chunk.sizes))
            reads.append(ReadItem(LoadItemType.TENSOR, index, zeros, index, zeros, chunk.sizes))
        for req in reads:
            try:
                reader._item(req)  # the reader's own checks: name, listed file, range, chunk metadata
            except CheckpointError as exc:
                problems.append(str(exc))
                break  # one message per key
        if len(problems) >= _SHOWN:
            break
    return problems

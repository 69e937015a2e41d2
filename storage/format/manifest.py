"""A checkpoint folder's files: their names (pure functions, no I/O), the JSON manifest that commits them,
and what a folder holds. A committed checkpoint folder holds::

    <folder>/smpckpt.manifest.json          # commit marker, written last (JSON, below)
    <folder>/.metadata                      # pickled DCP Metadata (stock readers look here)
    <folder>/.metadata.<save_id>            # the same bytes under a per-generation name (our reader)
    <folder>/[<prefix>/]<e4>_r<rank>_<n>.<save_id>.smp.distcp   # data files, one generation per save

``<e4>`` (four hex characters of a hash of the file's identity) spreads object-store keys over key
prefixes; ``<prefix>/`` is a prefix strategy's optional folder (``backends/_fs.py``), part of the name.

The manifest is written last by the coordinator, after every rank's data and the metadata are durable:
its presence makes a checkpoint committed. Layout (``format_version`` 1, or 2 when a file has tilings)::

    {
      "format": "smpckpt", "format_version": 1 | 2,
      "kind": "partial" | "full",        # full: one consolidated safetensors artifact (see storage/full/_plan.py)
      "save_id": "18c1f...", "created": "2026-11-21T20:54:00Z", "world_size": 4,
      "data_format": "raw" | "torch_save",
      "checksum": {"algorithm": "xxh3_64"},
      "metadata": {"name": ".metadata.<save_id>", "size": 1972, "xxh3_64": "<16 hex>"},
      "files": [{"name": "...", "size": 123, "rank": 0,
                 "block_ends": "<base64 of little-endian uint64>", "block_digests": "<base64 ...>",
                 "tilings": "<base64 ...>"}],   # optional (version 2): 5 uint64 per tiled tensor
      "extra": {...},                    # caller-supplied JSON (layout, user info)
      "manifest_xxh3_64": "<16 hex>"     # digest of everything above (canonical JSON); see below
    }

``manifest_xxh3_64`` is the digest of the canonical JSON (sorted keys, compact separators) of the object
without that field, so damage to the manifest is not blamed on a data file; older manifests have none.
Block lists are packed (8 bytes per block, base64) to keep large manifests small.

:func:`probe` tells what a folder holds (committed, uncommitted, legacy stock DCP, or missing): a GET of
the manifest; only without one a GET of ``.metadata``; only without both a LIST.
"""

from __future__ import annotations

import base64
import bisect
import dataclasses
import functools
import hashlib
import json
import operator
import os
import re
import secrets
import struct
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

from smpckpt._formats import FORMAT_VERSION, RAW_DESCRIPTOR
from smpckpt.errors import CheckpointCorrupt, CheckpointNotFound, UnsafeCheckpoint
from smpckpt.storage.backends import _fs  # the prefix strategies' folder names: a recorded name may hold them
from smpckpt.storage.backends._folder import is_temp_name  # the names' owner is the folder that makes them
from smpckpt.storage.backends._fs import confine, join, ls_fresh, open_fs, read_bytes_or_none, translate_errors
from smpckpt.storage.format._check_units import MIN_SEGMENT, Tiling
from smpckpt.storage.format._checksum import ALGORITHM, hash_bytes
from smpckpt.storage.format._safe_pickle import load_metadata

__all__ = ["MANIFEST_NAME", "REMOVING_NAME", "WRITING_MARKER", "DESCRIPTION_FQN", "METADATA_NAME", "RAW_DESCRIPTOR"]
__all__ += ["LOAD_ID_PREFIX", "FORMAT_VERSION", "WHOLE_TENSORS", "STAGING_PREFIX", "TRASH_PREFIX", "new_save_id"]
__all__ += ["data_file_name", "generation_metadata_name", "is_smpckpt_file", "check_member_name", "marker_owner"]
__all__ += ["staging_name", "is_staging_name", "is_temp_name", "unfinished_full_save", "FileRecord", "Manifest"]
__all__ += ["MetadataRecord", "CheckpointKind", "DataFormat", "CheckpointState", "Probe", "probe", "probe_checkpoint"]
__all__ += ["read_manifest"]


# -- file names ---------------------------------------------------------------------------------------
MANIFEST_NAME = "smpckpt.manifest.json"
#: Written by remove_checkpoint before it deletes anything: a folder holding it is being (or was
#: partly) removed on purpose, never a save in flight, so a later retention may finish the job.
REMOVING_NAME = "smpckpt.removing"
#: (object stores) Created exclusively by the coordinator before any rank writes a full artifact's
#: fixed-name files, removed after the commit: a folder with it and no manifest is an unfinished save,
#: never a Hugging Face folder. Its body is ``<save id>``. (POSIX full saves write a staging folder
#: instead, :data:`STAGING_PREFIX`; older versions wrote this marker there too.)
WRITING_MARKER = "smpckpt.writing"
#: (POSIX) A full save writes its artifact into ``.smpckpt-staging.<save id>`` beside its target folder and
#: renames it into place at the commit (no replace): a reader of the target never sees an unfinished or
#: mixed artifact. A staging folder left by a killed save is debris for ``prune``; it blocks nothing.
STAGING_PREFIX = ".smpckpt-staging."
#: (POSIX) A removal renames a staging folder to ``.smpckpt-trash.<hex>`` before deleting it (its own
#: name: a commit can no longer publish it); one left by a killed removal is garbage for ``prune``.
TRASH_PREFIX = ".smpckpt-trash."
METADATA_NAME = ".metadata"
#: Key in ``Metadata.storage_data`` under which a full artifact's description (JSON) is stored.
DESCRIPTION_FQN = "\x00smpckpt.full"
#: Set in ``Metadata.planner_data`` (at load time, never stored) by our reader when every tensor is one
#: whole row-major block (full artifacts, Hugging Face folders): a planner may read it in another shape
#: of the same size (a fused ``[3h, d]`` as the view ``[3, h, d]``).
WHOLE_TENSORS = "smpckpt.whole_tensors"
#: Prefix of the ``StorageMeta.load_id`` our reader sets, so a planner can tell it from a stock reader.
LOAD_ID_PREFIX = "smpckpt-"

_DATA_RE = re.compile(r"^(?:[0-9A-Za-z_-]{1,64}/)?[0-9a-f]{4}_r\d+_\d+\.[0-9a-z]+\.smp\.distcp$")
# folder components (each one _PREFIX_RE) a recorded file name may have before its base name: prefix
# strategies (ours, one level; s3torchconnector's, up to two: "<prefix>/epoch_<n>/__0_0.distcp")
_MAX_FOLDERS = 2
_GEN_META_RE = re.compile(r"^\.metadata\.[0-9a-z]+$")
_SAVE_ID_RE = re.compile(r"^[0-9a-z]{8,40}$")


def new_save_id() -> str:
    """A fresh save id: time-ordered (hex milliseconds) then random, lowercase alphanumerics only."""
    return f"{int(time.time() * 1000):x}{secrets.token_hex(4)}"


def check_save_id(save_id: str) -> str:
    if not isinstance(save_id, str) or not _SAVE_ID_RE.match(save_id):
        raise ValueError(f"malformed save id {save_id!r}")
    return save_id


def data_file_name(save_id: str, rank: int, n: int, prefix: str = "") -> str:
    """The recorded name of data file ``n`` of ``rank``: ``[<prefix>/]<e4>_r<rank>_<n>.<save_id>.smp.distcp``."""
    entropy = hashlib.blake2b(f"{save_id}/{rank}/{n}".encode(), digest_size=2).hexdigest()
    name = f"{entropy}_r{rank}_{n}.{check_save_id(save_id)}.smp.distcp"
    return f"{_fs.check_prefix(prefix)}/{name}" if prefix else name


def generation_metadata_name(save_id: str) -> str:
    return f"{METADATA_NAME}.{check_save_id(save_id)}"


def is_smpckpt_file(name: str) -> bool:
    """True for a data or per-generation metadata file written by our writer (recorded name: base name,
    with its prefix folder for data files)."""
    return bool(_DATA_RE.match(name) or _GEN_META_RE.match(name))


def staging_name(save_id: str) -> str:
    """The staging folder of a full save (:data:`STAGING_PREFIX`)."""
    return f"{STAGING_PREFIX}{check_save_id(save_id)}"


def is_staging_name(name: str) -> bool:
    return name.startswith(STAGING_PREFIX) and bool(_SAVE_ID_RE.match(name[len(STAGING_PREFIX) :]))


def unfinished_full_save(names: set[str]) -> bool:
    """Whether a folder's base ``names`` (it has no manifest) are those of an unfinished save of ours: its
    in-progress marker (object stores; older versions on POSIX too), a temporary of that marker (a kill
    between its write and its link), or the mark of an interrupted removal."""
    return bool(names & {WRITING_MARKER, REMOVING_NAME}) or any(
        n.startswith(f"{WRITING_MARKER}.") and is_temp_name(n) for n in names
    )


def marker_owner(data: bytes | None) -> str | None:
    """The save id a :data:`WRITING_MARKER` body names (its first line; markers before the refresh held only it)."""
    if data is None:
        return None
    return data.split(b"\n", 1)[0].decode("utf-8", "replace")


def check_member_name(name: object, *, where: str) -> str:
    """``name`` if it is a plain file name that stays inside its checkpoint folder (up to two prefix folders
    of ``[0-9A-Za-z_-]``: ``3/e1f0_r0_0...``, s3torchconnector's ``0000000000/__0_0.distcp``), else raise
    :class:`~smpckpt.errors.UnsafeCheckpoint` naming ``where``. Every file name read from a checkpoint goes
    through here before anything is read or deleted."""
    base = name
    if isinstance(name, str) and "/" in name:
        *folders, base = name.split("/")
        if len(folders) > _MAX_FOLDERS or not all(_fs._PREFIX_RE.fullmatch(f) for f in folders):
            base = None  # refused below
    ok = (
        isinstance(base, str)
        and isinstance(name, str)
        and 0 < len(base) <= 255
        and len(name) <= 400
        and base not in (".", "..")
        and "/" not in base
        and "\\" not in name
        and (os.sep == "/" or os.sep not in name)
        and not any(ord(c) < 0x20 or ord(c) == 0x7F for c in name)
    )
    if not ok:
        raise UnsafeCheckpoint(
            f"{where}: file name {str(name)[:100]!r} is not a plain name inside the checkpoint folder; "
            "refusing the checkpoint (crafted or corrupt)"
        )
    return name  # type: ignore[return-value]


# -- the manifest -------------------------------------------------------------------------------------
# Digest fields are named after the algorithm (``"xxh3_64"``, ``"manifest_xxh3_64"``): changing
# ALGORITHM is a format change, not a setting.
_MD_DIGEST_KEY = ALGORITHM
_DIGEST_KEY = f"manifest_{ALGORITHM}"
# every top-level field a manifest of format_version <= FORMAT_VERSION may hold
_TOP_KEYS = frozenset(
    {"format", "format_version", "save_id", "kind", "data_format", "checksum", "created", "world_size"}
    | {"metadata", "files", "extra", _DIGEST_KEY}
)


def _self_digest(obj: Mapping[str, Any]) -> int:
    """xxh3-64 of the canonical JSON of the manifest object (without its own digest field)."""
    return hash_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8"))


CheckpointKind = Literal["partial", "full"]
DataFormat = Literal["raw", "torch_save"]


def _pack(values: Sequence[int]) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}Q", *values)).decode("ascii")


def _unpack(text: str) -> tuple[int, ...]:
    raw = base64.b64decode(text.encode("ascii"), validate=True)
    if len(raw) % 8:
        raise ValueError("packed block list length is not a multiple of 8")
    return struct.unpack(f"<{len(raw) // 8}Q", raw)


@dataclasses.dataclass(frozen=True)
class FileRecord:
    """One data file: its size and the end offset and xxh3-64 digest of each check unit ("block").

    A unit inside one of :attr:`tilings` is a tile (see :mod:`._check_units`): its digest covers
    :meth:`spans`, not the range its end offset suggests. Ranges meant for verification are cut with
    :meth:`widen`, which keeps a tiling's row groups whole.
    """

    name: str
    size: int
    rank: int
    block_ends: tuple[int, ...]
    block_digests: tuple[int, ...]
    #: ``"blocks"``: the block lists above cover the file. ``"tensors"``: a full artifact's safetensors
    #: file, written by many ranks at once; its header and every tensor box are checksummed in the
    #: generation's metadata (itself checksummed here), and the block lists are empty.
    checks: Literal["blocks", "tensors"] = "blocks"
    #: tensors checked by tiles (by start offset); ``format_version`` 2
    tilings: tuple[Tiling, ...] = ()

    def __post_init__(self) -> None:
        if len(self.block_ends) != len(self.block_digests):
            raise CheckpointCorrupt(f"manifest entry {self.name}: block ends and digests differ in count")
        if self.checks not in ("blocks", "tensors"):
            raise CheckpointCorrupt(f"manifest entry {self.name}: unknown checks {self.checks!r}")
        if self.checks == "tensors":
            if self.block_ends:
                raise CheckpointCorrupt(f"manifest entry {self.name}: tensor-checked file with block list")
        elif (self.block_ends and self.block_ends[-1] != self.size) or (not self.block_ends and self.size):
            raise CheckpointCorrupt(f"manifest entry {self.name}: blocks do not cover the file size {self.size}")
        if not all(map(operator.lt, (0,) + self.block_ends, self.block_ends)):  # pairwise, in C
            raise CheckpointCorrupt(f"manifest entry {self.name}: block ends are not increasing")
        # each tiling lies in the file, after the previous one, and the block list holds exactly its tiles
        # (a reader trusts both to find which bytes a tile digest covers)
        prev_end = 0
        for t in self.tilings:
            i = bisect.bisect_right(self.block_ends, t.start)
            # sizes first, from the tiling's numbers alone: listing the tiles of a crafted tiling
            # ([0, 2**40, 2, 2, 1]: 2**40 tiles) would allocate without bound before any comparison
            if t.start < prev_end or t.end > self.size or t.tiles > len(self.block_ends) - i:
                raise CheckpointCorrupt(f"manifest entry {self.name}: tiling {t} does not match its block list")
            if t.segment < MIN_SEGMENT:
                # a tile's digest is over one run per row: rows of a few bytes would make checking cost a
                # hash call per few bytes (a 32 MiB file of 2-byte rows: minutes), where every writer
                # tiles only rows whose segments are at least a page
                raise CheckpointCorrupt(
                    f"manifest entry {self.name}: tiling {t} has row segments of {t.segment} bytes; tiles are "
                    f"written only for segments of at least {MIN_SEGMENT} bytes"
                )
            ends = t.tile_ends()
            if self.block_start(i) != t.start or list(self.block_ends[i : i + len(ends)]) != ends:
                raise CheckpointCorrupt(f"manifest entry {self.name}: tiling {t} does not match its block list")
            prev_end = t.end

    @functools.cached_property
    def _tiling_starts(self) -> list[int]:
        # a reader asks for every item; the tilings never change (frozen)
        return [t.start for t in self.tilings]

    def tiling_at(self, offset: int) -> Tiling | None:
        """The tiling holding file byte ``offset``, if any."""
        if not self.tilings:
            return None
        j = bisect.bisect_right(self._tiling_starts, offset) - 1
        t = self.tilings[j] if j >= 0 else None
        return t if t is not None and t.start <= offset < t.end else None

    def widen(self, start: int, end: int) -> tuple[int, int]:
        """``[start, end)`` widened to whole check units (whole row groups inside a tiling)."""
        if end <= start:
            return start, end
        blocks = self.blocks_covering(start, end)
        lo, hi = self.block_start(blocks[0]), self.block_ends[blocks[-1]]
        if (t := self.tiling_at(start)) is not None:
            lo = t.group_floor(start)
        if (t := self.tiling_at(end - 1)) is not None:
            hi = t.group_ceil(end)
        return lo, hi

    def is_cut(self, offset: int) -> bool:
        """Whether a range may end at ``offset`` and hold whole units (not inside a row group)."""
        t = self.tiling_at(offset)
        return t is None or t.group_floor(offset) == offset

    def unit_ranges(self) -> Iterator[tuple[int, int, range]]:
        """The file in order as ``(start, end, blocks)``: a block, or a row group of tiles, at a time."""
        first = 0
        for i, end in enumerate(self.block_ends):
            if self.is_cut(end):
                yield self.block_start(first), end, range(first, i + 1)
                first = i + 1

    def spans(self, i: int) -> list[tuple[int, int]]:
        """File byte ranges whose bytes, in order, block ``i``'s digest covers."""
        bs, be = self.block_start(i), self.block_ends[i]
        t = self.tiling_at(bs)
        if t is None:
            return [(bs, be)]
        try:
            return t.spans(bs, be)
        except ValueError as exc:
            raise CheckpointCorrupt(f"manifest entry {self.name}: {exc}") from exc

    def block_start(self, i: int) -> int:
        return self.block_ends[i - 1] if i else 0

    def blocks_covering(self, start: int, end: int) -> range:
        """Indices of the blocks that overlap the byte range ``[start, end)``."""
        if end <= start:
            return range(0)
        first = bisect.bisect_right(self.block_ends, start)
        last = bisect.bisect_left(self.block_ends, end)
        return range(first, min(last, len(self.block_ends) - 1) + 1)

    def to_json(self) -> dict[str, Any]:
        obj = {
            "name": self.name,
            "size": self.size,
            "rank": self.rank,
            "block_ends": _pack(self.block_ends),
            "block_digests": _pack(self.block_digests),
        }
        if self.checks != "blocks":
            obj["checks"] = self.checks
        if self.tilings:
            obj["tilings"] = _pack([v for t in self.tilings for v in dataclasses.astuple(t)])
        return obj

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], *, where: str = "manifest") -> FileRecord:
        name = check_member_name(obj["name"], where=where)  # first: a crafted one is UnsafeCheckpoint, whatever else
        size = int(obj["size"])
        if size < 0:
            raise ValueError(f"file {name!r} has a negative size")
        return cls(
            name=name,
            size=size,
            rank=int(obj.get("rank", -1)),
            block_ends=_unpack(obj["block_ends"]),
            block_digests=_unpack(obj["block_digests"]),
            checks=obj.get("checks", "blocks"),
            tilings=_tilings(obj.get("tilings")),
        )


def _tilings(packed: str | None) -> tuple[Tiling, ...]:
    values = _unpack(packed) if packed else ()
    if len(values) % 5:
        raise ValueError("packed tiling list length is not a multiple of 5 values")
    return tuple(Tiling(*values[i : i + 5]) for i in range(0, len(values), 5))


@dataclasses.dataclass(frozen=True)
class MetadataRecord:
    """The per-generation copy of ``.metadata``: name, size and whole-file digest."""

    name: str
    size: int
    digest: int

    def matches(self, data: bytes) -> bool:
        """Whether ``data`` (a copy of the metadata, read back) has the recorded size and digest."""
        return len(data) == self.size and hash_bytes(data) == self.digest


@dataclasses.dataclass(frozen=True)
class Manifest:
    save_id: str
    kind: CheckpointKind
    data_format: DataFormat
    metadata: MetadataRecord
    files: tuple[FileRecord, ...]
    world_size: int
    created: str
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    format_version: int = 0  # 0: the lowest version that describes the files (see FORMAT_VERSION)
    #: blake2b of the bytes it was parsed from (:meth:`from_bytes`'s ``known``); none for one built here
    source_digest: bytes = dataclasses.field(default=b"", compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.format_version:
            object.__setattr__(self, "format_version", 2 if any(f.tilings for f in self.files) else 1)

    @property
    def total_bytes(self) -> int:
        return self.metadata.size + sum(f.size for f in self.files)

    def to_bytes(self) -> bytes:
        obj = {
            "format": "smpckpt",
            "format_version": self.format_version,
            "kind": self.kind,
            "save_id": self.save_id,
            "created": self.created,
            "world_size": self.world_size,
            "data_format": self.data_format,
            "checksum": {"algorithm": ALGORITHM},
            "metadata": {
                "name": self.metadata.name,
                "size": self.metadata.size,
                _MD_DIGEST_KEY: f"{self.metadata.digest:016x}",
            },
            "files": [f.to_json() for f in self.files],
            "extra": dict(self.extra),
        }
        obj[_DIGEST_KEY] = f"{_self_digest(obj):016x}"
        return json.dumps(obj, indent=1, sort_keys=False).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str = "manifest", known: Manifest | None = None) -> Manifest:
        """Parse and validate; any problem is a :class:`CheckpointCorrupt` naming ``where``. ``known``: a manifest
        parsed before (rank 0's, that chose the checkpoint), returned as it is when ``data`` are its very bytes."""
        source_digest = hashlib.blake2b(data, digest_size=32).digest()
        if known is not None and known.source_digest == source_digest:
            return known
        try:
            obj = json.loads(data.decode("utf-8"))
            if not isinstance(obj, dict) or obj.get("format") != "smpckpt":
                raise ValueError("not an smpckpt manifest")
            version = int(obj["format_version"])
            if version > FORMAT_VERSION:
                raise ValueError(
                    f"format_version {version} is newer than this smpckpt understands ({FORMAT_VERSION}); upgrade smpckpt"
                )
            # after the version check: a newer format may digest differently (and add fields)
            unknown = sorted(set(obj) - _TOP_KEYS)
            if unknown:
                # a field this version never writes is damage: one flipped bit in the digest's own name
                # would otherwise read as a manifest from before the digest, and skip the check
                raise ValueError(f"unknown field(s) {unknown[:5]} for format_version {version}")
            if _DIGEST_KEY in obj:
                recorded = obj.pop(_DIGEST_KEY)
                if not isinstance(recorded, str) or int(recorded, 16) != _self_digest(obj):
                    raise CheckpointCorrupt(
                        f"{where} is corrupt: its own checksum does not match its content (the manifest, "
                        "not necessarily the data, was damaged)"
                    )
            if obj["checksum"]["algorithm"] != ALGORITHM:
                raise ValueError(f"unknown checksum algorithm {obj['checksum']['algorithm']!r}")
            kind = obj["kind"]
            if kind not in ("partial", "full"):
                raise ValueError(f"unknown checkpoint kind {kind!r}")
            data_format = obj["data_format"]
            if data_format not in ("raw", "torch_save"):
                raise ValueError(f"unknown data format {data_format!r}")
            md = obj["metadata"]
            files = tuple(FileRecord.from_json(f, where=where) for f in obj["files"])
            if len({f.name for f in files}) != len(files):
                raise ValueError("a data file is listed twice")
            if int(md["size"]) < 0:
                raise ValueError("negative metadata size")
            return cls(
                save_id=str(obj["save_id"]),
                kind=kind,
                data_format=data_format,
                metadata=MetadataRecord(
                    check_member_name(md["name"], where=where), int(md["size"]), int(md[_MD_DIGEST_KEY], 16)
                ),
                files=files,
                world_size=int(obj["world_size"]),
                created=str(obj["created"]),
                extra=obj.get("extra") or {},
                format_version=version,
                source_digest=source_digest,
            )
        except CheckpointCorrupt:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, struct.error, OverflowError, RecursionError) as exc:
            # OverflowError: "size": 1e400 parses as inf; RecursionError: JSON nested thousands deep
            raise CheckpointCorrupt(f"{where} is malformed: {exc}") from exc


CheckpointState = Literal["committed", "uncommitted", "legacy", "missing"]


@dataclasses.dataclass(frozen=True)
class Probe:
    state: CheckpointState
    manifest: Manifest | None = None
    legacy_metadata: Any = None  # DCP Metadata of a stock checkpoint
    detail: str = ""
    #: the manifest's bytes as read (what an overwrite replaces, exactly: ``Folder.replace_if``)
    raw: bytes | None = None
    #: (uncommitted) whether its listing showed a removal mark; ``None``: not listed (``.metadata`` was found)
    marked: bool | None = None

    def generation_files(self) -> list[str]:
        """Base names of the files of the checkpoint found (to remove after an overwrite commits)."""
        if self.manifest is not None:
            return [f.name for f in self.manifest.files] + [self.manifest.metadata.name]
        if self.legacy_metadata is not None:
            names = {
                getattr(info, "relative_path", None) for info in (self.legacy_metadata.storage_data or {}).values()
            }
            # a crafted name must never reach a delete: refuse the checkpoint instead
            return sorted(check_member_name(n, where="legacy .metadata") for n in names)
        return []


def _plain_names(metadata: Any) -> list[str]:
    names = []
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        try:
            names.append(check_member_name(getattr(info, "relative_path", None), where=""))
        except UnsafeCheckpoint:
            continue
    return names


def probe(fs: Any, folder: str, *, list_when_empty: bool = True, known: Manifest | None = None) -> Probe:
    """Classify ``folder``. Raises :class:`~smpckpt.errors.CheckpointCorrupt` for a malformed manifest
    and :class:`~smpckpt.errors.UnsafeCheckpoint` for a ``.metadata`` that needs code to load, or (local
    disk) files reached through a link leading out of the folder: nothing reads or deletes through it.
    ``known``: :meth:`Manifest.from_bytes`'s (the file is read and checked all the same)."""
    where = join(folder, MANIFEST_NAME)
    data = read_bytes_or_none(fs, where)
    if data is not None:
        found = Probe("committed", manifest=Manifest.from_bytes(data, where=where, known=known), raw=data)
        confine(fs, folder, found.generation_files(), where=folder)  # links out of the folder: unsafe
        return found
    md_path = join(folder, METADATA_NAME)
    md_bytes = read_bytes_or_none(fs, md_path)
    if md_bytes is not None:
        metadata = load_metadata(md_bytes, where=md_path)
        if any(  # a .metadata of our files: a save of ours that did not commit
            RAW_DESCRIPTOR in (getattr(info, "transform_descriptors", None) or ())
            or is_smpckpt_file(str(getattr(info, "relative_path", "")))
            for info in (getattr(metadata, "storage_data", None) or {}).values()
        ):
            return Probe("uncommitted", detail=f"{md_path} exists but {MANIFEST_NAME} does not")
        # plain names only: a crafted one is refused where it is read, naming its key
        confine(fs, folder, _plain_names(metadata), where=folder)
        return Probe("legacy", legacy_metadata=metadata)
    if not list_when_empty:
        return Probe("missing")
    try:
        with translate_errors(folder):
            entries = ls_fresh(fs, folder, detail=False)
    except FileNotFoundError:
        entries = []
    except NotADirectoryError:  # a file on the way to it: no folder here (named, not taken for an empty root)
        return Probe("missing", detail="under a file, not a folder")
    # a file lists as itself (not an S3 folder marker ``x/``, an empty folder: uncommitted as before)
    if [str(e) for e in entries] == [folder.rstrip("/")]:
        return Probe("missing", detail="a file, not a checkpoint folder")
    if entries:
        marked = any(str(e).rstrip("/").rsplit("/", 1)[-1] == REMOVING_NAME for e in entries)
        return Probe(
            "uncommitted", detail=f"{len(entries)} file(s) but no {MANIFEST_NAME} and no .metadata", marked=marked
        )
    return Probe("missing")


def probe_checkpoint(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> Probe:
    """State and (when committed) the parsed :class:`Manifest` of a checkpoint folder, in one call.

    Raises :class:`~smpckpt.errors.CheckpointCorrupt` for a malformed manifest and
    :class:`~smpckpt.errors.UnsafeCheckpoint` for a ``.metadata`` or manifest that must not be trusted.
    """
    fs, path = open_fs(url, storage_options)
    return probe(fs, path)


def read_manifest(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> Manifest:
    """The committed :class:`Manifest` (``.extra`` holds what the writer was given).

    Raises :class:`~smpckpt.errors.CheckpointNotFound` when the folder holds no committed checkpoint.
    """
    fs, path = open_fs(url, storage_options)
    found = probe(fs, path, list_when_empty=False)
    if found.manifest is None:
        raise CheckpointNotFound(f"no committed smpckpt checkpoint at {os.fspath(url)} (state: {found.state})")
    return found.manifest

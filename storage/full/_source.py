"""Full (consolidated) artifacts: the layout the coordinator decides (files, every tensor's place, each
rank's boxes) and its description stored in the generation's metadata; the safetensors container, read
and written by hand (no dependency on the ``safetensors`` package); and opening an artifact: where every
tensor's bytes are.

Safetensors layout (https://github.com/huggingface/safetensors): 8 bytes little-endian ``N``, then ``N``
bytes of JSON header, then the data. The header maps each tensor name to ``{"dtype", "shape",
"data_offsets": [begin, end]}`` (offsets relative to the data start) plus an optional
``"__metadata__"`` of string values. We pad the header with spaces so the data starts 8-byte aligned,
as the reference writer does, and lay tensors out back to back, as its reader requires.

A committed full artifact of ours (described in the generation's metadata, checksummed by the manifest)
and a plain Hugging Face folder (no manifest: *unverified*, like a stock DCP checkpoint) both become an
:class:`ArtifactIndex` and a DCP ``Metadata`` with one chunk per tensor, so any load planner reshards
from them; the reads are ``_read``'s.

A Hugging Face folder's tied keys left out (README, "Tied parameters"): :func:`hf_folder_ties`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from smpckpt._gc import gc_paused
from smpckpt.errors import CheckpointCorrupt, LayoutMismatch, SpecError
from smpckpt.hf import TRANSLATIONS, as_is_judge, check_translation
from smpckpt.model.layout import MERGED_KEY, METADATA_KEY, OPTIM_STATE_PREFIX, TIED_KEY, UNREAD_KEY
from smpckpt.model.translation import Cat, Expr, Leaf, Translation
from smpckpt.storage.backends._fs import join, read_bytes_or_none, translate_errors
from smpckpt.storage.format._checksum import hash_bytes
from smpckpt.storage.format.manifest import DESCRIPTION_FQN, FileRecord, check_member_name
from smpckpt.storage.full._units import UnitIndex
from smpckpt.storage.full.options import FullOptions

__all__ = ["FullWrite", "RankFullData", "ArtifactFile", "ArtifactLayout", "Place", "expr_to_json", "expr_from_json"]
__all__ += ["file_pieces_from_json", "leaf_keys", "DTYPE_NAMES", "HeaderEntry", "encode_header", "parse_header"]
__all__ += ["MAX_HEADER", "ArtifactIndex", "StoredTensor", "hf_folder_files", "hf_folder_ties", "HF_INDEX", "HF_SINGLE"]

#: where an artifact tensor is: (artifact, file, start, dtype, shape)
Place = tuple[str, str, int, torch.dtype, tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class FullWrite:
    """One box of an artifact tensor that a rank fills from one of its write items."""

    item: MetadataIndex  # the rank's write item (its chunk)
    key: str  # artifact tensor
    file: str
    start: int  # absolute file offset of the artifact tensor's first byte
    view: tuple[int, ...]
    offsets: tuple[int, ...]  # box in ``view`` coordinates
    sizes: tuple[int, ...]
    perm: tuple[int, ...]  # box.permute(perm) is the chunk's sub-box at dest_offsets
    dest_offsets: tuple[int, ...]
    dtype: torch.dtype  # artifact dtype (after any cast)


@dataclasses.dataclass(frozen=True)
class RankFullData:
    """SavePlan.storage_data of one rank in full mode (sent by the coordinator; never stored)."""

    save_id: str
    rank: int
    writes: tuple[FullWrite, ...]
    objects: tuple[tuple[MetadataIndex, str], ...]  # object items -> their file
    check_block: int
    world: int = 1
    #: gather mode (object stores): every rank's boxes, by rank, and the files (file ``i`` is
    #: owned by rank ``i % world``)
    all_writes: tuple[tuple[int, FullWrite], ...] = ()
    files: tuple[ArtifactFile, ...] = ()
    #: POSIX mode: the row-block swaps (``_exchange.Exchange``) this rank takes part in, global order
    exchanges: tuple[Any, ...] = ()


@dataclasses.dataclass(frozen=True)
class ArtifactFile:
    """One file of an artifact: its non-tensor ``pieces`` (headers) and where each tensor goes."""

    name: str
    pieces: tuple[tuple[int, bytes], ...]  # (offset, bytes), ascending
    size: int
    keys: tuple[str, ...]
    starts: tuple[int, ...]  # each key's first byte


@dataclasses.dataclass(frozen=True)
class ArtifactLayout:
    """What the coordinator decided; turned into the stored description in ``finish``."""

    files: tuple[ArtifactFile, ...]
    tensors: Mapping[str, Place]  # "art/key" -> where
    exprs: Mapping[str, tuple[str, Expr]]  # our fqn -> (artifact, expr over that artifact's keys)
    dtypes: Mapping[str, torch.dtype]  # our fqn -> stored dtype (after any cast)
    objects: Mapping[str, str]  # our fqn -> file
    indexes: Mapping[str, bytes]  # index file name -> JSON

    def names(self, options: FullOptions) -> tuple[str, ...]:
        """The files a full save of this layout writes besides its metadata copy and marker."""
        side = ("config.json",) if options.hf_config_json() is not None else ()
        return (*(f.name for f in self.files), *self.objects.values(), *self.indexes, *side)

    def description(self, checks: Mapping[str, list[list[Any]]]) -> str:
        """The JSON stored in the generation's metadata (read back by :meth:`ArtifactIndex.from_description`)."""
        return json.dumps(
            {
                "version": 1,
                "files": {
                    f.name: {"size": f.size, "pieces": [[o, len(b), f"{hash_bytes(b):016x}"] for o, b in f.pieces]}
                    for f in self.files
                },
                "tensors": {
                    k: {"artifact": a, "file": f, "start": s, "dtype": str(d).removeprefix("torch."), "shape": list(sh)}
                    for k, (a, f, s, d, sh) in self.tensors.items()
                },
                "exprs": {fqn: {"artifact": a, "expr": expr_to_json(e)} for fqn, (a, e) in self.exprs.items()},
                "objects": dict(self.objects),
                "checks": checks,
            },
            separators=(",", ":"),
        )


def expr_to_json(expr: Expr) -> Any:
    if isinstance(expr, Leaf):
        return {
            "leaf": expr.key,
            "view": list(expr.view) if expr.view else None,
            "perm": list(expr.perm) if expr.perm else None,
        }
    return {"cat": expr.dim, "parts": [expr_to_json(p) for p in expr.parts]}


def leaf_keys(expr: Expr) -> list[str]:
    """The keys of the artifact tensors an expression reads, in order."""
    return [expr.key] if isinstance(expr, Leaf) else [k for p in expr.parts for k in leaf_keys(p)]


def file_pieces_from_json(f: dict[str, Any]) -> list[tuple[int, int, int]]:
    """A file's non-tensor byte ranges ``(offset, length, digest)`` (``pieces``, or an old ``header``)."""
    if "pieces" in f:
        return [(int(o), int(n), int(d, 16)) for o, n, d in f["pieces"]]
    return [(0, int(f["header"][0]), int(f["header"][1], 16))]


def expr_from_json(obj: Any) -> Expr:
    if "leaf" in obj:
        view, perm = obj.get("view"), obj.get("perm")
        return Leaf(
            str(obj["leaf"]),
            tuple(int(v) for v in view) if view else None,
            tuple(int(p) for p in perm) if perm else None,
        )
    return Cat(int(obj["cat"]), tuple(expr_from_json(p) for p in obj["parts"]))


DTYPE_NAMES: Mapping[torch.dtype, str] = MappingProxyType({
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.uint16: "U16", torch.uint32: "U32",
    torch.uint64: "U64",
})  # fmt: skip
_BY_NAME = MappingProxyType({v: k for k, v in DTYPE_NAMES.items()})
#: The reference reader refuses headers above 100 MB; so do we, before allocating anything.
MAX_HEADER = 100_000_000


@dataclasses.dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a safetensors file: absolute byte offset of its data in the file."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute file offset
    nbytes: int


def encode_header(
    tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[HeaderEntry]]:
    """The header bytes (length prefix included) for ``tensors`` back to back, and where each lands."""
    obj: dict[str, object] = {}
    if metadata:
        obj["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    pos = 0
    spans = []
    for key, dtype, shape in tensors:
        nbytes = math.prod(shape) * dtype.itemsize
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {key!r}: dtype {dtype} has no safetensors equivalent")
        obj[key] = {
            "dtype": DTYPE_NAMES[dtype],
            "shape": [int(s) for s in shape],
            "data_offsets": [pos, pos + nbytes],
        }
        spans.append((key, dtype, tuple(int(s) for s in shape), pos, nbytes))
        pos += nbytes
    text = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(len(text) + 8) % 8)
    head = struct.pack("<Q", len(text)) + text
    return head, [HeaderEntry(k, d, s, len(head) + p, n) for k, d, s, p, n in spans]


def header_length(prefix: bytes, *, where: str) -> int:
    """The header's total size (length prefix included) from a file's first 8 bytes."""
    if len(prefix) < 8:
        raise CheckpointCorrupt(f"{where}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER:
        raise CheckpointCorrupt(f"{where}: safetensors header of {n} bytes is implausibly large")
    return 8 + n


def parse_header(head: bytes, file_size: int | None, *, where: str) -> tuple[list[HeaderEntry], dict[str, str]]:
    """Entries (file offsets) and ``__metadata__`` of a safetensors header; every offset is checked
    against the file size and the others, so a crafted header fails here, naming the file and key."""
    total = header_length(head, where=where)
    if len(head) < total:
        raise CheckpointCorrupt(f"{where}: safetensors header truncated")
    try:
        obj = json.loads(head[8:total].decode("utf-8"))
        if not isinstance(obj, dict):
            raise ValueError("header is not a JSON object")
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointCorrupt(f"{where}: malformed safetensors header: {type(exc).__name__}: {exc}") from exc
    meta = obj.pop("__metadata__", None) or {}
    entries = []
    for key, spec in obj.items():
        try:
            dtype = _BY_NAME.get(spec["dtype"])
            shape = tuple(int(s) for s in spec["shape"])
            begin, end = (int(x) for x in spec["data_offsets"])
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise CheckpointCorrupt(f"{where}: malformed header entry for tensor {key!r}: {exc}") from exc
        if dtype is None:
            raise CheckpointCorrupt(f"{where} (tensor {key!r}): unknown safetensors dtype {spec['dtype']!r}")
        nbytes = math.prod(shape) * dtype.itemsize
        if any(s < 0 for s in shape) or begin < 0 or end - begin != nbytes:
            raise CheckpointCorrupt(
                f"{where}: tensor {key!r} has shape {list(shape)} ({dtype}) but data_offsets [{begin}, {end}]"
            )
        entries.append(HeaderEntry(str(key), dtype, shape, total + begin, nbytes))
    entries.sort(key=lambda e: e.start)
    prev = total
    for e in entries:
        if e.start < prev:
            raise CheckpointCorrupt(f"{where}: tensor {e.key!r} overlaps the header or another tensor")
        prev = e.start + e.nbytes
    if file_size is not None and prev > file_size:
        raise CheckpointCorrupt(
            f"{where}: tensor data ends at byte {prev}, past the end of the file ({file_size} bytes)"
        )
    return entries, {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}


log = logging.getLogger(__name__)

HF_SINGLE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"

# The description names dtypes as torch does (``ArtifactLayout``), every dtype a file holds: a ``torch_save``
# artifact also holds those safetensors lacks (complex), which must read back as they were written.
_DTYPES = MappingProxyType(
    {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
)


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    file: str
    start: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def hf_folder_files(fs: Any, path: str) -> list[str] | None:
    """The safetensors files of a Hugging Face folder (index first), or ``None`` when it is not one."""
    data = read_bytes_or_none(fs, join(path, HF_INDEX))
    if data is not None:
        try:
            weight_map = json.loads(data)["weight_map"]
            names = sorted({str(v) for v in weight_map.values()})
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise CheckpointCorrupt(f"{join(path, HF_INDEX)}: malformed index: {type(exc).__name__}: {exc}") from exc
        with translate_errors(path):
            single = names != [HF_SINGLE] and fs.exists(join(path, HF_SINGLE))
        if single:
            # save_pretrained re-saving a folder with shards removes only old shards: an earlier unsharded
            # save's file stays, and from_pretrained reads it (it looks for the single file first), while the
            # index names the newer shards -- two saves' weights, and no way to tell which is meant
            raise CheckpointCorrupt(
                f"{path} holds both {HF_SINGLE} and {HF_INDEX} (naming {len(names)} file(s)): two saves' "
                f"weights; transformers' from_pretrained reads {HF_SINGLE}. Remove the stale one(s)"
            )
        return [check_member_name(n, where=join(path, HF_INDEX)) for n in names]
    with translate_errors(path):
        if fs.exists(join(path, HF_SINGLE)):
            return [HF_SINGLE]
    return None


class ArtifactIndex:
    """Where the tensors (and object values) of one full artifact or Hugging Face folder are."""

    def __init__(self, fs: Any, path: str, url: str) -> None:
        self.fs, self.path, self.url = fs, path, url
        self.tensors: dict[str, StoredTensor] = {}  # "artifact/key" -> where
        self.exprs: dict[str, tuple[str, Expr]] = {}  # our fqn -> (artifact, expr)
        self.objects: dict[str, str] = {}
        self.units: dict[str, UnitIndex] = {}
        self.records: dict[str, FileRecord] = {}
        self.headers: dict[str, list[tuple[int, int, int]]] = {}  # file -> its non-tensor byte ranges
        self.shapes: dict[str, dict[str, tuple[int, ...]]] = {}  # artifact -> key -> shape (every read needs them)

    # -- metadata ---------------------------------------------------------------------------------
    def from_description(self, metadata: Metadata, records: Mapping[str, FileRecord]) -> None:
        """A committed full artifact: the description stored with its metadata."""
        raw = (metadata.storage_data or {}).get(MetadataIndex(DESCRIPTION_FQN))
        if not isinstance(raw, str):
            raise CheckpointCorrupt(f"{self.url}: full checkpoint metadata has no artifact description")
        try:
            with gc_paused():  # parse the description: tensors, expressions, objects, check units
                desc = json.loads(raw)
                for key, t in desc["tensors"].items():
                    name = check_member_name(t["file"], where=f"{self.url} (tensor {key!r})")
                    if name not in records:
                        raise CheckpointCorrupt(
                            f"{self.url}: tensor {key!r} lives in {name}, which the manifest does not list"
                        )
                    self.tensors[key] = StoredTensor(
                        name, int(t["start"]), _DTYPES[t["dtype"]], tuple(int(s) for s in t["shape"])
                    )
                for fqn, e in desc["exprs"].items():
                    self.exprs[fqn] = (str(e["artifact"]), expr_from_json(e["expr"]))
                self.objects = {str(k): check_member_name(v, where=self.url) for k, v in desc["objects"].items()}
                for key, units in desc["checks"].items():
                    self.units[key] = UnitIndex.from_rows(units)
                self.headers = {n: file_pieces_from_json(f) for n, f in desc["files"].items()}
        except CheckpointCorrupt:
            raise
        except (ValueError, KeyError, TypeError, IndexError, OverflowError, RecursionError) as exc:
            raise CheckpointCorrupt(f"{self.url}: malformed full artifact description: {exc}") from exc
        self.records = dict(records)
        for key, t in self.tensors.items():
            rec = records[t.file]
            if t.start + math.prod(t.shape) * t.dtype.itemsize > rec.size:
                raise CheckpointCorrupt(f"{join(self.path, t.file)}: tensor {key!r} lies past the end of the file")
            art, _, k = key.partition("/")
            self.shapes.setdefault(art, {})[k] = t.shape

    def from_hf_folder(self, files: Sequence[str], *, translation: Translation | None, prefix: str) -> Metadata:
        """A plain Hugging Face folder: headers only; keys get ``prefix`` (the API's ``"model."``)."""
        art_shapes = self.shapes["model"] = {}
        for name in files:
            path = join(self.path, name)
            with translate_errors(path):
                try:
                    size = int(self.fs.size(path))
                    first = self.fs.cat_file(path, start=0, end=8)
                    head = self.fs.cat_file(path, start=0, end=header_length(first, where=path))
                except FileNotFoundError as exc:
                    raise CheckpointCorrupt(f"{path}: listed in the Hugging Face index but missing") from exc
            entries, _ = parse_header(head, size, where=path)
            self.records[name] = FileRecord(name, size, -1, (), (), checks="tensors")
            for e in entries:
                if e.key in art_shapes:
                    raise CheckpointCorrupt(f"{path}: tensor {e.key!r} appears in two files")
                self.tensors[f"model/{e.key}"] = StoredTensor(name, e.start, e.dtype, e.shape)
                art_shapes[e.key] = e.shape
        sdm: dict[str, Any] = {}
        ours = self._model_entries(sdm, art_shapes, translation, prefix)
        ties = hf_folder_ties(self.fs, self.path, art_shapes, translation)
        data: dict[str, Any] = (
            {TIED_KEY: {prefix + head: prefix + embed for head, embed in ties.items()}} if ties else {}
        )
        if translation is not None:  # a model without specs holds a fused [3, d, d] as [3d, d]
            merged = translation.merged_shapes({k: s for k, (_, s) in ours.items()})
            if merged:
                data[MERGED_KEY] = {prefix + k: list(s) for k, s in merged.items()}
        return Metadata(state_dict_metadata=sdm, storage_data={}, storage_meta=StorageMeta(), planner_data=data)

    def _model_entries(
        self,
        sdm: dict[str, Any],
        art_shapes: Mapping[str, tuple[int, ...]],
        translation: Translation | None,
        prefix: str,
    ) -> dict[str, tuple[Expr, tuple[int, ...]]]:
        """Our keys (``translation`` applied to the artifact's ``model`` keys) into ``self.exprs`` and ``sdm``."""
        if translation is not None:
            try:  # the wrong family's rules would take nothing and leave its fused tensors unread
                check_translation(translation, art_shapes, "artifact")
            except SpecError as exc:
                raise LayoutMismatch(f"{self.url}: {exc}") from exc
            ours = {k: (expr, tuple(shape)) for k, (expr, shape) in translation.from_artifact(art_shapes).items()}
        else:
            ours = {k: (Leaf(k), s) for k, s in art_shapes.items()}
        for key, (expr, shape) in ours.items():
            fqn = prefix + key
            self.exprs[fqn] = ("model", expr)
            dtype = self.tensors[f"model/{leaf_keys(expr)[0]}"].dtype
            tsize = torch.Size(shape)
            sdm[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=dtype), tsize, [ChunkStorageMetadata(torch.Size([0] * len(shape)), tsize)]
            )
        return ours

    def untranslated(self, prefix: str) -> bool:
        """Whether the artifact's model keys are its stored tensors as they are, under ``prefix`` (written
        without a translation, whatever wrote it: the API, consolidate or a FullArtifactWriter)."""
        model = [(fqn, expr) for fqn, (art, expr) in self.exprs.items() if art == "model"]
        return bool(model) and all(fqn.startswith(prefix) and expr == Leaf(fqn[len(prefix) :]) for fqn, expr in model)

    def translate_untranslated(self, metadata: Metadata, translation: Translation, prefix: str) -> None:
        """A committed artifact written without a translation (a model already in Hugging Face names), read
        with ``translation``: its model keys presented under ours, as a Hugging Face folder's are (else the
        translation went unused and our fused keys were "not in the checkpoint"). Its other state (optimizer
        state, keyed by the Hugging Face parameters) is left out, asking for it refused (:data:`UNREAD_KEY`)."""
        art_shapes = self.shapes.get("model", {})
        data = dict(metadata.planner_data) if isinstance(metadata.planner_data, dict) else {}
        judge, renamed = as_is_judge(translation, art_shapes, self.url, prefix)
        if judge is not None and not renamed:  # no rule takes a tensor: read as it is, judged if keys are missing
            metadata.planner_data = {**data, UNREAD_KEY: {"as_is": judge}}
            return
        refuse: dict[str, str] = {}
        for fqn, (art, expr) in list(self.exprs.items()):
            if art != "model":  # under the saved parameters' names, which the translation does not rename
                key = expr.key if isinstance(expr, Leaf) else ""
                at = fqn[: len(fqn) - len(key)] if key and fqn.endswith(key) else fqn
                if at not in refuse:  # the words once per prefix, not per tensor (60k optimizer tensors)
                    refuse[at] = self._unrenamed(art, at, translation)
            del self.exprs[fqn]
            metadata.state_dict_metadata.pop(fqn, None)
            data.pop(fqn, None)
        ours = self._model_entries(metadata.state_dict_metadata, art_shapes, translation, prefix)
        data.update({prefix + k: ("model", k) for k in ours})
        # renamed outside layers only (a head): the layers, read as they are, are judged as above (rev73c 1)
        unread = {"refuse": refuse} if refuse else {}
        if unread or judge is not None:
            data[UNREAD_KEY] = unread | ({"as_is": judge} if judge is not None else {})
        merged = translation.merged_shapes({k: s for k, (_, s) in ours.items()})
        record = data.get(METADATA_KEY)
        if merged and isinstance(record, Mapping):  # the record's shapes before a view are what planners read
            shapes = {**record.get("original_shapes", {}), **{prefix + k: list(s) for k, s in merged.items()}}
            data[METADATA_KEY] = {**record, "original_shapes": shapes}
        elif merged:
            data[MERGED_KEY] = {prefix + k: list(s) for k, s in merged.items()}
        metadata.planner_data = data

    def _unrenamed(self, artifact: str, at: str, translation: Translation) -> str:
        """(error words, kept for a load asking for them) Why an untranslated artifact's ``artifact`` tensors
        under ``at`` are not read through ``translation``, named as what they are."""
        untranslated = f"{self.url}: written without a translate_function"
        if at == OPTIM_STATE_PREFIX:
            return (
                f"{untranslated}, its optimizer state is keyed by the Hugging Face parameter names it was saved "
                f"under, which translate_function ({translation.name}) does not rename (a fused parameter's state "
                "is several tensors, each with its own step): resume the model alone (no optimizer=) with "
                "translate_function, or model and optimizer without translate_function into a model in the "
                "artifact's names"
            )
        return (
            f"{untranslated}, its {artifact!r} artifact holds tensors under {at!r} (not model weights, nor "
            f"optimizer state), which translate_function ({translation.name}) does not rename: read them without "
            "translate_function"
        )


#: a config.json larger than this is not read for its ties (real ones are a few KiB)
_MAX_CONFIG_BYTES = 1 << 20


def _config(fs: Any, path: str) -> dict[str, Any]:
    where = join(path, "config.json")
    try:
        raw = bytes(fs.cat_file(where, start=0, end=_MAX_CONFIG_BYTES + 1))
        if len(raw) > _MAX_CONFIG_BYTES:
            raise ValueError(f"over {_MAX_CONFIG_BYTES} bytes")
        found = json.loads(raw)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as exc:
        log.info("%s: not read for tied weights (%s)", where, exc)
        return {}
    return found if isinstance(found, dict) else {}


def hf_folder_ties(fs: Any, path: str, keys: Iterable[str], translation: Translation | None) -> dict[str, str]:
    """Head -> embedding key for each tied head the folder's ``keys`` lack but whose embedding they hold."""
    config = _config(fs, path)
    if config.get("tie_word_embeddings") is False:
        return {}
    if translation is None:
        translation = TRANSLATIONS.get(str(config.get("model_type")))
        if translation is None:
            return {}
    return translation.missing_ties(keys)

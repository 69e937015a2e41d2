"""Full (consolidated) artifacts and Hugging Face folders, opening: where every tensor's bytes are.

Two sources look alike to a loader: a committed full artifact of ours (its description -- tensor
offsets, our keys' expressions, check units -- lives in the generation's metadata, checksummed by the
manifest) and a plain Hugging Face folder (``model.safetensors`` or an index and shards; no manifest:
*unverified*, like a stock DCP checkpoint). Both become an :class:`ArtifactIndex` and a DCP ``Metadata``
with one chunk per tensor, so any load planner reshards from them into any TP x PP x DP layout; the
reads themselves are ``_read``'s.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
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
from smpckpt.errors import CheckpointCorrupt
from smpckpt.model.record import TIED_KEY
from smpckpt.model.translation import Expr, Leaf, Translation
from smpckpt.storage.backends._errors import translate_errors
from smpckpt.storage.backends._fs import join, read_bytes_or_none
from smpckpt.storage.format._names import DESCRIPTION_FQN, check_member_name
from smpckpt.storage.format.manifest import FileRecord
from smpckpt.storage.full._hf_ties import hf_folder_ties
from smpckpt.storage.full._layout import expr_from_json, file_pieces_from_json, first_leaf
from smpckpt.storage.full._safetensors import DTYPE_NAMES, header_length, parse_header
from smpckpt.storage.full._units import UnitIndex

__all__ = ["ArtifactIndex", "StoredTensor", "hf_folder_files", "HF_INDEX", "HF_SINGLE"]

HF_SINGLE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"

_DTYPES = {str(d).removeprefix("torch."): d for d in DTYPE_NAMES}  # the description names dtypes as torch does


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

    # -- metadata ---------------------------------------------------------------------------------
    def from_description(self, metadata: Metadata, records: Mapping[str, FileRecord]) -> Metadata:
        """A committed full artifact: the description stored with its metadata."""
        raw = (metadata.storage_data or {}).get(MetadataIndex(DESCRIPTION_FQN))
        if not isinstance(raw, str):
            raise CheckpointCorrupt(f"{self.url}: full checkpoint metadata has no artifact description")
        try:
            with gc_paused():
                self._describe(raw, records)
        except CheckpointCorrupt:
            raise
        except (ValueError, KeyError, TypeError, IndexError, OverflowError, RecursionError) as exc:
            raise CheckpointCorrupt(f"{self.url}: malformed full artifact description: {exc}") from exc
        self.records = dict(records)
        for key, t in self.tensors.items():
            rec = records[t.file]
            if t.start + math.prod(t.shape) * t.dtype.itemsize > rec.size:
                raise CheckpointCorrupt(f"{join(self.path, t.file)}: tensor {key!r} lies past the end of the file")
        return metadata

    def _describe(self, raw: str, records: Mapping[str, FileRecord]) -> None:
        """Parse the description (tensors, expressions, objects, check units) into this source."""
        desc = json.loads(raw)
        for key, t in desc["tensors"].items():
            name = check_member_name(t["file"], where=f"{self.url} (tensor {key!r})")
            if name not in records:
                raise CheckpointCorrupt(f"{self.url}: tensor {key!r} lives in {name}, which the manifest does not list")
            self.tensors[key] = StoredTensor(
                name, int(t["start"]), _DTYPES[t["dtype"]], tuple(int(s) for s in t["shape"])
            )
        for fqn, e in desc["exprs"].items():
            self.exprs[fqn] = (str(e["artifact"]), expr_from_json(e["expr"]))
        self.objects = {str(k): check_member_name(v, where=self.url) for k, v in desc["objects"].items()}
        for key, units in desc["checks"].items():
            self.units[key] = UnitIndex.from_rows(units)
        self.headers = {n: file_pieces_from_json(f) for n, f in desc["files"].items()}

    def from_hf_folder(self, files: Sequence[str], *, translation: Translation | None, prefix: str) -> Metadata:
        """A plain Hugging Face folder: headers only; keys get ``prefix`` (the API's ``"model."``)."""
        art_shapes: dict[str, tuple[int, ...]] = {}
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
        if translation is not None:
            ours = {k: (expr, tuple(shape)) for k, (expr, shape) in translation.from_artifact(art_shapes).items()}
        else:
            ours = {k: (Leaf(k), s) for k, s in art_shapes.items()}
        sdm: dict[str, Any] = {}
        for key, (expr, shape) in ours.items():
            fqn = prefix + key
            self.exprs[fqn] = ("model", expr)
            dtype = self.tensors[f"model/{first_leaf(expr)}"].dtype
            tsize = torch.Size(shape)
            sdm[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=dtype), tsize, [ChunkStorageMetadata(torch.Size([0] * len(shape)), tsize)]
            )
        ties = hf_folder_ties(self.fs, self.path, art_shapes, translation)
        tied = {TIED_KEY: {prefix + head: prefix + embed for head, embed in ties.items()}} if ties else {}
        return Metadata(state_dict_metadata=sdm, storage_data={}, storage_meta=StorageMeta(), planner_data=tied)

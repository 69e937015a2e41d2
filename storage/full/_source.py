"""Full (consolidated) artifacts and Hugging Face folders, opening: where every tensor's bytes are.

A committed full artifact of ours (described in the generation's metadata, checksummed by the manifest)
and a plain Hugging Face folder (no manifest: *unverified*, like a stock DCP checkpoint) both become an
:class:`ArtifactIndex` and a DCP ``Metadata`` with one chunk per tensor, so any load planner reshards
from them; the reads are ``_read``'s.

A Hugging Face folder leaves a tied key out (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``):
a model holding the head apart gets its values from the embedding's bytes. Which keys are tied comes
from the load's translation, else from ``config.json``'s ``model_type`` (``"tie_word_embeddings":
false`` ties nothing: :func:`hf_folder_ties`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
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
from smpckpt.hf import check_translation
from smpckpt.model.layout import MERGED_KEY, TIED_KEY
from smpckpt.model.translation import Expr, Leaf, Translation
from smpckpt.storage.backends._fs import join, read_bytes_or_none, translate_errors
from smpckpt.storage.format.manifest import DESCRIPTION_FQN, FileRecord, check_member_name
from smpckpt.storage.full._layout import expr_from_json, file_pieces_from_json, header_length, leaf_keys, parse_header
from smpckpt.storage.full._units import UnitIndex

__all__ = ["ArtifactIndex", "StoredTensor", "hf_folder_files", "hf_folder_ties", "HF_INDEX", "HF_SINGLE"]

log = logging.getLogger(__name__)

HF_SINGLE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"

# The description names dtypes as torch does (``_layout``), every dtype a file holds: a ``torch_save``
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
            try:  # the wrong family's rules would take nothing and leave its fused tensors unread
                check_translation(translation, art_shapes, "artifact")
            except SpecError as exc:
                raise LayoutMismatch(f"{self.url}: {exc}") from exc
            ours = {k: (expr, tuple(shape)) for k, (expr, shape) in translation.from_artifact(art_shapes).items()}
        else:
            ours = {k: (Leaf(k), s) for k, s in art_shapes.items()}
        sdm: dict[str, Any] = {}
        for key, (expr, shape) in ours.items():
            fqn = prefix + key
            self.exprs[fqn] = ("model", expr)
            dtype = self.tensors[f"model/{leaf_keys(expr)[0]}"].dtype
            tsize = torch.Size(shape)
            sdm[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=dtype), tsize, [ChunkStorageMetadata(torch.Size([0] * len(shape)), tsize)]
            )
        ties = hf_folder_ties(self.fs, self.path, art_shapes, translation)
        data: dict[str, Any] = (
            {TIED_KEY: {prefix + head: prefix + embed for head, embed in ties.items()}} if ties else {}
        )
        if translation is not None:  # a model without specs holds a fused [3, d, d] as [3d, d]
            merged = translation.merged_shapes({k: s for k, (_, s) in ours.items()})
            if merged:
                data[MERGED_KEY] = {prefix + k: list(s) for k, s in merged.items()}
        return Metadata(state_dict_metadata=sdm, storage_data={}, storage_meta=StorageMeta(), planner_data=data)


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
        from smpckpt.hf import TRANSLATIONS  # lazily: only folders with a config of a known family

        translation = TRANSLATIONS.get(str(config.get("model_type")))
        if translation is None:
            return {}
    return translation.missing_ties(keys)

"""``verify`` as strict as a load: what the loaders check before reading, checked for every key.

Checksums prove the bytes are the ones written; they say nothing of a metadata that a resealed manifest
vouches for but no loader accepts (a record outside its file, a file the manifest does not list, chunks
that overlap or leave gaps, a chunk without a record). :func:`load_problems` runs the storage reader's
own metadata checks, then plans a read of every chunk and object of every key -- the checks the reader
makes before any byte is read -- without reading tensor data; for a full artifact also the Hugging Face
index, which transformers follows and our reader does not.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import _validate_global_plan
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from smpckpt.errors import CheckpointError
from smpckpt.storage.backends._fs import join, read_bytes_or_none
from smpckpt.storage.format.manifest import Manifest, check_member_name

__all__ = ["load_problems"]

_SHOWN = 20
_HF_INDEXES = ("model.safetensors.index.json", "optimizer.safetensors.index.json", "pytorch_model.bin.index.json")


def load_problems(
    url: str, fs: Any, path: str, manifest: Manifest, storage_options: Mapping[str, Any] | None
) -> list[str]:
    """What a load of this committed checkpoint would refuse (as messages; empty when nothing)."""
    from smpckpt.storage.read.reader import FsspecStorageReader

    reader = FsspecStorageReader(url, storage_options=storage_options, verify_checksums=False)
    try:
        metadata = reader.read_metadata()
        reader.set_up_storage_reader(metadata, True)
    except CheckpointError as exc:
        return [str(exc)]
    if manifest.kind == "full":
        return _hf_index_problems(fs, path, manifest)
    problems = [str(e) for e in _validate_global_plan([None, None], metadata)]  # type: ignore[list-item]
    for fqn, md in metadata.state_dict_metadata.items():
        for req in _reads(fqn, md):
            try:
                reader._item(req)  # the reader's own checks: name, listed file, range, chunk metadata
            except CheckpointError as exc:
                problems.append(str(exc))
                break  # one message per key
        if len(problems) >= _SHOWN:
            break
    return problems


def _reads(fqn: str, md: Any) -> list[ReadItem]:
    """A read of every stored piece of one key, as a load plans them."""
    if isinstance(md, BytesStorageMetadata):
        index = MetadataIndex(fqn)
        return [ReadItem(LoadItemType.BYTE_IO, index, torch.Size([0]), index, torch.Size([0]), torch.Size([0]))]
    if not isinstance(md, TensorStorageMetadata):
        return []
    out = []
    for chunk in md.chunks:
        index = MetadataIndex(fqn, chunk.offsets)
        zeros = torch.Size([0] * len(chunk.sizes))
        out.append(ReadItem(LoadItemType.TENSOR, index, zeros, index, zeros, chunk.sizes))
    return out


def _hf_index_problems(fs: Any, path: str, manifest: Manifest) -> list[str]:
    """A full artifact's Hugging Face index (what ``from_pretrained`` follows) names only the artifact's
    own listed files: a resealed index pointing elsewhere would load other weights without our reader."""
    listed = {f.name for f in manifest.files}
    problems: list[str] = []
    for name in _HF_INDEXES:
        if name not in listed:
            continue
        data = read_bytes_or_none(fs, join(path, name))
        try:
            weight_map = json.loads(data or b"")["weight_map"]
            files = {check_member_name(v, where=name) for v in weight_map.values()}
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError, CheckpointError) as exc:
            problems.append(f"{name}: malformed or unsafe: {exc}")
            continue
        unlisted = sorted(files - listed)
        if unlisted:
            problems.append(f"{name}: names files the manifest does not list: {unlisted[:5]}")
    return problems

"""Full (consolidated) mode, the coordinator's side of the commit: what every rank reported, and the
metadata loaders see (one whole chunk per tensor, in the stored dtype, with the artifact description)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.storage import WriteResult

from smpckpt.storage._full_plan import DESCRIPTION_FQN, ArtifactLayout
from smpckpt.storage._full_write import ObjectResult
from smpckpt.storage.manifest import FileRecord

__all__ = ["results_of", "folder_names", "whole_tensor_metadata"]


def whole_tensor_metadata(metadata: Metadata, layout: ArtifactLayout, checks: dict[str, list[list[Any]]]) -> None:
    """Loaders see one chunk per tensor, in the stored dtype; the description says where its bytes are."""
    sdm = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            props = dataclasses.replace(md.properties, dtype=layout.dtypes.get(fqn, md.properties.dtype))
            md = TensorStorageMetadata(props, md.size, [ChunkStorageMetadata(torch.Size([0] * len(md.size)), md.size)])
        sdm[fqn] = md
    metadata.state_dict_metadata = sdm
    metadata.storage_data = {MetadataIndex(DESCRIPTION_FQN): layout.description(checks)}


def results_of(
    layout: ArtifactLayout, results: list[list[WriteResult]]
) -> tuple[list[FileRecord], dict[str, list[list[Any]]]]:
    """Full mode: the object files' records and every tensor's check units, from all ranks' results."""
    checks: dict[str, list[list[Any]]] = {}
    records: list[FileRecord] = []
    for rank, rank_results in enumerate(results):
        for wr in rank_results:
            if isinstance(wr.storage_data, ObjectResult):
                name, size, digest = wr.storage_data
                records.append(FileRecord(name, size, rank, (size,) if size else (), (digest,) if size else ()))
                continue
            art = layout.exprs[wr.index.fqn][0] if wr.index.fqn in layout.exprs else ""
            for key, view, offsets, sizes, digest in wr.storage_data or ():
                checks.setdefault(f"{art}/{key}", []).append([list(view), list(offsets), list(sizes), f"{digest:016x}"])
    return records, checks


def folder_names(fs: Any, path: str) -> set[str]:
    """Base names in a folder (empty when it does not exist)."""
    try:
        entries = fs.ls(path, detail=False)
    except (FileNotFoundError, NotADirectoryError):
        return set()
    return {str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries}

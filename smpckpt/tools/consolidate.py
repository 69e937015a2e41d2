"""Offline consolidation: a committed partial checkpoint -> the full artifact ``partial=False`` writes
(:func:`consolidate_checkpoint`, ``smpckpt consolidate``; the README's "Offline"): it drives the full-mode
storage writer as a one-rank ``dcp.save`` would, fetching each tensor only when the writer asks for it."""

from __future__ import annotations

import dataclasses
import io
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_read_item_for_byteio, _create_read_item_for_tensor
from tqdm.auto import tqdm

from smpckpt._checks import check_flag
from smpckpt.errors import CheckpointCorrupt, CheckpointError
from smpckpt.model.layout import API_RECORD_V1, FULL_ARTIFACTS, METADATA_KEY, OPTIM_STATE_PREFIX, RESERVED
from smpckpt.model.translation import Translation
from smpckpt.storage import FsspecStorageReader, FullArtifactWriter, FullOptions
from smpckpt.tools._tiers import resolve_checkpoint_url

__all__ = ["consolidate_checkpoint", "ConsolidateReport"]

log = logging.getLogger(__name__)


class ConsolidateReport(dict[str, Any]):
    """``{"out": url, "tensors": n, "bytes": n, "files": [names]}``."""


# DCP's default planners for the planning half of the protocols, which nothing calls offline: the writer
# calls only ``resolve_data`` of the save planner, the reader only the load planner's destinations
class _OneTensorAtATime(DefaultSavePlanner):
    """Hands the writer each tensor read whole from the partial checkpoint, only when asked."""

    def __init__(self, reader: FsspecStorageReader, metadata: Metadata, bar: Any) -> None:
        self.reader, self.md, self.bar = reader, metadata, bar
        # smpckpt 0.1.0 wrapped user_content's torch.save bytes in a second pickle: the artifact stores
        # the inner record, as a save of today does (copied as is, a full resume returned the bytes)
        extra = reader.manifest.extra if reader.manifest is not None else {}
        self.wrapped_user_content = extra.get("api") == API_RECORD_V1

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        fqn = write_item.index.fqn
        md = self.md.state_dict_metadata[fqn]
        if isinstance(md, BytesStorageMetadata):
            sink = _Sink(torch.empty(0))
            req = _create_read_item_for_byteio(MetadataIndex(fqn), 0, MetadataIndex(fqn), 0, 0)
            self.reader.read_data(LoadPlan([req]), sink).wait()
            data = sink.data[fqn]
            if fqn == RESERVED.user_content and self.wrapped_user_content:
                data = torch.load(io.BytesIO(data), weights_only=True)  # a bytes object: no code runs
                if not isinstance(data, bytes):
                    raise CheckpointCorrupt(f"{fqn!r}: a version 1 record wraps bytes, not {type(data).__name__}")
            return io.BytesIO(data)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"{fqn!r}: unexpected metadata type {type(md).__name__}")
        whole = torch.empty(md.size, dtype=md.properties.dtype)
        zeros = torch.Size([0] * len(md.size))
        reads = [
            _create_read_item_for_tensor(
                MetadataIndex(fqn, zeros), c.offsets, MetadataIndex(fqn, c.offsets), zeros, c.sizes
            )
            for c in md.chunks
        ]
        self.reader.read_data(LoadPlan(reads), _Sink(whole)).wait()
        self.bar.update(whole.numel() * whole.element_size())
        return whole


class _Sink(DefaultLoadPlanner):
    """Where the reader delivers one tensor's shards (into ``whole``) or one object's bytes (DCP's
    ``commit_tensor``: nothing to do)."""

    def __init__(self, whole: torch.Tensor) -> None:
        self.whole = whole
        self.data: dict[str, bytes] = {}

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.data[read_item.dest_index.fqn] = value.getvalue()

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return narrow_tensor_by_index(self.whole, read_item.dest_offsets, read_item.lengths)


def consolidate_checkpoint(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    include_optimizer: bool = False,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str | None = None,
    translation: Translation | None = None,
    hf_config: Any = None,
    storage_options: Mapping[str, Any] | None = None,
    progress: bool = True,
    format: str = "safetensors",
    out_storage_options: Mapping[str, Any] | None = None,
    sync_files: bool = True,
) -> ConsolidateReport:
    """Write the full artifact of the committed checkpoint ``src`` to the folder ``out`` (a local path or
    any URL the storage supports: on S3 each file is one streamed multipart upload). ``src`` is the
    checkpoint folder or, as on the command line, ``PATH/TAG`` (``PATH/TAG_partial`` when that exists;
    refused when a full ``PATH/TAG`` exists too).

    Checkpoints written by :func:`smpckpt.save_checkpoint` give ``model.safetensors`` (keys without the
    ``model.`` prefix), ``optimizer.safetensors`` with ``include_optimizer``, ``user_content.pt`` and
    ``<key>.pt`` for each of the model's non-tensor values (a module's extra_state) and, with
    ``include_optimizer``, each non-tensor per-parameter optimizer value (an int ``step``), as the online
    full save; RNG states and the optimizer's hyper-parameters are left out. Other DCP checkpoints put
    every tensor in ``model.safetensors`` under its flattened key and every object in ``<key>.pt``.
    ``out`` must not hold a committed checkpoint. ``format="torch_save"`` writes ``torch.save`` files
    (``pytorch_model.bin``, ``optimizer.bin``) instead of safetensors ones. ``max_shard_size`` and the
    other artifact options are those of :class:`~smpckpt.storage.FullOptions` (with its defaults, as a
    full ``save_checkpoint``). ``storage_options`` apply to ``src``, and to ``out`` unless
    ``out_storage_options`` are given. ``sync_files`` (default on): fsync every local file written and
    its folder before the commit, as a save does."""
    # the arguments first (a translation and a config of different families, a bad size), before any read
    for name, flag in (("include_optimizer", include_optimizer), ("progress", progress), ("sync_files", sync_files)):
        check_flag(name, flag)  # a truthy string was taken for True (hunt73c F9)
    opts = FullOptions(
        max_shard_size=max_shard_size, dtype=dtype, translation=translation, hf_config=hf_config, format=format
    )
    src = resolve_checkpoint_url(os.fspath(src), storage_options or {})
    reader = FsspecStorageReader(src, storage_options=storage_options)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    heads = {k.split(".", 1)[0] for k in metadata.state_dict_metadata}  # save_checkpoint's, or any DCP one
    api = RESERVED.model in heads and heads <= {RESERVED.model, RESERVED.optim, RESERVED.rng, RESERVED.user_content}
    if api:
        # an optimizer saved before its first step holds param groups and no state: its artifact says so
        if include_optimizer and not any(k.startswith(f"{RESERVED.optim}.") for k in metadata.state_dict_metadata):
            raise ValueError(f"{src}: include_optimizer, but the checkpoint was saved without optimizer")
        artifacts = {p: n for p, n in FULL_ARTIFACTS.items() if include_optimizer or p != OPTIM_STATE_PREFIX}
    else:
        if include_optimizer:
            raise ValueError(f"{src}: include_optimizer needs a checkpoint written by smpckpt.save_checkpoint")
        artifacts = {"": "model"}
    opts = dataclasses.replace(opts, artifacts=artifacts)
    record = (metadata.planner_data or {}).get(METADATA_KEY) if isinstance(metadata.planner_data, dict) else None
    # As the online full save (and save_pretrained): a key the checkpoint stores tied to another (one
    # tensor under two names, written once) stays out of the artifact unless the config unties them;
    # then it is written, and the record no longer says it is tied.
    tied = dict(record.get("tied") or {}) if isinstance(record, dict) else {}
    if isinstance(record, dict) and tied and not opts.leaves_tied_out:
        record, tied = {k: v for k, v in record.items() if k != "tied"}, {}
    items: list[WriteItem] = []
    kept: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if fqn in tied:
            continue
        if isinstance(md, TensorStorageMetadata):
            if opts.route(fqn) is None:
                continue
            zeros = torch.Size([0] * len(md.size))
            items.append(
                WriteItem(
                    MetadataIndex(fqn, zeros),
                    WriteItemType.TENSOR,
                    tensor_data=TensorWriteData(ChunkStorageMetadata(zeros, md.size), md.properties, md.size),
                )
            )
            kept[fqn] = md
        elif (
            not api
            or fqn == RESERVED.user_content
            or fqn.startswith(f"{RESERVED.model}.")
            or (include_optimizer and fqn.startswith(OPTIM_STATE_PREFIX))
        ):
            # as the online full save: the model's objects (a module's extra_state) and a parameter's
            # non-tensor optimizer state (an int step) go beside the tensors; param_groups and RNG stay out
            items.append(WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO))
            kept[fqn] = md
    total = sum(md.size.numel() * md.properties.dtype.itemsize for md in kept.values() if hasattr(md, "size"))
    planner_data = {METADATA_KEY: record} if record else None
    plan = SavePlan(items, planner_data=planner_data)
    # one thread: the writer asks for one tensor at a time, so memory stays ~2x the largest tensor
    writer = FullArtifactWriter(
        out,
        full=opts,
        thread_count=1,
        storage_options=out_storage_options if out_storage_options is not None else storage_options,
        sync_files=sync_files,
        # as the online full save records it: a resume reads a parameter without state here as one that had none
        manifest_extra={"optimizer": True} if include_optimizer else None,
    )
    writer.set_up_storage_writer(True, rank=0)
    writer.storage_meta()  # starts the record of the files this save makes (what a failure removes)
    try:
        with tqdm(total=total, unit="B", unit_scale=True, desc="consolidate", disable=not progress) as bar:
            planner = _OneTensorAtATime(reader, metadata, bar)
            (final,) = writer.prepare_global_plan([plan])
            results = writer.write_data(final, planner).wait()
        writer.finish(Metadata(state_dict_metadata=kept, planner_data=planner_data, storage_data=None), [results])
    except BaseException as exc:
        # as a failed online save does: a full-size artifact of unwritten zeros must not stay in OUT
        left = writer.discard_failed_save(exc)
        if left:
            log.warning("%s: could not remove %d file(s) of the failed consolidation: %s", writer.url, len(left), left)
        raise
    log.info("consolidated %s into %s (%d tensors, %d bytes)", src, writer.url, len(kept), total)
    return ConsolidateReport(
        out=writer.url,
        tensors=sum(isinstance(md, TensorStorageMetadata) for md in kept.values()),
        bytes=total,
        files=writer.written_files(),
    )

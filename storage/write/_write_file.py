"""One data file of one rank: items written in order through a sink, hashed on a second thread.

:func:`write_file` is the writer's data path (``FsspecStorageWriter.write_data`` runs one per file
on its thread pool, all of them staging through one pool of buffers: :mod:`._pipeline`);
:func:`split_items` decides which items go to which file.
"""

from __future__ import annotations

import io
import math
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from smpckpt.errors import not_dense
from smpckpt.storage.backends._sinks import Sink
from smpckpt.storage.backends._staging import Stages, stage_kind
from smpckpt.storage.format import _names
from smpckpt.storage.format._check_units import item_checks
from smpckpt.storage.format._checksum import BlockHasher
from smpckpt.storage.format._reading import cpu_bytes
from smpckpt.storage.format.manifest import FileRecord
from smpckpt.storage.write._pipeline import FileStream

__all__ = ["PART_FILL", "MAX_OBJECT_FILES", "object_store_bins", "write_file", "split_items", "FILE_RESULT_FQN"]

#: WriteResults under this fqn prefix carry a data file's FileRecord (sent to the coordinator), not an item.
FILE_RESULT_FQN = "\x00smpckpt.file"


def _torch_save_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().cpu()
    # torch.save writes the whole storage: compact views so the record holds only this tensor
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone(memory_format=torch.contiguous_format)
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getbuffer()


def _item_size(item: WriteItem) -> int:
    """Bytes of the tensor piece ``item`` writes (its chunk's, not the global tensor's), 0 for objects."""
    if item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


#: object stores: by default a data file aims at this fraction of a part, so that with the imbalance
#: of the greedy split and its records' headers it still fits one part (one PutObject)
PART_FILL = 0.85


#: object stores: at most this many data files per rank by default (~6.8 GiB in one-part files at
#: the default part size); a larger rank writes larger, multipart files instead of ever more objects
MAX_OBJECT_FILES = 256


def object_store_bins(items: list[WriteItem], thread_count: int, file_size: int) -> tuple[int, bool]:
    """How many data files a rank's ``items`` go into on an object store, and whether they are about
    ``file_size`` each (else larger): at least ``thread_count`` files, enough to hold about
    ``file_size`` bytes each (``0``: just ``thread_count``), at most ``MAX_OBJECT_FILES``.

    A file of at most one part is uploaded with one ``PutObject``; a larger one needs a multipart
    upload: a create and a complete request besides its parts, and a server-side concatenation at the
    complete. Many one-part files in flight keep the concurrency with a third of the requests."""
    if file_size <= 0:
        return thread_count, False
    want = -(-sum(_item_size(it) for it in items) // file_size)  # an integer ceiling (byte counts pass 2**53)
    return max(thread_count, min(MAX_OBJECT_FILES, want)), want <= MAX_OBJECT_FILES


def split_items(items: list[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Objects round-robin, tensors largest-first to the least-loaded bin; empty bins dropped."""
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    objects = [it for it in items if it.type == WriteItemType.BYTE_IO]
    tensors = sorted((it for it in items if it.type != WriteItemType.BYTE_IO), key=_item_size, reverse=True)
    for i, it in enumerate(objects):
        buckets[i % bins].append(it)
    for it in tensors:
        j = min(range(bins), key=sizes.__getitem__)
        buckets[j].append(it)
        sizes[j] += _item_size(it)
    return [b for b in buckets if b]


def write_file(
    sink: Sink,
    name: str,
    items: list[WriteItem],
    planner: SavePlanner,
    rank: int,
    *,
    raw: bool,
    block_size: int,
    stages: Stages,
    hooks: Any = None,
) -> list[WriteResult]:
    """Write ``items`` (objects first, small, then tensors, as DCP does: :func:`split_items`'s order)
    into ``sink`` and commit it; the last result carries the file's :class:`FileRecord` (size, block ends
    and digests) for the manifest. Raw tensors that cannot be written in place are copied through
    ``stages`` (:mod:`._pipeline`)."""
    hasher = BlockHasher(block_size)
    results: list[WriteResult] = []
    offset = 0
    stream = FileStream(sink, hasher, stages, hooks)
    try:
        for item in items:
            value = planner.resolve_data(item)
            descriptors: list[str] | None = None
            if item.type == WriteItemType.BYTE_IO:
                if not isinstance(value, io.BytesIO):
                    raise TypeError(f"{item.index.fqn}: BYTE_IO item resolved to {type(value).__name__}")
                mv = value.getbuffer()
                nbytes = mv.nbytes
                stream.put(mv, None)
            elif not isinstance(value, torch.Tensor):
                raise TypeError(f"{item.index.fqn}: tensor item resolved to {type(value).__name__}")
            elif value.layout is not torch.strided:
                raise not_dense(item.index.fqn, value.layout, tuple(value.shape))
            elif raw:
                descriptors = [_names.RAW_DESCRIPTOR]
                # units of its own, so a reshard reads (and verifies) only the slices it needs
                checks = item_checks(tuple(value.shape), value.element_size(), block_size)
                t = value.detach()
                own = cpu_bytes(t) if t.device.type == "cpu" else None
                kind = stage_kind(t, in_place=own is not None)
                if kind is None and own is not None:
                    nbytes = own.nbytes
                    stream.put(own, checks)
                else:
                    nbytes = stream.stage(t, stages.get(t, kind or "host"), checks)
            else:
                mv = _torch_save_bytes(value)
                nbytes = mv.nbytes
                stream.put(mv, None)
            results.append(
                WriteResult(
                    index=item.index,
                    size_in_bytes=nbytes,
                    storage_data=_StorageInfo(name, offset, nbytes, transform_descriptors=descriptors),
                )
            )
            offset += nbytes
        stream.finish()
        ends, digests = hasher.finish()
        sink.commit()
    except BaseException:
        sink.abort()
        raise
    finally:
        stream.close()
    results.append(
        WriteResult(
            index=MetadataIndex(f"{FILE_RESULT_FQN}/{name}"),
            size_in_bytes=offset,
            storage_data=FileRecord(name, offset, rank, tuple(ends), tuple(digests), tilings=tuple(hasher.tilings)),
        )
    )
    return results

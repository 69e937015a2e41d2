"""The ``torch.save`` file layout of a flat dict of tensors, without their bytes.

Full artifacts in ``torch_save`` format are written like safetensors ones: the coordinator lays each
file out and writes everything that is not tensor data, and every rank ``pwrite``\\ s its boxes at their
offsets. The layout comes from ``torch.save`` itself: the dict, made of FakeTensors of the right shapes
and dtypes, is saved under ``torch.serialization.skip_data``, which writes the zip archive with its
pickle, record headers and directory, and leaves a hole where each storage's bytes go. That file is
sparse (a few KiB on disk whatever the model size) and is read back as the list of byte pieces that
surround the holes, plus each tensor's record offset. The result loads with ``torch.load(path,
weights_only=True)`` (``mmap=True`` too: torch aligns every record to 64 bytes) with nothing of ours
installed. Record CRCs are written as zero, as ``torch.save`` does under
``torch.serialization.set_crc32_options(False)``; integrity comes from the manifest's check units.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["TorchLayout", "torch_layout"]


@dataclasses.dataclass(frozen=True)
class TorchLayout:
    size: int  # file size
    pieces: tuple[tuple[int, bytes], ...]  # (offset, bytes) of everything that is not tensor data
    starts: tuple[int, ...]  # each tensor's first byte, in the order given


def torch_layout(entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> TorchLayout:
    """The file ``torch.save({key: tensor})`` writes for these ``(key, dtype, shape)`` tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = {key: torch.empty(shape, dtype=dtype) for key, dtype, shape in entries}
    fd, path = tempfile.mkstemp(prefix="smpckpt-torch-layout-", suffix=".pt")
    os.close(fd)
    try:
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(fake, path)
        size = os.path.getsize(path)
        reader: Any = torch._C.PyTorchFileReader(path)
        # torch.save numbers storages in pickling order; a dict pickles its values in insertion order
        starts = [int(reader.get_record_offset(f"data/{i}")) for i in range(len(entries))]
        del reader
        holes = sorted((s, s + math.prod(shape) * dtype.itemsize) for s, (_, dtype, shape) in zip(starts, entries))
        pieces = []
        with open(path, "rb") as f:
            pos = 0
            for lo, hi in holes + [(size, size)]:
                if lo > pos:
                    f.seek(pos)
                    pieces.append((pos, f.read(lo - pos)))
                pos = max(pos, hi)
        return TorchLayout(size, tuple(pieces), tuple(starts))
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)

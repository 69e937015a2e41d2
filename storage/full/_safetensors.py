"""The safetensors container, read and written by hand (no dependency on the ``safetensors`` package).

Layout (https://github.com/huggingface/safetensors): 8 bytes little-endian ``N``, then ``N`` bytes of
JSON header, then the data. The header maps each tensor name to ``{"dtype", "shape",
"data_offsets": [begin, end]}`` (offsets relative to the data start) plus an optional
``"__metadata__"`` of string values. We pad the header with spaces so the data starts 8-byte aligned,
as the reference writer does, and lay tensors out back to back, as its reader requires.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import torch

from smpckpt.errors import CheckpointCorrupt

__all__ = ["DTYPE_NAMES", "HeaderEntry", "encode_header", "parse_header", "MAX_HEADER"]

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

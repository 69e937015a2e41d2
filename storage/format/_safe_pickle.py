"""Loading checkpoint metadata and objects without running code from the checkpoint.

``.metadata`` is a pickle. :func:`load_metadata` unpickles it with an allow-list: DCP's metadata
dataclasses, ``_StorageInfo``, ``torch.Size``, dtypes/layouts/memory formats, a few path classes and
harmless builtins. Anything else (``os.system``, ``builtins.eval``, ...) is refused *before* it is
called, so a crafted ``__reduce__`` payload never runs. Nothing on the list allocates by an argument
(``bytearray(10**13)`` would: DCP metadata holds no bytearray, so it is not there).

Object values (BYTE_IO items) are ``torch.save`` pickles deserialised later by the load planner;
:func:`check_weights_only` refuses those that ``torch.load(weights_only=True)`` would refuse.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import zipfile
from collections.abc import Iterable
from typing import Any

import torch

from smpckpt._gc import gc_paused
from smpckpt.errors import CheckpointCorrupt, UnsafeCheckpoint

__all__ = ["load_metadata", "check_weights_only", "ALLOWED_GLOBALS"]

ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.distributed.checkpoint.planner", "WriteItemType"),
        ("torch.distributed.checkpoint.planner", "LoadItemType"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("collections", "OrderedDict"),
        ("collections", "defaultdict"),
        ("copyreg", "_reconstructor"),
    }
    | {("pathlib", name) for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")}
    | {("builtins", name) for name in ("set", "frozenset", "slice", "complex", "range", "object")}
)


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f: io.BytesIO, extra: frozenset[tuple[str, str]]) -> None:
        super().__init__(f)
        self._extra = extra

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS or (module, name) in self._extra:
            return super().find_class(module, name)
        if module == "torch" and "." not in name:
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in checkpoint metadata")


def load_metadata(data: bytes, *, where: str, extra_globals: Iterable[tuple[str, str]] = ()) -> Any:
    """Unpickle DCP ``Metadata`` from ``data`` with the allow-list; :class:`UnsafeCheckpoint` /
    :class:`CheckpointCorrupt` (naming ``where``) on anything else."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        with gc_paused():  # an object per item: no collections while they are made
            obj = _MetadataUnpickler(io.BytesIO(data), frozenset(extra_globals)).load()
    except pickle.UnpicklingError as exc:
        if "is not allowed" in str(exc):
            raise UnsafeCheckpoint(f"{where}: refused to load: {exc}") from exc
        raise CheckpointCorrupt(f"{where}: cannot be unpickled: {exc}") from exc
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as exc:
        raise CheckpointCorrupt(f"{where}: cannot be unpickled: {type(exc).__name__}: {exc}") from exc
    if not isinstance(obj, Metadata):
        raise CheckpointCorrupt(f"{where}: holds {type(obj).__name__}, not DCP Metadata")
    return obj


def check_weights_only(data: bytes | memoryview, *, where: str) -> None:
    """Refuse object bytes that need arbitrary code to load (``UnsafeCheckpoint``); bytes that are no
    readable record at all are ``CheckpointCorrupt`` (never advise ``allow_pickle`` for plain damage)."""
    try:
        torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        if not _well_formed(data):
            raise CheckpointCorrupt(f"{where}: object bytes are not a readable torch.save record: {exc}") from exc
        raise UnsafeCheckpoint(
            f"{where}: this object is not weights-only safe (loading it could run code from the "
            f"checkpoint); pass allow_pickle=True for checkpoints you trust. Detail: {exc}"
        ) from exc
    except (RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointCorrupt(f"{where}: object bytes cannot be read: {exc!r}") from exc


def _well_formed(data: bytes | memoryview) -> bool:
    """Whether ``data`` parses as a torch.save record (zip with a pickle, or a legacy pickle stream),
    by reading its opcodes without executing any of them."""
    raw = bytes(data)
    if raw[:4] == b"PK\x03\x04":
        try:
            with zipfile.ZipFile(io.BytesIO(raw)) as archive:
                name = next((n for n in archive.namelist() if n.endswith("data.pkl")), None)
                if name is None:
                    return False
                raw = archive.read(name)
        except (zipfile.BadZipFile, OSError, ValueError):
            return False
    try:
        for _ in pickletools.genops(io.BytesIO(raw)):
            pass
    except Exception:  # noqa: BLE001 - any parse failure means damaged bytes
        return False
    return bool(raw)

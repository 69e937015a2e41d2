"""Full (consolidated) mode, the layout the coordinator decides (files, every tensor's place, each rank's
boxes) and its description stored in the generation's metadata, parsed back by ``_source``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from smpckpt.model.translation import Cat, Expr, Leaf
from smpckpt.storage.format._checksum import hash_bytes
from smpckpt.storage.full.options import FullOptions

__all__ = ["FullWrite", "RankFullData", "ArtifactFile", "ArtifactLayout", "Place", "expr_to_json", "expr_from_json"]
__all__ += ["file_pieces_from_json", "leaf_keys"]


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
    #: gather mode (object stores): every rank's boxes in the global order, and the files (file ``i`` is
    #: owned by rank ``i % world``)
    all_writes: tuple[tuple[int, FullWrite], ...] = ()
    files: tuple[ArtifactFile, ...] = ()
    #: POSIX mode: the row-block swaps (``_exchange.Exchange``) this rank takes part in, global order
    exchanges: tuple[Any, ...] = ()


@dataclasses.dataclass(frozen=True)
class ArtifactFile:
    """One file of an artifact: its non-tensor ``pieces`` (headers) and where each tensor goes."""

    name: str
    artifact: str
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
        """The JSON stored in the generation's metadata (read back by ``_source``)."""
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

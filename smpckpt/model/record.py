"""What a checkpoint records about how it was partitioned -- one type, written once, read by all.

The save planner builds a :class:`LayoutRecord` and stores its JSON in ``Metadata.planner_data``
under :data:`METADATA_KEY`; :class:`~smpckpt.storage.FsspecStorageWriter` copies that JSON verbatim
into the commit manifest under :data:`MANIFEST_KEY`, so tools that list many checkpoints (``smpckpt
ls``, resume's choice of tag) read it without fetching ``.metadata``. Every reader -- the load
planner, resume, the CLI -- parses it here and nowhere else.

Versions: 1 is the current record. Checkpoints written by smpckpt 0.1.0's ``save_checkpoint`` kept
``layout``/``specs``/``rank_local`` loose in the manifest's ``extra``; :meth:`LayoutRecord.from_manifest`
still reads those.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from smpckpt._formats import RECORD_VERSION
from smpckpt.errors import CheckpointCorrupt, SpecError
from smpckpt.model.layout import ParallelLayout

__all__ = ["LayoutRecord", "METADATA_KEY", "MANIFEST_KEY", "RECORD_VERSION", "TIED_KEY", "checkpoint_ties"]
__all__ += ["MERGED_KEY", "checkpoint_original_shapes"]

#: Key in ``Metadata.planner_data`` (plain JSON-able values, so stock unpicklers read it).
METADATA_KEY = "__smpckpt__"
#: Key in the manifest's ``extra`` (a copy of the same JSON, made by the storage writer).
MANIFEST_KEY = "layout_record"
#: Key in ``Metadata.planner_data`` of a plain Hugging Face folder read through our storage reader: tied
#: heads the folder leaves out (``{"model.lm_head.weight": "model.transformer.wte.weight"}``). Our own
#: checkpoints record their ties in the :class:`LayoutRecord` instead.
TIED_KEY = "__smpckpt_tied__"
#: Key in ``Metadata.planner_data`` of a plain Hugging Face folder read through a translation: the shape
#: an unsharded model holds each fused tensor in (``[3d, d]`` for the stored view ``[3, d, d]``), as
#: :attr:`LayoutRecord.original_shapes` records it for our checkpoints.
MERGED_KEY = "__smpckpt_merged__"


@dataclasses.dataclass(frozen=True)
class LayoutRecord:
    """The partition a checkpoint was saved under.

    ``specs`` are the spec rules as JSON records (``SpecRules.to_records()``): kept as data, since
    a reader needs them for display and comparison, not to shard anything.
    """

    layout: ParallelLayout
    specs: tuple[Mapping[str, Any], ...] = ()
    rank_local: tuple[str, ...] = ()
    version: int = RECORD_VERSION
    #: key -> shape before its ShardSpec ``view`` (the checkpoint stores the view shape); export tools
    #: reshape to it so a fused QKV comes out as ``[3h, d]``, not ``[3, h, d]``
    original_shapes: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    #: tied key -> the key whose stored bytes it is (one tensor held under two names, written once);
    #: a load into a model that holds the two apart reads the second for the first
    tied: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = {
            "version": self.version,
            "layout": self.layout.to_dict(),
            "specs": [dict(s) for s in self.specs],
            "rank_local": list(self.rank_local),
            "original_shapes": {k: list(v) for k, v in sorted(self.original_shapes.items())},
        }
        if self.tied:  # absent otherwise: records without ties stay as every earlier version wrote them
            out["tied"] = dict(sorted(self.tied.items()))
        return out

    @classmethod
    def from_json(cls, obj: Any, *, where: str = "layout record") -> LayoutRecord:
        """Parse; a malformed record is :class:`~smpckpt.errors.CheckpointCorrupt` naming ``where``."""
        try:
            if not isinstance(obj, Mapping):
                raise TypeError(f"expected an object, got {type(obj).__name__}")
            version = int(obj.get("version", RECORD_VERSION))
            if version > RECORD_VERSION:
                raise ValueError(f"record version {version} is newer than this smpckpt understands; upgrade smpckpt")
            specs = obj.get("specs") or ()
            rank_local = obj.get("rank_local") or ()
            if not isinstance(specs, Sequence) or not isinstance(rank_local, Sequence):
                raise TypeError("specs and rank_local must be lists")
            return cls(
                layout=ParallelLayout.from_dict(obj["layout"]),
                specs=tuple(dict(s) for s in specs),
                rank_local=tuple(str(g) for g in rank_local),
                version=version,
                original_shapes={
                    str(k): tuple(int(n) for n in v) for k, v in dict(obj.get("original_shapes") or {}).items()
                },
                tied={str(k): str(v) for k, v in dict(obj.get("tied") or {}).items()},
            )
        except (KeyError, TypeError, ValueError, SpecError, OverflowError, RecursionError) as exc:
            raise CheckpointCorrupt(f"{where} is malformed: {exc}") from exc

    @classmethod
    def from_metadata(cls, metadata: Any) -> LayoutRecord | None:
        """The record in a DCP ``Metadata`` (``None`` for checkpoints saved without our planner)."""
        data = getattr(metadata, "planner_data", None)
        if not isinstance(data, Mapping) or METADATA_KEY not in data:
            return None
        return cls.from_json(data[METADATA_KEY], where=f"Metadata.planner_data[{METADATA_KEY!r}]")

    @classmethod
    def from_manifest(cls, manifest: Any) -> LayoutRecord | None:
        """The record in a manifest's ``extra`` (``None`` when the save recorded none)."""
        extra = getattr(manifest, "extra", None) or {}
        if MANIFEST_KEY in extra:
            return cls.from_json(extra[MANIFEST_KEY], where=f"manifest extra[{MANIFEST_KEY!r}]")
        if isinstance(extra.get("layout"), Mapping):  # smpckpt 0.1.0's save_checkpoint
            fields = {name: extra.get(name) for name in ("layout", "specs", "rank_local")}
            return cls.from_json({"version": 1, **fields}, where="manifest extra (0.1.0 layout fields)")
        return None

    @staticmethod
    def json_in_metadata(metadata: Any) -> Mapping[str, Any] | None:
        """The raw JSON of the record in ``metadata`` (what the storage writer copies into the manifest)."""
        data = getattr(metadata, "planner_data", None)
        if isinstance(data, Mapping) and isinstance(data.get(METADATA_KEY), Mapping):
            return data[METADATA_KEY]
        return None


def checkpoint_ties(metadata: Any) -> dict[str, str]:
    """Tied keys a checkpoint stores once (key -> the key holding its bytes): from our record, or from
    what the storage reader found missing in a plain Hugging Face folder (:data:`TIED_KEY`)."""
    record = LayoutRecord.from_metadata(metadata)
    if record is not None:
        return dict(record.tied)
    data = getattr(metadata, "planner_data", None)
    found = data.get(TIED_KEY) if isinstance(data, Mapping) else None
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, Mapping) else {}


def checkpoint_original_shapes(metadata: Any) -> dict[str, tuple[int, ...]]:
    """Shapes tensors stored in a view had before it (key -> shape): from our record, or from what the
    storage reader knows of a Hugging Face folder's fused tensors (:data:`MERGED_KEY`)."""
    record = LayoutRecord.from_metadata(metadata)
    if record is not None:
        return dict(record.original_shapes)
    data = getattr(metadata, "planner_data", None)
    found = data.get(MERGED_KEY) if isinstance(data, Mapping) else None
    if not isinstance(found, Mapping):
        return {}
    return {str(k): tuple(int(n) for n in v) for k, v in found.items()}

"""Compact forms of what ``dcp.save`` sends between ranks once the data is written.

After ``write_data`` DCP gathers every rank's write results on the coordinator, and after ``finish``
it broadcasts the checkpoint's ``Metadata`` to every rank; both travel as pickles and are unpickled in
DCP's own code, between our hooks, with Python's cyclic collector running. With thousands of items
per rank each unpickle makes objects by the ten thousand (the Metadata of 2,723 tensors at 4 ranks:
67,000, 41,000 of them its storage index), which sets off a full collection that walks every object
of a process with torch loaded: 0.13-0.2 s per save on the coordinator's gather and again on every
rank's broadcast (benchmarks/RESULTS.md, "Results and Metadata across ranks"). So:

* each rank's results cross as **one** pickle (:func:`pack_results`); the coordinator's ``finish``
  opens them with the collector paused (:func:`open_results`);
* the Metadata ``dcp.save`` returns (and DCP broadcasts) holds its mappings -- ``state_dict_metadata``
  (a chunk per item), ``storage_data`` (a record per item) and ``planner_data`` -- as read-only views
  of the committed metadata file's bytes (:func:`lean_returned_metadata`), decoded on first use:
  receivers unpickle one ``bytes`` object instead of an object per item, the coordinator drops its
  per-item objects (the index before the collector resumes: none lives on into an old generation),
  and each view still maps what was committed for whoever reads it.

Nothing here changes what is stored: the ``.metadata`` files hold the plain dict DCP readers expect.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Iterator, Mapping
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from smpckpt._gc import gc_paused
from smpckpt.errors import CheckpointError
from smpckpt.model.layout import LayoutRecord
from smpckpt.storage.format._safe_pickle import load_metadata
from smpckpt.storage.format.manifest import FileRecord

__all__ = [
    "PackedResults",
    "crosses_ranks",
    "pack_results",
    "open_results",
    "committed_index",
    "list_tied",
    "CommittedMetadata",
    "CommittedView",
    "lean_returned_metadata",
    "with_plain_mappings",
]

#: Index of the one WriteResult that carries a rank's packed results (never stored).
PACKED_RESULTS_FQN = "\x00smpckpt.packed_results"


@dataclasses.dataclass(frozen=True)
class PackedResults:
    """One rank's write results as one pickle: ``storage_data`` of the single result it sends."""

    payload: bytes
    count: int


def crosses_ranks(process_group: dist.ProcessGroup | None) -> bool:
    """Whether DCP will pickle results and Metadata between ranks (a one-process save passes them on
    as they are: packing there would only add a pickle round trip)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1


def pack_results(results: list[WriteResult]) -> list[WriteResult]:
    """(every rank, end of ``write_data``) This rank's results as one result holding their pickle."""
    with gc_paused():
        payload = pickle.dumps(results, protocol=pickle.HIGHEST_PROTOCOL)
    total = sum(r.size_in_bytes for r in results)
    return [WriteResult(MetadataIndex(PACKED_RESULTS_FQN), total, PackedResults(payload, len(results)))]


def open_results(results: list[list[WriteResult]]) -> list[list[WriteResult]]:
    """(coordinator, ``finish``) Every rank's results, packed or not, as DCP would have delivered them.

    The payloads come from the ranks of this job through DCP's gather, which unpickles whatever the
    ranks send anyway: opening them trusts the same peers, no more."""
    out: list[list[WriteResult]] = []
    with gc_paused():  # an object per item of every rank
        for rank, rank_results in enumerate(results):
            if len(rank_results) == 1 and isinstance(rank_results[0].storage_data, PackedResults):
                packed = rank_results[0].storage_data
                opened = pickle.loads(packed.payload)
                if not isinstance(opened, list) or len(opened) != packed.count:
                    raise CheckpointError(
                        f"rank {rank}'s packed write results hold {type(opened).__name__} "
                        f"(expected a list of {packed.count} WriteResult)"
                    )
                out.append(opened)
            else:
                out.append(rank_results)
    return out


def committed_index(results: list[list[WriteResult]]) -> tuple[list[FileRecord], dict[MetadataIndex, Any]]:
    """(coordinator, partial mode) The data files' records (for the manifest) and the storage index
    (``Metadata.storage_data``: each item's file, offset and length), from every rank's results."""
    files: list[FileRecord] = []
    index: dict[MetadataIndex, Any] = {}
    for rank_results in results:
        for wr in rank_results:
            if isinstance(wr.storage_data, FileRecord):
                files.append(wr.storage_data)
            else:
                index[wr.index] = wr.storage_data
    return files, index


def list_tied(metadata: Metadata) -> None:
    """(coordinator, partial mode) Each tied key (written once, under the key it is tied to: the save
    planner's ``LayoutRecord.tied``) gets that key's entries in ``state_dict_metadata`` and
    ``storage_data``, over the same bytes: stock readers then load both keys of a tied model."""
    record = LayoutRecord.from_metadata(metadata)
    tied = record.tied if record is not None else {}
    sdm, index = metadata.state_dict_metadata, metadata.storage_data
    for alias, first in tied.items():
        md = sdm.get(first)
        if md is None or alias in sdm or not hasattr(md, "chunks"):
            continue
        sdm[alias] = md
        for chunk in md.chunks:
            stored = index.get(MetadataIndex(first, chunk.offsets))
            if stored is not None:
                index[MetadataIndex(alias, chunk.offsets)] = stored


class CommittedMetadata:
    """The committed metadata file's bytes, decoded (with the reader's allow-list) once, on first use.
    Pickles as those bytes: the views below share one instance, so a pickle of the Metadata that holds
    them carries the bytes once."""

    def __init__(self, metadata_bytes: bytes, where: str) -> None:
        self._bytes = metadata_bytes
        self.where = where
        self._decoded: Metadata | None = None

    def __reduce__(self) -> tuple[Any, tuple[bytes, str]]:
        return (CommittedMetadata, (self._bytes, self.where))

    @property
    def decoded(self) -> bool:
        return self._decoded is not None

    def metadata(self) -> Metadata:
        if self._decoded is None:
            self._decoded = load_metadata(self._bytes, where=self.where)
        return self._decoded


class CommittedView(Mapping[Any, Any]):
    """One mapping field of the committed Metadata (``state_dict_metadata``, ``storage_data`` or
    ``planner_data``), read-only, decoded on first use."""

    def __init__(self, source: CommittedMetadata, field: str) -> None:
        if field not in _VIEW_FIELDS:
            raise ValueError(f"no committed view of Metadata.{field} (one of {_VIEW_FIELDS})")
        self._source = source
        self._field = field

    def __reduce__(self) -> tuple[Any, tuple[CommittedMetadata, str]]:
        return (CommittedView, (self._source, self._field))

    def _mapping(self) -> Mapping[Any, Any]:
        value = getattr(self._source.metadata(), self._field)
        return value if value is not None else {}

    def __getitem__(self, key: Any) -> Any:
        return self._mapping()[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._mapping())

    def __len__(self) -> int:
        return len(self._mapping())

    def __repr__(self) -> str:
        state = f"{len(self._mapping())} entries" if self._source.decoded else "not decoded yet"
        return f"CommittedView({self._field} of {self._source.where}, {state})"


_VIEW_FIELDS = ("state_dict_metadata", "storage_data", "planner_data")


def with_plain_mappings(metadata: Metadata) -> Metadata:
    """``metadata`` with any view of a committed file turned back into the dict it stands for, before
    it is pickled into a new file: a planner may hand ``finish`` a Metadata that a previous save left
    lean (DCP's ``DefaultSavePlanner`` with plan caching reuses the object), and the file must hold
    plain dicts."""
    for field in _VIEW_FIELDS:
        value = getattr(metadata, field)
        if isinstance(value, CommittedView):
            setattr(metadata, field, dict(value))
    return metadata


def lean_returned_metadata(metadata: Metadata, metadata_bytes: bytes, where: str) -> None:
    """(coordinator, end of ``finish``) Turn the Metadata ``dcp.save`` returns (and DCP broadcasts)
    into views of the committed bytes: receivers unpickle one ``bytes`` object instead of an object
    per item, and the coordinator drops its own per-item objects. A field that is not a mapping (a
    planner that sets no ``planner_data``) is left as it is."""
    source = CommittedMetadata(metadata_bytes, where)
    for field in _VIEW_FIELDS:
        if isinstance(getattr(metadata, field), Mapping):
            setattr(metadata, field, CommittedView(source, field))

"""``FastTierWriter``: a partial checkpoint written into this node's fast-tier folder, committed per
node only after every node holds its share.

Each rank passes its own node's folder; ``dcp.save`` runs as with :class:`FsspecStorageWriter`
(same files, same checksums), except that the coordinator's ``finish`` writes nothing: it keeps the
manifest and metadata bytes (:attr:`FastTierWriter.prepared`). The API then sends them to every rank,
copies each rank's files to its replica nodes (:mod:`.transfer`), agrees that every node holds
what it should, and only then each node's first rank commits its copy (:func:`commit_node_copy`):
the generation's metadata, the manifest (create-if-absent), the stock ``.metadata``.

Why commit per node, and only after that agreement: a manifest on any node then proves that every
node held its share at that moment, so a tag is usable exactly when the surviving nodes' files cover
its manifest. A kill before the agreement leaves no manifest anywhere: the tag was never committed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from smpckpt.errors import CheckpointExists
from smpckpt.storage.backends._folder import Folder
from smpckpt.storage.backends._fs import is_local, open_fs, resolve
from smpckpt.storage.backends._sinks import Sink
from smpckpt.storage.format.commit import commit
from smpckpt.storage.format.manifest import MANIFEST_NAME, FileRecord, Manifest, new_save_id
from smpckpt.storage.tier.stream import Replicator
from smpckpt.storage.write.writer import FsspecStorageWriter, RankPlanData

__all__ = ["FastTierWriter", "PreparedCommit", "commit_node_copy", "parts_of"]


@dataclasses.dataclass(frozen=True)
class PreparedCommit:
    """What the coordinator's ``finish`` built and every node commits: the manifest and metadata bytes."""

    manifest: bytes
    metadata_name: str
    metadata: bytes

    def parsed(self) -> Manifest:
        return Manifest.from_bytes(self.manifest)


class FastTierWriter(FsspecStorageWriter):
    """:class:`FsspecStorageWriter` into this node's fast-tier folder ``path`` (a local path); the
    coordinator's ``finish`` prepares the commit (:attr:`prepared`) instead of writing it; with a
    ``replicator`` (:mod:`.stream`), each data file is also sent to the replica ranks while it is written.

    Call order inside ``dcp.save`` as the partial writer's, except (coordinator) ``prepare_global_plan``
    does not probe its folder (the API checked every node's folder before the save) and ``finish`` only
    builds :attr:`prepared`. ``prefix_strategy`` is the durable root's (object stores: hex prefixes) and,
    with ``durable_is_local=False``, files are sized as for an object store (about one part each), so a
    drain uploads the files under the names and in the sizes a direct save would have written."""

    def __init__(
        self, path: str, *, durable_is_local: bool = True, replicator: Replicator | None = None, **kwargs: Any
    ) -> None:
        super().__init__(path, **kwargs)
        if not is_local(self.fs):
            raise ValueError(f"local_path must be a folder on this node, got {path!r}")
        # the files a drain uploads as they are: for an object store, one-request objects
        self._split_as_local = durable_is_local
        self.prepared: PreparedCommit | None = None
        #: sends every data file to the replica ranks while it is written (``None``: no replicas)
        self.replicator = replicator

    def _open_sink(self, name: str) -> Sink:
        """The local file's sink; with a :attr:`replicator`, its bytes also go to the replica ranks as they
        are written (the bytes already in memory, never read back)."""
        sink = super()._open_sink(name)
        return self.replicator.sink(sink, name) if self.replicator is not None else sink

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """(coordinator) A fresh save id for every rank; the folders were settled by the API."""
        self._save_id = new_save_id()
        prefixes = resolve(self.prefix_strategy, local=True)
        return [
            dataclasses.replace(p, storage_data=RankPlanData(self._save_id, i, len(plans), prefixes, False))
            for i, p in enumerate(plans)
        ]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """(coordinator) Build the manifest and metadata bytes; write nothing (see the module docstring)."""
        save_id, files = self._committed_files(metadata, results)
        files = sorted(files, key=lambda f: (f.rank, f.name))
        manifest, md_bytes = self._manifest(save_id, metadata, files, len(results), self.format)
        self._used_save_ids.add(save_id)
        self.prepared = PreparedCommit(manifest.to_bytes(), manifest.metadata.name, md_bytes)

    def _write_metadata(self, gen_name: str, md_bytes: bytes) -> None:
        pass  # every node writes it at its own commit, from :attr:`prepared`


def parts_of(manifest: Manifest, ranks: Iterable[int]) -> list[FileRecord]:
    """The data files ``ranks`` wrote."""
    wanted = set(ranks)
    return [f for f in manifest.files if f.rank in wanted]


def commit_node_copy(folder: str, prepared: PreparedCommit, expected: list[FileRecord], *, sync: bool) -> bool:
    """(one rank per node) Commit this node's copy: check that ``expected`` files are there at their
    sizes, then write the generation's metadata, the manifest (create-if-absent) and the stock
    ``.metadata``. ``False`` when this very generation was already committed here (nothing written);
    :class:`CheckpointExists` when another generation was."""
    fs, path = open_fs(folder)
    with Folder(fs, path) as f:  # the one commit protocol (storage/format/commit.py)
        existing = f.read(MANIFEST_NAME)
        if existing is not None:
            if existing == prepared.manifest:
                return False
            raise CheckpointExists(f"{folder}: holds another committed checkpoint of this tag")
        commit(
            f,
            folder,
            prepared.parsed(),
            prepared.manifest,
            sync=sync,
            metadata=prepared.metadata,
            expected=expected,
            stock_metadata=prepared.metadata,
            refused="another save committed here at the same time",
        )
    return True

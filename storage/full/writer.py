"""``FullArtifactWriter``: DCP StorageWriter of the full artifact (one consolidated, Hugging Face-shaped
safetensors or torch.save checkpoint, every tensor full-size) written straight from every rank's shards;
it shares ``write/_base.FsspecWriterBase`` with the partial writer.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

from smpckpt._gc import gc_paused
from smpckpt.errors import CheckpointError
from smpckpt.storage.backends._folder import Folder, remove_tree
from smpckpt.storage.backends._fs import is_local
from smpckpt.storage.format import manifest as _names
from smpckpt.storage.format.commit import commit_uncertain, committed_save_id
from smpckpt.storage.full._commit import (
    artifact_records,
    begin_full_save,
    commit_full,
    staging_path,
    warn_ties_held_apart,
    whole_tensor_metadata,
)
from smpckpt.storage.full._source import ArtifactLayout, RankFullData
from smpckpt.storage.full._write import _RankWriter, gather_rank, write_objects
from smpckpt.storage.full.options import FullOptions
from smpckpt.storage.write._base import FailedSaveFiles, FsspecWriterBase, WriterOptions, folder_is_new, open_results

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["FullArtifactWriter"]


class FullArtifactWriter(FsspecWriterBase):
    """Write the full artifact of the state dict ``dcp.save`` is given to ``path`` (any fsspec URL).

    Call order inside ``dcp.save``: :class:`~smpckpt.storage.write._base.FsspecWriterBase`'s, plus

    * (coordinator) ``prepare_global_plan``: refuses a committed or foreign folder, clears an unfinished
      save's debris, lays the artifact out; POSIX: creates its files in a staging folder of its own
      (``.smpckpt-staging.<id>``); object stores: the in-progress marker (create-only);
    * (all) ``write_data``: POSIX: this rank's boxes at their offsets; object stores: each file streamed by
      its owner rank from the ranks' shard bytes, created only if absent;
    * (coordinator) ``finish``: the one commit protocol (side files and ``.metadata.<id>``, one listing,
      the manifest; POSIX: the staging folder renamed into place; object stores: the marker goes).

    A failed save (``discard_failed_save()``): the coordinator removes the staging folder, or the artifact
    it laid out, marker last. The file names are fixed, so a committed folder is never written over.

    Args: ``full``: layout options (:class:`FullOptions`); the others are
    :class:`~smpckpt.storage.write._base.FsspecWriterBase`'s (on object stores ``process_group`` must
    move CPU tensors: gloo). The partial writer's own options are a ``TypeError`` naming it."""

    _KIND = "full"

    def __init__(
        self, path: str | os.PathLike[str], *, full: FullOptions | None = None, **options: Unpack[WriterOptions]
    ) -> None:
        if full is not None and not isinstance(full, FullOptions):
            raise TypeError(f"full must be a FullOptions, got {type(full).__name__}")
        self.full = full if full is not None else FullOptions()
        super().__init__(path, **options)

    def _open(self, path: str | os.PathLike[str]) -> None:
        super()._open(path)
        self._layout: ArtifactLayout | None = None  # what prepare_global_plan laid out

    def _open_folder(self, *, create: bool = False, save_id: str | None = None) -> Folder:
        """Where this save's files go: on POSIX its staging folder, on object stores the target."""
        sid = save_id or self._save_id
        if is_local(self.fs) and sid is not None:
            return Folder(self.fs, staging_path(self.path, sid), create=create)
        return Folder(self.fs, self.path, create=create)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """(coordinator) Take the folder, lay out the artifact and tell each rank its boxes."""
        if any(not p.usable for p in plans):
            raise CheckpointError(
                f"{self.url}: full mode needs every rank's full plan, not cached (empty) ones: use "
                "ParallelSavePlanner(..., cache_scope='local') (the next save with this planner plans afresh)"
            )
        new_folder = folder_is_new(self.fs, self.path)
        self._save_id = save_id = _names.new_save_id()
        out, layout = begin_full_save(self, plans, save_id)
        self._layout = layout
        self._attempt.begin(save_id, new_folder=new_folder, names=layout.names(self.full))
        return out

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """(coordinator) The artifact's records, the metadata, then the manifest (the commit)."""
        save_id, layout = self._save_id, self._layout
        if save_id is None or layout is None:
            raise CheckpointError("finish() called without prepare_global_plan() on this writer")
        with self._open_folder() as self._folder:
            try:
                with gc_paused():  # the check units of every rank, as objects: dropped before the collector resumes
                    objects, boxes = whole_tensor_metadata(metadata, layout, open_results(results))
                    warn_ties_held_apart(self._folder, layout, self.full, boxes, self.url)
                    del boxes
                records, side = artifact_records(self._folder, layout, self.full, sync=self.sync_files)
                files = sorted(records + objects, key=lambda f: f.name)
                manifest, md_bytes = self._manifest(save_id, metadata, files, len(results), "raw")
                commit_full(self, manifest, md_bytes, side, self._folder)
            finally:
                self._folder = None
        self._used_save_ids.add(save_id)

    def _write_metadata(self, gen_name: str, md_bytes: bytes) -> None:
        pass  # created by the commit (``commit_full``), with the side files

    def discard_failed_save(self, error: BaseException | None = None) -> list[str]:
        """(all ranks, after ``dcp.save`` raised) POSIX: the coordinator removes this save's staging folder,
        whole (nothing else ever writes into it), unless the commit landed. Object stores: as the base."""
        if not is_local(self.fs):
            return super().discard_failed_save(error)
        save_id, self._save_id = self._save_id, None
        self._attempt = FailedSaveFiles()
        if save_id is None or not self.is_coordinator or commit_uncertain(error):
            return []
        with contextlib.suppress(OSError), Folder(self.fs, self.path) as target:
            if committed_save_id(target) == save_id:
                return []  # published: the commit landed
        try:
            return remove_tree(self.fs, staging_path(self.path, save_id))
        except FileNotFoundError:
            return []

    def written_files(self) -> list[str]:
        """The safetensors (or torch.save) files of the artifact being written (after prepare_global_plan)."""
        return sorted(f.name for f in self._layout.files) if self._layout is not None else []

    def _write_rank(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        data = self._plan_data(plan, RankFullData)
        with self._open_folder(save_id=data.save_id) as self._folder:
            try:
                if data.files:  # object stores: each file streamed by its owner rank (the sinks borrow: see _open_sink)
                    written = gather_rank(
                        data, plan.items, planner, open_sink=self._open_sink, process_group=self.process_group
                    )
                else:  # POSIX: every rank at its offsets, in the staging folder the coordinator made
                    stages = self._stages()
                    try:
                        with _RankWriter(self._folder, data, plan.items, planner, stages) as w:
                            written = w.run(self.thread_count, self.process_group, sync=self.sync_files)
                    finally:
                        stages.close()
                written += write_objects(self._folder, data, plan.items, planner, self.sync_files)
            finally:
                self._folder = None
        self._used_save_ids.add(data.save_id)
        return written

"""``FullArtifactWriter``: DCP StorageWriter of the full artifact -- one consolidated, Hugging Face-shaped
safetensors (or torch.save) checkpoint, every tensor full-size under its global name -- written straight
from every rank's shards. Beside ``FsspecStorageWriter`` (partial checkpoints) as DCP's
``HuggingFaceStorageWriter`` is beside ``FileSystemWriter``; both share ``write/_base.FsspecWriterBase``
(location, metadata, manifest, sinks, failed-save clean-up).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

from smpckpt._gc import gc_paused
from smpckpt.errors import CheckpointError
from smpckpt.storage.format import _names, _wire
from smpckpt.storage.full._commit import (
    artifact_records,
    begin_full_save,
    commit_full,
    whole_tensor_metadata,
)
from smpckpt.storage.full._gather import gather_rank
from smpckpt.storage.full._layout import ArtifactLayout, RankFullData
from smpckpt.storage.full._marker import MarkerRefresher
from smpckpt.storage.full._write import _RankWriter, write_objects
from smpckpt.storage.full.options import FullOptions
from smpckpt.storage.write._base import FsspecWriterBase, WriterOptions
from smpckpt.storage.write._failed_save import folder_is_new

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["FullArtifactWriter"]


class FullArtifactWriter(FsspecWriterBase):
    """Write the full artifact of the state dict ``dcp.save`` is given to ``path`` (any fsspec URL).

    Call order inside ``dcp.save`` ("all" = every rank)::

        0) (all)         reset(checkpoint_id)            only when dcp.save gets checkpoint_id=
        1) (all)         storage_meta()
        2) (all)         set_up_storage_writer(is_coordinator, rank=, use_collectives=)
        3) (all)         prepare_local_plan(plan)         nothing to do: no I/O on every rank
        4) (coordinator) prepare_global_plan(plans)       refuses a committed or foreign folder, clears an
                                                          unfinished save's debris, takes the folder (the
                                                          in-progress marker, kept fresh until the commit),
                                                          lays the artifact out; POSIX: creates its files
        5) (all)         write_data(plan, planner)        POSIX: this rank's boxes at their offsets; object
                                                          stores: each file streamed by its owner rank, which
                                                          receives the other ranks' shard bytes
        6) (coordinator) finish(metadata, results)        the files checked and made durable, side files
                                                          (shard index, config.json), .metadata.<id>, then
                                                          the manifest (exclusive), then the marker goes

    A failed save: every rank calls ``discard_failed_save()`` (the API does); the coordinator removes the
    artifact it laid out, its marker last. The file names are fixed (``model.safetensors``...), so a
    folder holding a committed checkpoint is never written over: save under a new folder.

    Args (besides those of :class:`~smpckpt.storage.write._base.FsspecWriterBase`: ``path``,
    ``storage_options``, ``sync_files``, ``thread_count``, ``part_size``, ``max_parts_in_flight``,
    ``manifest_extra``, ``process_group`` -- on object stores shard bytes travel over it to each file's
    owner rank, so it must move CPU tensors: gloo):
        full: layout options (shard size, dtype cast, translation, ``config.json``...; :class:`FullOptions`).

    The partial writer's options (``overwrite``, ``format``, ``block_size``, ``object_file_size``,
    ``prefix_strategy``) are not taken: passing one is a ``TypeError`` naming it.
    """

    _KIND = "full"

    def __init__(
        self, path: str | os.PathLike[str], *, full: FullOptions | None = None, **options: Unpack[WriterOptions]
    ) -> None:
        if full is not None and not isinstance(full, FullOptions):
            raise TypeError(f"full must be a FullOptions, got {type(full).__name__}")
        self.full = full if full is not None else FullOptions()
        super().__init__(path, **options)

    def _open(self, path: str | os.PathLike[str]) -> None:
        if getattr(self, "_marker", None) is not None:  # reset() without the last save's discard
            self._stop_marker()
        super()._open(path)
        self._marker: MarkerRefresher | None = None  # coordinator: refreshes the in-progress marker
        self._layout: ArtifactLayout | None = None  # what prepare_global_plan laid out

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """(coordinator) Take the folder, lay out the artifact, create its files (POSIX) and tell each
        rank where its boxes go."""
        if any(not p.usable for p in plans):
            raise CheckpointError(
                f"{self.url}: full mode needs every rank's full plan, not cached (empty) ones: use "
                "ParallelSavePlanner(..., cache_scope='local') (the next save with this planner plans afresh)"
            )
        new_folder = folder_is_new(self.fs, self.path)
        self._save_id = save_id = _names.new_save_id()
        out, layout = begin_full_save(self, plans, save_id)
        self._marker = MarkerRefresher(self.fs, self.path, save_id, self)  # stopped at the commit or discard
        self._layout = layout
        self._attempt.begin(save_id, new_folder=new_folder, names=layout.names(self.full))
        return out

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """(coordinator) The artifact's records, the metadata, then the manifest (the commit)."""
        save_id, layout = self._save_id, self._layout
        if save_id is None or layout is None:
            raise CheckpointError("finish() called without prepare_global_plan() on this writer")
        records = artifact_records(self.fs, self.path, layout, self.full, sync=self.sync_files)
        with gc_paused():  # the check units of every rank, as objects: dropped before the collector resumes
            objects = whole_tensor_metadata(metadata, layout, _wire.open_results(results))
        files = sorted(records + objects, key=lambda f: f.name)
        manifest, _ = self._manifest(save_id, metadata, files, len(results), "raw")
        self._stop_marker()  # before the commit removes the marker: a late rewrite would bring it back
        commit_full(self.fs, self.path, self.url, manifest, sync=self.sync_files)
        self._used_save_ids.add(save_id)

    def discard_failed_save(self, error: BaseException | None = None) -> list[str]:
        self._stop_marker()
        return super().discard_failed_save(error)

    def written_files(self) -> list[str]:
        """The safetensors (or torch.save) files of the artifact being written (after prepare_global_plan)."""
        return sorted(f.name for f in self._layout.files) if self._layout is not None else []

    def _stop_marker(self) -> None:
        """(coordinator) Stop refreshing the in-progress marker (``_marker``)."""
        marker, self._marker = self._marker, None
        if marker is not None:
            marker.stop()

    def _write_rank(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        data = self._plan_data(plan, RankFullData)
        if data.files:  # object stores: each file streamed by its owner rank (the sinks borrow: see _open_sink)
            written = gather_rank(
                data, plan.items, planner, open_sink=self._open_sink, process_group=self.process_group
            )
        else:  # POSIX: every rank at its offsets
            with _RankWriter(self.path, data, plan.items, planner) as w:
                written = w.run(self.thread_count, self.process_group, sync=self.sync_files)
        written += write_objects(self.path, data, plan.items, planner, self.fs, self.sync_files)
        self._used_save_ids.add(data.save_id)
        return written

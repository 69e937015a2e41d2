"""Partial mode, one rank's data path: its write items split into data files, the files written
concurrently (each by :func:`~._write_file.write_file` through the writer's sink), made durable.

Called by :meth:`FsspecStorageWriter.write_data` on every rank, after the coordinator's
``prepare_global_plan`` put a :class:`RankPlanData` on each plan. A rank whose file fails removes the
files it wrote (they would be orphans: the save does not commit) and raises the first error.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.planner import SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from smpckpt.storage.backends._fs import fsync_dir, is_local, join, remove_files
from smpckpt.storage.backends._prefixes import FlatLayout, PrefixStrategy, folder_of
from smpckpt.storage.format import _names
from smpckpt.storage.write._write_file import object_store_bins, split_items

__all__ = ["RankPlanData", "write_partial_rank"]

#: writes one data file: (name, items, planner, rank) -> results (the writer's seam for fault tests)
WriteFile = Callable[[str, list[WriteItem], SavePlanner, int], list[WriteResult]]


@dataclasses.dataclass(frozen=True)
class RankPlanData:
    """Set by the coordinator on each rank's plan (SavePlan.storage_data); never stored."""

    save_id: str
    rank: int
    world_size: int = 1
    #: the coordinator's strategy, so every rank lays out its files alike
    prefixes: PrefixStrategy = dataclasses.field(default_factory=FlatLayout)
    #: the folder did not exist when the save began (local paths): a failed save removes it once empty
    new_folder: bool = False


def write_partial_rank(
    path: str,
    fs: Any,
    data: RankPlanData,
    items: list[WriteItem],
    planner: SavePlanner,
    *,
    write_file: WriteFile,
    thread_count: int,
    object_file_size: int,
    max_parts_in_flight: int,
    sync: bool,
    split_as_local: bool | None = None,
) -> list[WriteResult]:
    """Write this rank's ``items`` into its data files under ``path``; their results (the last of each
    file carries its manifest record). ``split_as_local``: size the files as for a local folder (``True``)
    or an object store (``False``) whatever ``fs`` is (default: as ``fs``): the fast tier writes locally
    the files a drain will upload."""
    local = is_local(fs)
    if local if split_as_local is None else split_as_local:
        buckets, workers = split_items(items, thread_count), thread_count
    else:
        # object stores: files of about one part each, one PutObject apiece, as many in flight as the
        # multipart uploads of thread_count files would have had parts
        bins, one_part = object_store_bins(items, thread_count, object_file_size)
        buckets, workers = split_items(items, bins), thread_count * (max_parts_in_flight if one_part else 1)
    # file n of this rank takes the prefix of its writer slot n % thread_count: slot k of rank r is
    # slot r * thread_count + k of the save, wherever it goes
    count = data.world_size * thread_count
    names = [
        _names.data_file_name(
            data.save_id, data.rank, n, data.prefixes(data.rank * thread_count + n % thread_count, count)
        )
        for n in range(len(buckets))
    ]
    folders = sorted({folder_of(path, n) for n in names})
    if local:
        # the checkpoint folder too, even on a rank with nothing to write: the coordinator's metadata
        # and manifest go there
        for folder in [path, *folders]:
            os.makedirs(folder, exist_ok=True)
    results: list[WriteResult] = []
    errors: list[BaseException] = []
    if not buckets:
        return results
    with concurrent.futures.ThreadPoolExecutor(min(len(buckets), workers), thread_name_prefix="smpckpt-write") as pool:
        futs = [pool.submit(write_file, name, part, planner, data.rank) for name, part in zip(names, buckets)]
        for f in futs:
            try:
                results.extend(f.result())
            except BaseException as exc:  # noqa: BLE001 - first error re-raised below
                errors.append(exc)
    if errors:
        # this rank's finished files are orphans now; remove them (best effort) and report
        remove_files(fs, [join(path, n) for n in names], within=path)
        raise errors[0]
    if local and sync:
        for folder in folders:  # the files' own folders, then the checkpoint folder holding them
            fsync_dir(folder)
        if folders != [path]:
            fsync_dir(path)
    return results

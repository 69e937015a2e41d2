"""Partial mode: what the coordinator's ``prepare_global_plan`` puts on each rank's plan for its data
path (``FsspecStorageWriter._write_rank``)."""

from __future__ import annotations

import dataclasses

from smpckpt.storage.backends._fs import FlatLayout, PrefixStrategy

__all__ = ["RankPlanData"]


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

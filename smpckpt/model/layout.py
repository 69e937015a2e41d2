"""Parallel layouts: how global ranks map to tensor-, data- and pipeline-parallel coordinates.

Rank order is TP fastest, then DP, then PP (as in Megatron)::

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

``pp_layers`` is the pipeline partition decision: how many transformer layers each stage holds. With
``pp_layers=(2, 2)`` stage 1 holds global layers 2 and 3, and its stage-local ``layers.0`` is saved
as ``layers.2``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from smpckpt.errors import SpecError

__all__ = ["ParallelLayout", "RankCoords", "AXES"]

#: Parallel axes a :class:`~smpckpt.ShardSpec` can name, in rank order (fastest first).
AXES = ("tp", "dp", "pp")


class RankCoords(NamedTuple):
    tp: int
    dp: int
    pp: int


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """Degrees of tensor (``tp``), pipeline (``pp``) and data (``dp``) parallelism.

    Args:
        tp: tensor-parallel degree.
        pp: pipeline-parallel degree (number of stages).
        dp: data-parallel degree (replicas of each model shard).
        pp_layers: layers held by each stage, one count per stage (the partition decision). ``None``
            means the layout records no partition and keys are not renamed by stage.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    _: dataclasses.KW_ONLY
    pp_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for axis in AXES:
            value = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecError(f"ParallelLayout.{axis} must be a positive int, got {value!r}")
        if self.pp_layers is not None:
            layers = tuple(self.pp_layers)
            object.__setattr__(self, "pp_layers", layers)
            if len(layers) != self.pp:
                raise SpecError(f"pp_layers has {len(layers)} entries but pp={self.pp}: give one layer count per stage")
            if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in layers):
                raise SpecError(f"pp_layers must be non-negative ints, got {layers!r}")

    # -- geometry ---------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def check_world_size(self, world_size: int, where: str) -> None:
        """Raise :class:`SpecError` unless ``world_size`` ranks (as ``where`` counts them) fit this layout.

        The one place a world size is compared with a layout: the API, both planners' rank
        resolution and the save planner's global plan all call it.
        """
        if world_size != self.world_size:
            raise SpecError(f"{where} has {world_size} ranks but the layout {self} describes {self.world_size}")

    def degree(self, axis: str) -> int:
        if axis not in AXES:
            raise SpecError(f"unknown parallel axis {axis!r}; expected one of {AXES}")
        return int(getattr(self, axis))

    def coords(self, rank: int) -> RankCoords:
        """Coordinates of global ``rank``."""
        if not 0 <= rank < self.world_size:
            raise SpecError(f"rank {rank} is outside a world of {self.world_size} ({self})")
        return RankCoords(rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp))

    def rank_of(self, tp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """Global rank at the given coordinates."""
        for axis, value in (("tp", tp), ("dp", dp), ("pp", pp)):
            if not 0 <= value < self.degree(axis):
                raise SpecError(f"{axis} coordinate {value} out of range for {self}")
        return tp + self.tp * (dp + self.dp * pp)

    def stage_ranks(self, pp_rank: int) -> list[int]:
        """All ranks of pipeline stage ``pp_rank``, in rank order."""
        base = pp_rank * self.tp * self.dp
        return list(range(base, base + self.tp * self.dp))

    # -- pipeline partition -----------------------------------------------------------------------
    def layer_offset(self, pp_rank: int) -> int:
        """Global index of stage ``pp_rank``'s first layer (0 when no partition is recorded)."""
        return 0 if self.pp_layers is None else sum(self.pp_layers[:pp_rank])

    def stage_layers(self, pp_rank: int) -> range:
        """Global layer indices held by stage ``pp_rank``."""
        if self.pp_layers is None:
            raise SpecError("this layout records no pp_layers partition")
        start = self.layer_offset(pp_rank)
        return range(start, start + self.pp_layers[pp_rank])

    # -- records ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "pp_layers": list(self.pp_layers) if self.pp_layers is not None else None,
            "rank_order": "tp,dp,pp",
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ParallelLayout:
        layers = data.get("pp_layers")
        return cls(**{axis: int(data[axis]) for axis in AXES}, pp_layers=tuple(layers) if layers is not None else None)

    @classmethod
    def from_device_mesh(
        cls,
        mesh: Any,
        *,
        tp_dim: str = "tp",
        dp_dim: str = "dp",
        pp_dim: str = "pp",
        pp_layers: Sequence[int] | None = None,
    ) -> ParallelLayout:
        """Build a layout from a named ``DeviceMesh``; absent dimension names count as degree 1.

        The mesh's global rank order must match ours (TP fastest, then DP, then PP); a mesh laid out
        differently is refused rather than silently mislabelled.
        """
        names = tuple(mesh.mesh_dim_names or ())
        known = {tp_dim, dp_dim, pp_dim}
        extra = [n for n in names if n not in known]
        if extra:
            raise SpecError(f"mesh dimensions {extra} are not tp/dp/pp ({tp_dim!r}, {dp_dim!r}, {pp_dim!r})")

        def size(name: str) -> int:
            return int(mesh.size(names.index(name))) if name in names else 1

        pp_layers = tuple(pp_layers) if pp_layers is not None else None
        layout = cls(tp=size(tp_dim), dp=size(dp_dim), pp=size(pp_dim), pp_layers=pp_layers)
        grid = mesh.mesh
        order = [n for n in (pp_dim, dp_dim, tp_dim) if n in names]
        perm = [names.index(n) for n in order]
        flat = grid.permute(*perm).reshape(-1).tolist() if perm else [int(grid.item())]
        if flat != list(range(layout.world_size)):
            raise SpecError(
                f"DeviceMesh rank order {flat} differs from smpckpt's (tp fastest, then dp, then pp); "
                "build the mesh as (pp, dp, tp) over ranks 0..N-1"
            )
        return layout

"""``PeerFetchingReader``: read a fast-tier copy from this node's folder, first fetching from peers the
files this node lacks for what its ranks will read (a lost node's parts, or another node's replica).

Call order inside ``dcp.load`` as :class:`~smpckpt.storage.FsspecStorageReader`'s, plus::

    4) (coordinator) prepare_global_plan(plans)   which files each node lacks for its ranks' reads:
                                                  one copy per node, from the least loaded holder
    5) (all)         read_data(plan, planner)     first the schedule (broadcast), the transfers
                                                  (:mod:`.transfer`) and one agreement on their
                                                  errors; then the reads, checksums verified

Only the files some rank of a node reads from are fetched, whole, so a resume after a lost node moves
that node's own parts, the files holding what every rank reads (``user_content`` and the replicated
pieces DP ranks read from their owner, in rank 0's files) and whatever a changed layout reads
elsewhere -- not the whole checkpoint. Fetched files stay
in the node's folder: the copy is healed for the next resume. Every rank's folder must already hold
the manifest and metadata (the API sends them before the load).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from smpckpt.errors import CheckpointError
from smpckpt.storage.read.reader import FsspecStorageReader
from smpckpt.storage.tier.transfer import Transfer, fetch_transfers, run_transfers

__all__ = ["PeerFetchingReader"]


class PeerFetchingReader(FsspecStorageReader):
    """A fast-tier copy at ``path`` (this node's folder), completed from peers while loading.

    Args (besides :class:`~smpckpt.storage.FsspecStorageReader`'s):
        group: a gloo group over the ranks ``dcp.load`` runs on (moves CPU tensors).
        streams: gloo groups over the same ranks that move the files (default: ``group``).
        ranks: the global rank of each rank of the load's process group, in group order.
        rank: this process's global rank.
        local_world_size: ranks per node (``r // local_world_size`` is rank ``r``'s node).
        held_by: file name -> global ranks whose node folder holds it (the API's scan of every node).
        sync: fsync the files fetched.
    """

    def __init__(
        self,
        path: str,
        *,
        group: Any,
        ranks: Sequence[int],
        rank: int,
        local_world_size: int,
        held_by: Mapping[str, Sequence[int]],
        sync: bool = False,
        streams: Sequence[Any] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(path, **kwargs)
        self._group, self._ranks, self._rank = group, list(ranks), rank
        self._streams = tuple(streams) or (group,)
        self._lws, self._held_by, self._sync = local_world_size, held_by, sync
        self._schedule: list[Transfer] = []
        #: every transfer of the load (all ranks'): file, from rank, to rank
        self.fetched: tuple[Transfer, ...] = ()

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """(coordinator) The files each node lacks for its ranks' reads, and who sends them."""
        plans = super().prepare_global_plan(plans)
        needs: dict[int, set[str]] = {}
        for i, plan in enumerate(plans):
            names = needs.setdefault(self._ranks[i], set())
            for item in plan.items:
                name = getattr(self.storage_data.get(item.storage_index), "relative_path", None)
                if isinstance(name, str):
                    names.add(name)
        sizes = {name: rec.size for name, rec in self._records.items()}
        unknown = sorted({n for names in needs.values() for n in names} - set(sizes))
        if unknown:
            raise CheckpointError(f"{self.url}: the metadata names files the manifest does not list: {unknown[:5]}")
        self._schedule = fetch_transfers(needs, self._held_by, sizes, local_world_size=self._lws)
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """(all ranks) Fetch what this node lacks (nothing may raise before the broadcast: every rank
        is in it), agree on the transfers' errors, then read as the partial reader does."""
        if self._group is not None and len(self._ranks) > 1:
            box: list[Any] = [self._schedule]
            dist.broadcast_object_list(box, src=self._ranks[0], group=self._group)
            schedule: list[Transfer] = box[0]
            outcome = run_transfers(
                schedule,
                rank=self._rank,
                group=self._streams,
                read_folder=self.path,
                write_folder=self.path,
                sync=self._sync,
            )
            errors: list[Any] = [None] * len(self._ranks)
            dist.all_gather_object(errors, outcome.errors, group=self._group)
            failed = [f"rank {r}: {e}" for r, errs in zip(self._ranks, errors, strict=True) for e in errs]
            if failed:
                raise CheckpointError(
                    f"fetching fast-tier parts from peers failed ({len(failed)} file(s)): {'; '.join(failed[:5])}"
                )
            self.fetched = tuple(schedule)
        return super().read_data(plan, planner)

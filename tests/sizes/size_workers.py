"""Rank functions for tests/sizes (2 gloo ranks at TP=2): test_real_sizes.py and test_gather_past_2_gib.py."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from size_model import Big, same

from smpckpt import ParallelLayout, ShardSpec, resume_from_checkpoint, save_checkpoint

LAYOUT = ParallelLayout(tp=2)
SPEC = {"up.weight": ShardSpec(dim=0)}


def reshard_then_save(rank: int, world: int, tp1_root: str, tp2_root: str) -> dict[str, bool]:
    """Resume the TP=1 checkpoint of the MLP weight at TP=2 (each rank reads its 5504 rows: 22.5 M
    elements, still past 2**24), then save at TP=2."""
    want = Big(tp=2, tp_rank=rank, seed=1, embedding=False)
    got = Big(tp=2, tp_rank=rank, seed=7, embedding=False)
    resume_from_checkpoint(tp1_root, model=got, layout=LAYOUT, specs=SPEC)
    exact = same(got, want)
    save_checkpoint(tp2_root, "tp2", model=want, layout=LAYOUT, specs=SPEC)
    dist.barrier()
    return {"resharded_exact": exact}


def gather_export(rank: int, world: int, root: str, rows: list[int], cols: int) -> dict[str, int]:
    """A full export of one int32 tensor split on dim 0 unevenly (``rows`` per rank: every element holds
    its flat index) by gather-to-owner on POSIX, which the package uses only for object stores: the
    coordinator's planning is made to lay the save out for it, as ``benchmarks/bench_full_algorithms.py``
    does (the package has no option for it). Returns the ``gather_rank`` calls and the largest message
    this rank sent (bytes)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from smpckpt.planners import ParallelSavePlanner
    from smpckpt.storage import FullArtifactWriter, FullOptions
    from smpckpt.storage.full import _commit, writer

    plan, gather = _commit.plan_artifact, writer.gather_rank
    calls, sent = [0], [0]
    send = dist.send

    def counted_gather(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return gather(*args, **kwargs)

    def sized_send(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sent[0] = max(sent[0], tensor.numel() * tensor.element_size())
        return send(tensor, *args, **kwargs)

    _commit.plan_artifact = lambda *a, **k: plan(*a, **{**k, "gather": True})  # type: ignore[assignment]
    _commit.create_files = lambda *a, **k: None  # type: ignore[assignment]  # the owners' sinks create them
    writer.gather_rank = counted_gather  # type: ignore[assignment]
    dist.send = sized_send  # type: ignore[assignment]
    r0 = sum(rows[:rank])
    piece = torch.arange(r0 * cols, (r0 + rows[rank]) * cols, dtype=torch.int32).view(rows[rank], cols)
    specs = {"model.w": ShardSpec(dim=0, sizes=tuple(rows))}
    planner = ParallelSavePlanner(ParallelLayout(tp=world), specs, rank=rank)
    # gather-to-owner swaps nothing: no row swap planned (as the benchmark's gather case)
    dcp.save(
        {"model": {"w": piece}},
        storage_writer=FullArtifactWriter(root, full=FullOptions(row_swap_below=0)),
        planner=planner,
    )
    return {"gather_calls": calls[0], "max_sent": sent[0]}

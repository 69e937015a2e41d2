"""Rank functions for the multi-process full-checkpoint tests (module level, so spawned ranks import them).

The TP model, its specs and the scenario/teardown conventions are the API suite's (``tests/api``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "api"))

import api_workers  # noqa: E402
import tp_model  # noqa: E402

import smpckpt.api._save  # noqa: E402
from smpckpt import ParallelLayout, ShardSpec, resume_from_checkpoint, save_checkpoint  # noqa: E402
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner  # noqa: E402
from smpckpt.storage import (  # noqa: E402
    FsspecStorageReader,
    FullArtifactWriter,
    FullOptions,
    _full_exchange,  # noqa: E402
)

TP2_DP2 = ParallelLayout(tp=2, dp=2)
TRAIN_STEPS = 2


def save_and_reshard_world(rank: int, world: int, root: str) -> dict[str, Any]:
    """tp=2 x dp=2: train, save full ("f") and partial ("p") of the same state; then resume "f" under
    tp=4 and under dp=4 (fresh models from another seed). Each rank returns its local tensors."""
    results: dict[str, Any] = {"coords": TP2_DP2.coords(rank)}

    def save() -> Any:
        ctx, model, opt = tp_model.build(TP2_DP2)
        losses = [tp_model.train_step(ctx, model, opt, s) for s in range(TRAIN_STEPS)]
        kw = dict(model=model, optimizer=opt, user_content={"step": TRAIN_STEPS}, layout=TP2_DP2, specs=tp_model.SPECS)
        save_checkpoint(root, "f", partial=False, include_optimizer=True, **kw)
        save_checkpoint(root, "p", **kw)
        state = tp_model.local_state(model, opt)
        next_loss = tp_model.train_step(ctx, model, opt, TRAIN_STEPS)
        return {"losses": losses, "state": state, "next_loss": next_loss}

    api_workers._scenario(results, "save", save)

    for name, layout in (("tp4", ParallelLayout(tp=4)), ("dp4", ParallelLayout(dp=4))):

        def resume(layout: ParallelLayout = layout) -> Any:
            _, model, opt = tp_model.build(layout, seed=99)
            before = tp_model.local_state(model, opt)
            uc = resume_from_checkpoint(
                root, "f", partial=False, model=model, optimizer=opt, layout=layout, specs=tp_model.SPECS
            )
            return {"uc": uc, "before": before, "state": tp_model.local_state(model, opt)}

        api_workers._scenario(results, name, resume)
    return results


class _KillingWriter(FullArtifactWriter):
    """Ends its own process in ``write_data`` of the save into ``kill_tag``, on rank ``victim``, before
    or after writing that rank's boxes: ``os._exit`` -- no ``finally``, no atexit, no process-group
    teardown; the kernel closes its sockets, as for SIGKILL. (Exit status 0: the harness reports a
    rank that died by a signal by terminating the survivors before they can report.)"""

    victim = -1
    when = "before"
    kill_tag = ""

    def write_data(self, plan: Any, planner: Any) -> Any:
        if dist.get_rank() == self.victim and os.path.basename(self.path.rstrip("/")) == self.kill_tag:
            if self.when == "after":
                super().write_data(plan, planner).wait()  # this rank's bytes are on disk
            os._exit(0)
        return super().write_data(plan, planner)


def killed_during_save(rank: int, world: int, root: str, victim: int, when: str) -> str:
    """tp=2: a committed full save "k1" of the seed-0 model, then a second full save "k2" (another
    seed) during which rank ``victim`` is killed. Survivors leave their error text in
    ``{root}/rank{r}.txt`` (the harness drops their values when a rank died)."""
    layout = ParallelLayout(tp=2)
    _, model, _ = tp_model.build(layout, seed=0)
    save_checkpoint(root, "k1", partial=False, model=model, layout=layout, specs=tp_model.SPECS, user_content="k1")
    dist.barrier()
    _KillingWriter.victim, _KillingWriter.when, _KillingWriter.kill_tag = victim, when, "k2"
    smpckpt.api._save.FullArtifactWriter = _KillingWriter  # type: ignore[misc]  # this process only
    _, model2, _ = tp_model.build(layout, seed=1)
    text = api_workers._expect_error(
        lambda: save_checkpoint(root, "k2", partial=False, model=model2, layout=layout, specs=tp_model.SPECS)
    )
    with open(os.path.join(root, f"rank{rank}.txt"), "w") as f:
        f.write(text)
    return text


def s3_full_world(rank: int, world: int, root: str, options: dict[str, Any], local_root: str) -> dict[str, Any]:
    """tp=2 on S3: a full save (each file streamed by its owner rank, which receives the other rank's
    shard bytes), the same state saved full on local disk (ranks writing at offsets), then a full resume
    from S3 into a fresh model. Returns this rank's state before and after."""
    layout = ParallelLayout(tp=2)
    ctx, model, opt = tp_model.build(layout, seed=0)
    tp_model.train_step(ctx, model, opt, 0)
    kw = dict(layout=layout, specs=tp_model.SPECS, storage_options=options)
    save_checkpoint(
        root, "f", partial=False, model=model, optimizer=opt, include_optimizer=True, max_shard_size=2000, **kw
    )
    save_checkpoint(
        local_root,
        "f",
        partial=False,
        model=model,
        optimizer=opt,
        include_optimizer=True,
        layout=layout,
        specs=tp_model.SPECS,
    )
    saved = tp_model.local_state(model, opt)
    _, fresh, fresh_opt = tp_model.build(layout, seed=5)
    tp_model.train_step(ctx, fresh, fresh_opt, 0)  # optimizer state exists to be overwritten
    resume_from_checkpoint(root, "f", partial=False, model=fresh, optimizer=fresh_opt, **kw)
    return {"saved": saved, "loaded": tp_model.local_state(fresh, fresh_opt)}


# -- row-block swaps (storage/full/_exchange.py) ---------------------------------------------------
SWAP_SPECS = {
    "m.col": ShardSpec(1),  # [7, 12]: rows of 16 bytes per rank at tp=3, 7 rows into blocks of 2, 2, 3
    "m.wide": ShardSpec(1),  # [64, 96]: several 4 KiB check units per block
    "m.fused": ShardSpec(1, view=(3, -1, 8)),  # [18, 8] viewed [3, 6, 8]: q, k and v blocks
    "m.row": ShardSpec(0),  # [9, 5]: one run per rank, never swapped
}


def swap_globals() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    shapes = {"m.col": (7, 12), "m.wide": (64, 96), "m.fused": (18, 8), "m.row": (9, 5), "m.norm": (12,)}
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def swap_local(rank: int, world: int) -> dict[str, torch.Tensor]:
    g = swap_globals()
    out = {}
    for key, t in g.items():
        if key == "m.fused":
            v = t.view(3, -1, 8)
            n = v.shape[1] // world
            out[key] = v[:, rank * n : (rank + 1) * n].contiguous().view(-1, 8)
        elif key in ("m.col", "m.wide"):
            out[key] = t.chunk(world, 1)[rank].contiguous()
        elif key == "m.row":
            out[key] = t.chunk(world, 0)[rank].contiguous()
        else:
            out[key] = t.clone()
    return {k.removeprefix("m."): v for k, v in out.items()}


class _RecordingWriter(FullArtifactWriter):
    """Records how many row-block swaps this rank's plan holds."""

    swaps = -1
    batches = -1

    def write_data(self, plan: Any, planner: Any) -> Any:
        self.swaps = len(plan.storage_data.exchanges)
        self.batches = len({e.batch for e in plan.storage_data.exchanges})
        return super().write_data(plan, planner)


def row_swap_world(rank: int, world: int, root: str) -> dict[str, Any]:
    """tp=``world``: the same state saved full with swaps (default), without (``row_swap_below=0``) and
    cast to bf16; the swapped artifact loaded back into the saving layout. Returns swap counts, the
    loaded tensors and the read accounting."""
    layout = ParallelLayout(tp=world)
    local = swap_local(rank, world)
    out: dict[str, Any] = {"swaps": {}, "batches": {}}
    default_batch = _full_exchange.SWAP_BATCH_BYTES
    for name, opts in (
        ("swap", FullOptions(check_block=4096)),
        ("one_per_batch", FullOptions(check_block=4096)),
        ("plain", FullOptions(check_block=4096, row_swap_below=0)),
        ("bf16", FullOptions(check_block=4096, dtype=torch.bfloat16)),
        ("torch", FullOptions(check_block=4096, format="torch_save")),
    ):
        # every swap a batch of its own (one message per tensor and pair of ranks), as before batching
        _full_exchange.SWAP_BATCH_BYTES = 1 if name == "one_per_batch" else default_batch
        writer = _RecordingWriter(os.path.join(root, name), full=opts)
        try:
            dcp.save({"m": local}, storage_writer=writer, planner=ParallelSavePlanner(layout, SWAP_SPECS, rank=rank))
        finally:
            _full_exchange.SWAP_BATCH_BYTES = default_batch
        out["swaps"][name], out["batches"][name] = writer.swaps, writer.batches
    dest = {k: torch.full_like(v, -7.0) for k, v in local.items()}
    # a request per row always (request_cost_bytes=0): the column shards' short rows would stream
    # (gaps included) by the cost model; this pins that the swapped artifact's units are exactly the
    # shards' bytes, read and verified where they land
    reader = FsspecStorageReader(os.path.join(root, "swap"), request_cost_bytes=0)
    dcp.load({"m": dest}, storage_reader=reader, planner=ParallelLoadPlanner(layout, SWAP_SPECS, rank=rank))
    out["local"], out["loaded"] = local, dest
    stats = reader.last_read_stats
    out["read"] = (stats.bytes_needed, stats.bytes_read) if stats is not None else None
    return out


def nonstrict_resume_warning_as_error(rank: int, world: int, root: str) -> dict[str, Any]:
    """A full save, then a ``strict=False`` resume that skips keys, with warnings turned into errors on rank
    0 only (``pytest -W error`` on the launcher): the skipped-keys warning must fail every rank, not leave
    the others waiting in the next collective. The same for the warning of a full save given an optimizer it
    leaves out (``dropped``; ``told``: how many times each rank said it before, warnings not errors)."""
    import warnings

    from torch import nn

    layout = ParallelLayout(dp=world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        save_checkpoint(root, "big", partial=False, model=model, optimizer=opt, layout=layout)
    out: dict[str, Any] = {"told": sum("include_optimizer=True" in str(w.message) for w in said)}
    other = nn.Sequential(nn.Linear(4, 4), nn.Identity(), nn.Linear(4, 2))
    if rank == 0:
        warnings.simplefilter("error")
    for name, call in (
        (
            "resume",
            lambda: resume_from_checkpoint(root, "big", partial=False, model=other, strict=False, layout=layout),
        ),
        ("dropped", lambda: save_checkpoint(root, "again", partial=False, model=model, optimizer=opt, layout=layout)),
    ):
        try:
            call()
            out[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - what each rank saw is the result
            out[name] = f"{type(exc).__name__}: {exc}"
    return out

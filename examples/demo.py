"""``python3 examples/demo.py``: train a TP x PP x DP GPT on CPU processes, save, reload elsewhere, verify.

1. Spawns ``tp*pp*dp`` gloo ranks on 127.0.0.1 (default 2x2x2 = 8), trains the tiny GPT of
   :mod:`demo_model` (beside this file) a few steps and saves a partial (per-rank shard) checkpoint with
   ``dcp.save`` + :class:`~smpckpt.planners.ParallelSavePlanner`.
2. Spawns a world of another layout (default 4x1x1 = 4 ranks) and loads the checkpoint with
   :class:`~smpckpt.planners.ParallelLoadPlanner`, resharding.
3. Loads it once more at tp=pp=dp=1 in this process, with no process group.

Every parameter, Adam state tensor and learning rate is gathered to global tensors and compared with
``torch.equal`` against what was saved; logits are compared bit-exactly when the layout is unchanged
and within a tolerance across TP degrees (reduction order); one more training step must give the same
loss. Exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["main", "parse_layout", "layout_for_world", "LOGIT_TOLERANCE"]

#: Logits/loss tolerance across TP degrees (differences of ~2e-6 are typical for this model).
LOGIT_TOLERANCE = 1e-4
EVAL_STEP = 1000
LOAD_SEED = 777  #: destinations start from other weights (and lr=0): a load that did nothing fails


# -- layouts ---------------------------------------------------------------------------------------
def parse_layout(text: str) -> tuple[int, int, int]:
    """``"2x2x2"`` (tp x pp x dp) -> ``(2, 2, 2)``."""
    parts = text.lower().replace(",", "x").split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"layout must be TPxPPxDP with positive ints, e.g. 2x2x2; got {text!r}")
    tp, pp, dp = (int(p) for p in parts)
    return tp, pp, dp


def layout_for_world(world: int) -> tuple[int, int, int]:
    """A (tp, pp, dp) for ``world`` ranks: tp=2 and pp=2 where they divide, the rest data parallel."""
    if world < 1:
        raise argparse.ArgumentTypeError(f"--world must be positive, got {world}")
    tp = 2 if world % 2 == 0 else 1
    pp = 2 if (world // tp) % 2 == 0 else 1
    return tp, pp, world // (tp * pp)


def _fmt(layout: tuple[int, int, int]) -> str:
    tp, pp, dp = layout
    return f"tp={tp} pp={pp} dp={dp}"


# -- launching ranks -------------------------------------------------------------------------------
def _shutdown_group() -> bool:
    """A rank's last distributed step, after its work succeeded: barrier, then destroy the groups.

    The barrier keeps any rank from tearing down while a peer is still inside a collective. Destroying
    the groups joins gloo's worker threads while Python is still running: a rank that exits with them
    alive can abort in interpreter shutdown (SIGABRT, "terminate called without an active exception")
    after a good save. User scripts should end their ranks the same way. False when the barrier
    failed (a peer failed or left; its own report says why) and the broken group was left as it is.
    """
    import gc

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return True
    try:
        dist.barrier()
    except Exception:  # noqa: BLE001 - the peer's failure is the one to report
        return False
    dist.destroy_process_group()
    gc.collect()  # groups held only by reference cycles go now, not in interpreter shutdown
    return True


def _rank_entry(rank: int, world: int, tmp: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    clean = False
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
        result: Any = ("ok", fn(rank, world, *args))
        clean = _shutdown_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent with its traceback
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    if not clean:
        # After a failure there is no barrier or destroy: a collective may still be in flight here
        # (destroying would wait on it) and the peers may be inside another one. Leave at once: the
        # closed sockets fail any peer still waiting on this rank, and skipping interpreter shutdown
        # keeps the live gloo threads from turning the reported error into an abort.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _launch(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 110.0) -> Any:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks; rank 0's return value."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with tempfile.TemporaryDirectory(prefix="smpckpt-demo-world-") as tmp:
        ctx = mp.start_processes(
            _rank_entry, args=(world, tmp, fn, args), nprocs=world, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    if proc.is_alive():
                        proc.kill()
                break
        results, failures = [], []
        for rank in range(world):
            path = os.path.join(tmp, f"rank{rank}.pkl")
            if not os.path.exists(path):
                failures.append(f"rank {rank}: no result (died or timed out after {timeout:.0f} s)")
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                failures.append(f"rank {rank}: {value}")
            results.append(value)
        if failures:
            raise RuntimeError("a rank failed:\n" + "\n".join(failures))
        return results[0]


# -- what the ranks do -----------------------------------------------------------------------------
@dataclasses.dataclass
class WorldReport:
    """Rank 0's report of one world."""

    state: dict[str, torch.Tensor]  #: gathered global params, Adam state, learning rates
    logits: torch.Tensor
    next_loss: float  #: loss of one more training step
    seconds: float  #: the slowest rank's dcp.save / dcp.load time


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(f"      {text}", flush=True)


def _slowest(seconds: float) -> float:
    import torch.distributed as dist

    if not dist.is_initialized():
        return seconds
    value = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _save_rank(
    rank: int, world: int, cfg: Any, layout: tuple[int, int, int], path: str, steps: int
) -> WorldReport | None:
    import demo_model as dm

    ctx = dm.build_context(dm.make_layout(cfg, *layout))
    stage = dm.build_model(cfg, ctx)
    optim = dm.build_optimizer(cfg, stage)
    for step in range(steps):
        loss = dm.train_step(cfg, stage, optim, ctx, step)
        _say(rank, f"step {step + 1}/{steps}  loss {loss:.4f}")
    state = dm.gather_global_state(cfg, stage, optim, ctx)
    logits = dm.pipeline_logits(cfg, stage, ctx, dm.make_batch(cfg, EVAL_STEP)[0])
    start = time.perf_counter()
    dm.save_checkpoint(cfg, stage, optim, ctx, path)
    seconds = _slowest(time.perf_counter() - start)
    next_loss = dm.train_step(cfg, stage, optim, ctx, steps)
    return WorldReport(state, logits, next_loss, seconds) if rank == 0 else None


def _load_rank(
    rank: int, world: int, cfg: Any, layout: tuple[int, int, int], path: str, steps: int
) -> WorldReport | None:
    import demo_model as dm

    ctx = dm.build_context(dm.make_layout(cfg, *layout))
    stage = dm.build_model(cfg, ctx, seed=LOAD_SEED)
    optim = dm.build_optimizer(cfg, stage, lr=0.0)
    start = time.perf_counter()
    dm.load_checkpoint(cfg, stage, optim, ctx, path)
    seconds = _slowest(time.perf_counter() - start)
    state = dm.gather_global_state(cfg, stage, optim, ctx)
    logits = dm.pipeline_logits(cfg, stage, ctx, dm.make_batch(cfg, EVAL_STEP)[0])
    next_loss = dm.train_step(cfg, stage, optim, ctx, steps)
    return WorldReport(state, logits, next_loss, seconds) if rank == 0 else None


def _load_here(cfg: Any, path: str, steps: int) -> WorldReport:
    """Load at tp=pp=dp=1 in this process, without a process group."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        report = _load_rank(0, 1, cfg, (1, 1, 1), path, steps)
    if report is None:
        raise RuntimeError("single-process load returned no report")
    return report


# -- checking --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Check:
    name: str
    state_problems: list[str]
    logits_diff: float
    logits_ok: bool
    loss_ok: bool
    bitwise_logits: bool

    @property
    def ok(self) -> bool:
        return not self.state_problems and self.logits_ok and self.loss_ok


def _check(name: str, saved: WorldReport, loaded: WorldReport, same_layout: bool) -> Check:
    from demo_model import compare_states

    problems = compare_states(saved.state, loaded.state)
    diff = float((saved.logits.double() - loaded.logits.double()).abs().max())
    if same_layout:
        logits_ok = torch.equal(saved.logits, loaded.logits)
        loss_ok = saved.next_loss == loaded.next_loss
    else:
        logits_ok = torch.allclose(saved.logits, loaded.logits, atol=LOGIT_TOLERANCE, rtol=LOGIT_TOLERANCE)
        loss_ok = abs(saved.next_loss - loaded.next_loss) <= LOGIT_TOLERANCE * max(1.0, abs(saved.next_loss))
    return Check(name, problems, diff, logits_ok, loss_ok, same_layout)


def _print_check(check: Check, n_tensors: int, seconds: float, nbytes: int, next_loss: float) -> None:
    exact = n_tensors - len(check.state_problems)
    how = "bit-exact" if check.bitwise_logits else f"max |diff| {check.logits_diff:.1e} <= {LOGIT_TOLERANCE:g}"
    print(f"      loaded in {seconds:.2f} s ({_gbps(nbytes, seconds)})", flush=True)
    print(
        f"      {exact}/{n_tensors} global tensors bit-exact; logits {how}: "
        f"{'ok' if check.logits_ok else 'MISMATCH'}; next-step loss {next_loss:.6f}: "
        f"{'ok' if check.loss_ok else 'MISMATCH'}",
        flush=True,
    )
    for problem in check.state_problems[:10]:
        print(f"      MISMATCH {problem}", flush=True)


def _gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / max(seconds, 1e-9) / 1e9:.3f} GB/s"


def _checkpoint_stats(path: str) -> tuple[int, int, int]:
    """``(data bytes, files, tensors recorded in the metadata)``."""
    from demo_model import storage_reader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    names = [n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n))]
    data = sum(os.path.getsize(os.path.join(path, n)) for n in names if not n.startswith("."))
    meta = storage_reader(path).read_metadata().state_dict_metadata
    tensors = sum(1 for m in meta.values() if isinstance(m, TensorStorageMetadata))
    return data, len(names), tensors


# -- main ------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 examples/demo.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="checkpoint folder (kept); default: a temporary folder, removed at exit")
    p.add_argument("--world", type=int, help="save world size (picks tp=2, pp=2 where they divide; the rest dp)")
    p.add_argument("--save", type=parse_layout, default=None, metavar="TPxPPxDP", help="save layout (default 2x2x2)")
    p.add_argument(
        "--load", type=parse_layout, default=(4, 1, 1), metavar="TPxPPxDP", help="reload layout (default 4x1x1)"
    )
    p.add_argument("--steps", type=int, default=3, help="training steps before the save (default 3)")
    p.add_argument("--layers", type=int, default=4, help="transformer layers (default 4)")
    p.add_argument("--d-model", type=int, default=32, help="model width (default 32); larger gives more bytes")
    return p


def _config(args: argparse.Namespace) -> Any:
    from demo_model import GPTConfig

    d = args.d_model
    return GPTConfig(d_model=d, attn_width=d, d_ff=2 * d, n_layers=args.layers)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.save is not None and args.world is not None:
        _parser().error("give --save or --world, not both")
    save_layout = args.save or (layout_for_world(args.world) if args.world else (2, 2, 2))
    load_layout: tuple[int, int, int] = args.load
    cfg = _config(args)
    import demo_model as dm

    from smpckpt.errors import SpecError

    for layout in (save_layout, load_layout):
        try:
            dm.make_layout(cfg, *layout)  # validates pp against the layer count
            cfg.check_tp(layout[0])
        except SpecError as exc:
            _parser().error(f"layout {_fmt(layout)} does not fit the model: {exc}")
        if cfg.batch % layout[2]:
            _parser().error(f"layout {_fmt(layout)}: dp must divide the batch of {cfg.batch}")

    out = args.out or tempfile.mkdtemp(prefix="smpckpt-demo-")
    path = os.path.abspath(out)
    started = time.perf_counter()
    try:
        return _run(cfg, save_layout, load_layout, path, args.steps, started)
    finally:
        if not args.out:
            shutil.rmtree(path, ignore_errors=True)


def _run(
    cfg: Any,
    save_layout: tuple[int, int, int],
    load_layout: tuple[int, int, int],
    path: str,
    steps: int,
    started: float,
) -> int:
    import demo  # this file as a module: spawned ranks find its functions by name, not as __main__
    from demo_model import global_shapes

    n_params = sum(torch.Size(s).numel() for s in global_shapes(cfg).values())
    print(
        f"smpckpt demo: GPT with {cfg.n_layers} layers, d={cfg.d_model}, vocab={cfg.vocab} "
        f"({n_params:,} parameters + Adam state), checkpoint in {path}",
        flush=True,
    )

    world = save_layout[0] * save_layout[1] * save_layout[2]
    print(
        f"[1/3] training at {_fmt(save_layout)} on {world} processes, then dcp.save + ParallelSavePlanner", flush=True
    )
    saved: WorldReport = _launch(demo._save_rank, world, cfg, save_layout, path, steps)
    nbytes, nfiles, ntensors = _checkpoint_stats(path)
    print(
        f"      saved {ntensors} tensors, {nbytes / 1e6:.2f} MB in {nfiles} files, "
        f"{saved.seconds:.2f} s ({_gbps(nbytes, saved.seconds)})",
        flush=True,
    )

    world = load_layout[0] * load_layout[1] * load_layout[2]
    how = "same layout: fast path" if load_layout == save_layout else "ParallelLoadPlanner reshards"
    print(f"[2/3] loading at {_fmt(load_layout)} on {world} processes ({how})", flush=True)
    loaded = _launch(demo._load_rank, world, cfg, load_layout, path, steps)
    first = _check(f"{_fmt(load_layout)}", saved, loaded, load_layout == save_layout)
    _print_check(first, len(saved.state), loaded.seconds, nbytes, loaded.next_loss)

    print("[3/3] loading at tp=1 pp=1 dp=1 in this process (no process group)", flush=True)
    here = _load_here(cfg, path, steps)
    second = _check("tp=1 pp=1 dp=1", saved, here, save_layout == (1, 1, 1))
    _print_check(second, len(saved.state), here.seconds, nbytes, here.next_loss)

    exact = not first.state_problems and not second.state_problems
    ok = first.ok and second.ok
    print("Summary", flush=True)
    n_model = sum(1 for k in saved.state if k.startswith("model."))
    print(
        f"  tensors     {ntensors} in the checkpoint ({n_model} parameters + {ntensors - n_model} Adam "
        f"exp_avg/exp_avg_sq/step); {len(saved.state)} global values compared, learning rates included",
        flush=True,
    )
    print(f"  bytes       {nbytes:,} in {nfiles} files", flush=True)
    print(f"  save        {_fmt(save_layout)}: {saved.seconds:.2f} s, {_gbps(nbytes, saved.seconds)}", flush=True)
    print(
        f"  load        {_fmt(load_layout)}: {loaded.seconds:.2f} s, {_gbps(nbytes, loaded.seconds)}; "
        f"tp=1: {here.seconds:.2f} s, {_gbps(nbytes, here.seconds)}",
        flush=True,
    )
    logits_ok = all(c.logits_ok and c.loss_ok for c in (first, second))
    print(
        f"  logits      {'match' if logits_ok else 'MISMATCH'} (max |diff| "
        f"{max(first.logits_diff, second.logits_diff):.1e}, tolerance {LOGIT_TOLERANCE:g} across TP degrees, "
        "bitwise when the layout is unchanged); next-step loss too",
        flush=True,
    )
    print(
        f"  bit-exact: {'yes' if exact else 'NO'}   (parameters and optimizer state, every layout; "
        f"{time.perf_counter() - started:.1f} s in all)",
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

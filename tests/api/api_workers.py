"""Rank functions for the multi-process API tests (module level, so spawned ranks can import them).

Each scenario catches its own failure and returns it as text, so one world runs every scenario and a
failure in one still reports the others.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import tp_model
from torch import nn

from smpckpt import ParallelLayout, SaveOptions, last_resume_info, resume_from_checkpoint, save_checkpoint
from smpckpt.storage import FsspecStorageWriter


def _scenario(results: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    try:
        results[name] = fn()
    except BaseException:  # noqa: BLE001 - reported to the parent
        results[name] = {"error": traceback.format_exc()}
    dist.barrier()


def _dirs(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.endswith("_partial"))


def _newest(root: str) -> str | None:
    p = os.path.join(root, "newest")
    return open(p).read().strip() if os.path.exists(p) else None


def _linear(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def _step(m: nn.Module, o: torch.optim.Optimizer, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    o.zero_grad()
    m(torch.randn(4, 6, generator=g)).pow(2).mean().backward()
    o.step()


def _params(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same non-empty keys (in order) and bit-exact values of the same dtype: an empty or truncated
    state compares unequal instead of vacuously equal."""
    return bool(a) and list(a) == list(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _optim_same(m: nn.Module, o: torch.optim.Optimizer, m2: nn.Module, o2: torch.optim.Optimizer) -> bool:
    """Per parameter (matched by name), the same non-empty optimizer state keys and bit-exact values."""
    p1, p2 = dict(m.named_parameters()), dict(m2.named_parameters())
    if not p1 or list(p1) != list(p2):
        return False
    for name in p1:
        s1, s2 = o.state[p1[name]], o2.state[p2[name]]
        if not s1 or set(s1) != set(s2) or not all(torch.equal(s1[k], s2[k]) for k in s1):
            return False
    return True


def _expect_error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


# -- cycles, retention, crash, tags (world of 2, default layout: pure DP) ----------------------------
def cycles_world(rank: int, world: int, root: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    m, o = _linear(0)
    snapshots: dict[str, dict[str, torch.Tensor]] = {}

    def cycles() -> Any:
        seen = []
        for i in range(1, 5):
            _step(m, o, i)
            save_checkpoint(
                root, f"step{i}", model=m, optimizer=o, user_content={"step": i}, num_kept_partial_checkpoints=2
            )
            snapshots[f"step{i}"] = _params(m)
            dist.barrier()
            seen.append((_dirs(root), _newest(root)))
        m2, o2 = _linear(7)
        uc = resume_from_checkpoint(root, model=m2, optimizer=o2)
        same = _same(_params(m2), snapshots["step4"])
        optim_same = _optim_same(m, o, m2, o2)
        info = last_resume_info()
        return {
            "seen": seen,
            "uc": uc,
            "same": same,
            "optim_same": optim_same,
            "path_taken": info.path_taken,
            "rng": info.rng_restored,
        }

    _scenario(results, "cycles", cycles)

    def crash() -> Any:
        # crash between data write and commit: the manifest write fails (after every rank's data is durable)
        # (a crash cleans nothing up: discard_failed_save is off too)
        original = FsspecStorageWriter._write_manifest, FsspecStorageWriter.discard_failed_save

        def boom(self: Any, data: bytes) -> None:
            raise OSError("simulated crash before commit")

        FsspecStorageWriter._write_manifest = boom  # type: ignore[method-assign]
        FsspecStorageWriter.discard_failed_save = lambda self: []  # type: ignore[method-assign]
        _step(m, o, 5)
        try:
            err = _expect_error(lambda: save_checkpoint(root, "step5", model=m, optimizer=o, user_content={"step": 5}))
        finally:
            FsspecStorageWriter._write_manifest, FsspecStorageWriter.discard_failed_save = original  # type: ignore[method-assign]
        dist.barrier()
        out: dict[str, Any] = {"save_error": err, "dirs": _dirs(root), "newest": _newest(root)}
        m3, o3 = _linear(8)
        out["uc_after_crash"] = resume_from_checkpoint(root, model=m3, optimizer=o3)
        out["crash_fell_back"] = last_resume_info().fell_back
        out["bitexact_after_crash"] = _same(_params(m3), snapshots["step4"])
        # newest names the uncommitted tag / is missing / is garbage -> fall back to step4
        for case, content in (("uncommitted", "step5\n"), ("garbage", "../etc\n"), ("missing", None)):
            if rank == 0:
                path = os.path.join(root, "newest")
                if content is None:
                    os.remove(path)
                else:
                    with open(path, "w") as f:
                        f.write(content)
            dist.barrier()
            m4, o4 = _linear(9)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                uc = resume_from_checkpoint(root, model=m4, optimizer=o4)
            out[case] = {
                "uc": uc,
                "fell_back": last_resume_info().fell_back,
                "warned": any("newest committed checkpoint 'step4'" in str(w.message) for w in caught),
                "bitexact": _same(_params(m4), snapshots["step4"]),
            }
            dist.barrier()
        return out

    _scenario(results, "crash", crash)

    def tags() -> Any:
        out = {}
        out["mismatch"] = _expect_error(lambda: save_checkpoint(root, f"t{rank}", model=m))
        bad = "ok" if rank == 0 else "bad/tag"
        out["bad_on_one_rank"] = _expect_error(lambda: save_checkpoint(root, bad, model=m))
        out["resume_mismatch"] = _expect_error(lambda: resume_from_checkpoint(root, tag=f"t{rank}", model=m))
        # async on rank 0 only: rank 0 takes one step more (its check of a previous background save)
        out["async_mismatch"] = _expect_error(lambda: save_checkpoint(root, "t_async", model=m, async_save=rank == 0))
        out["options_mismatch"] = _expect_error(
            lambda: save_checkpoint(
                root, "t_opts", model=m, num_kept_partial_checkpoints=rank + 1, sync_files=rank == 0
            )
        )
        dtype = torch.bfloat16 if rank == 0 else torch.float16
        out["full_mismatch"] = _expect_error(
            lambda: save_checkpoint(root, "t_full", partial=False, model=m, dtype=dtype)
        )
        out["resume_options_mismatch"] = _expect_error(
            lambda: resume_from_checkpoint(root, model=m, strict=rank == 0, missing_ok=True)
        )
        # an option bad on one rank only: that rank's own error there, the others name it (no hang)
        out["bad_option_on_one_rank"] = _expect_error(
            lambda: save_checkpoint(root, "t_bad", model=m, num_kept_partial_checkpoints=0 if rank == 1 else None)
        )
        out["bad_resume_option_on_one_rank"] = _expect_error(
            lambda: resume_from_checkpoint(root, model=m, options=None if rank == 0 else "strict", missing_ok=True)
        )
        out["rank"] = rank
        out["dirs"] = _dirs(root)
        return out

    _scenario(results, "tags", tags)

    def failed_delete() -> Any:
        import smpckpt.catalog.root as retention

        original = retention.remove_checkpoint

        def refuse(url: str, *a: Any, **k: Any) -> None:
            raise PermissionError(f"simulated: cannot delete {url}")

        retention.remove_checkpoint = refuse  # type: ignore[assignment]
        try:
            save_checkpoint(
                root, "step6", model=m, optimizer=o, user_content={"step": 6}, num_kept_partial_checkpoints=1
            )
        finally:
            retention.remove_checkpoint = original  # type: ignore[assignment]
        dist.barrier()
        before = (_dirs(root), _newest(root))
        save_checkpoint(root, "step7", model=m, optimizer=o, user_content={"step": 7}, num_kept_partial_checkpoints=1)
        dist.barrier()
        return {"after_failed_delete": before, "after_retry": (_dirs(root), _newest(root))}

    _scenario(results, "failed_delete", failed_delete)

    def missing_ok() -> Any:
        empty = os.path.join(root, "nothing-here")
        return {
            "none": resume_from_checkpoint(empty, model=m, missing_ok=True),
            "error": _expect_error(lambda: resume_from_checkpoint(empty, model=m)),
        }

    _scenario(results, "missing_ok", missing_ok)
    return results


# -- layout change with optimizer state (world of 2) ----------------------------------------------------
def reshard_world(rank: int, world: int, root: str) -> dict[str, Any]:
    logging.basicConfig(level=logging.WARNING)
    results: dict[str, Any] = {}
    tp2 = ParallelLayout(tp=2)
    saved: dict[str, Any] = {}

    def unbroken() -> Any:
        ctx, model, opt = tp_model.build(tp2)
        losses = [tp_model.train_step(ctx, model, opt, s) for s in range(3)]
        save_checkpoint(
            root, "s3", model=model, optimizer=opt, user_content={"step": 3}, layout=tp2, specs=tp_model.SPECS
        )
        state = tp_model.local_state(model, opt)
        after = torch.rand(4)
        losses += [tp_model.train_step(ctx, model, opt, s) for s in range(3, 6)]
        saved["losses"] = losses
        return {"losses": losses, "state": state, "rand_after_save": after}

    _scenario(results, "unbroken", unbroken)

    def same_layout() -> Any:
        ctx, model, opt = tp_model.build(tp2, seed=99)
        torch.manual_seed(12345)  # disturb the generator: resume must restore it
        uc = resume_from_checkpoint(root, model=model, optimizer=opt, layout=tp2, specs=tp_model.SPECS)
        info = last_resume_info()
        rand = torch.rand(4)
        losses = [tp_model.train_step(ctx, model, opt, s) for s in range(3, 6)]
        return {
            "uc": uc,
            "path_taken": info.path_taken,
            "layout_changed": info.layout_changed,
            "rng": info.rng_restored,
            "rand": rand,
            "losses": losses,
        }

    _scenario(results, "same_layout", same_layout)

    def dp2() -> Any:
        layout = ParallelLayout(dp=2)
        ctx, model, opt = tp_model.build(layout, seed=99)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            uc = resume_from_checkpoint(root, model=model, optimizer=opt, layout=layout, specs=tp_model.SPECS)
        info = last_resume_info()
        state = tp_model.local_state(model, opt)
        losses = [tp_model.train_step(ctx, model, opt, s) for s in range(3, 6)]
        return {
            "uc": uc,
            "path_taken": info.path_taken,
            "layout_changed": info.layout_changed,
            "rng": info.rng_restored,
            "resharded_tensors": info.resharded_tensors,
            "rng_warned": any("RNG states are not restored" in str(w.message) for w in caught),
            "state": state,
            "losses": losses,
        }

    _scenario(results, "dp2", dp2)
    return results


def peer_dies_during_save(rank: int, world_size: int, root: str) -> str:
    """Rank 1 leaves the job (its process group torn down) right as the save starts; rank 0 saves.

    Returns rank 0's error text (type: message); rank 1 returns "left".
    """
    m, o = _linear(0)
    if rank == 1:
        dist.destroy_process_group()  # the peer is gone: its sockets close under rank 0's collectives
        os._exit(0)
    try:
        save_checkpoint(os.path.join(root, "ckpt"), "t", model=m, optimizer=o)
        text = "no error"
    except Exception as exc:  # noqa: BLE001 - the error is what the test checks
        text = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    # run_world reports the dead rank and drops the others' values: leave ours in a file
    with open(os.path.join(root, "rank0.txt"), "w") as f:
        f.write(text)
    return text


def warnings_as_errors_world(rank: int, world: int, root: str) -> dict[str, Any]:
    """A resume across a layout change (RNG states not restored: a warning on rank 0) with warnings made
    errors: rank 0 raised it between two collectives, and rank 1 waited in the next one (rev59c F1)."""
    tp2 = ParallelLayout(tp=2)
    ctx, model, opt = tp_model.build(tp2)
    tp_model.train_step(ctx, model, opt, 0)
    save_checkpoint(root, "s1", model=model, optimizer=opt, layout=tp2, specs=tp_model.SPECS)
    dist.barrier()
    layout = ParallelLayout(dp=2)
    _, model, opt = tp_model.build(layout, seed=99)
    fresh = float(sum(p.sum() for p in model.parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        said = _expect_error(lambda: resume_from_checkpoint(root, model=model, optimizer=opt, layout=layout))
    untouched = float(sum(p.sum() for p in model.parameters())) == fresh  # refused before anything loaded
    dist.barrier()  # both ranks got here: nobody waits for the other inside the resume
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        resume_from_checkpoint(root, model=model, optimizer=opt, layout=layout)
    info = last_resume_info()
    total = float(sum(p.sum() for p in model.parameters()))
    return {"said": said, "untouched": untouched, "tag": info.tag if info else None, "sum": total, "fresh": fresh}


class Unsafe:
    """A user_content value weights-only loading rejects (module level: the ranks unpickle it)."""

    def __init__(self, x: int) -> None:
        self.x = x


def pickled_user_content_world(rank: int, world: int, root: str) -> dict[str, Any]:
    """user_content that needs allow_pickle: a resume without it is refused on every rank before any
    destination is written (it was refused after the load, the model and optimizer overwritten)."""
    out: dict[str, Any] = {}
    m, o = _linear(0)
    _step(m, o, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the save's warning that resuming needs allow_pickle
        save_checkpoint(root, "p", model=m, optimizer=o, user_content={"u": Unsafe(rank + 5)})
        save_checkpoint(root, "f", model=m, user_content={"u": Unsafe(rank + 7)}, partial=False)
    for tag, partial in (("p", True), ("f", False)):
        m2, o2 = _linear(1)
        _step(m2, o2, 1)
        before, opt_before = _params(m2), {k: {n: t.clone() for n, t in v.items()} for k, v in o2.state.items()}
        opt = o2 if partial else None
        said = _expect_error(
            functools.partial(resume_from_checkpoint, root, tag, model=m2, optimizer=opt, partial=partial)
        )
        untouched = _same(_params(m2), before) and all(
            torch.equal(o2.state[k][n], v) for k, s in opt_before.items() for n, v in s.items()
        )
        dist.barrier()  # both ranks got here: nobody waits for the other inside the resume
        got = resume_from_checkpoint(root, tag, model=m2, optimizer=opt, partial=partial, allow_pickle=True)
        out[tag] = {"said": said, "untouched": untouched, "x": got["u"].x, "loaded": _same(_params(m2), _params(m))}
    return out


def translate_drop_world(rank: int, world: int, root: str) -> dict[str, Any]:
    """A translate_function that drops a key, resumed on 2 ranks into the saved layout (tp=2) and into
    another (dp=2: resharded): the dropped key keeps the model's value, every other key is loaded as a
    resume without the function loads it (bit-exact)."""
    tp2 = ParallelLayout(tp=2)
    ctx, model, opt = tp_model.build(tp2)
    tp_model.train_step(ctx, model, opt, 0)
    save_checkpoint(root, "s1", model=model, optimizer=opt, layout=tp2, specs=tp_model.SPECS)
    dist.barrier()
    out: dict[str, Any] = {}
    for layout in (tp2, ParallelLayout(dp=2)):
        _, plain, po = tp_model.build(layout, seed=5)
        resume_from_checkpoint(root, model=plain, optimizer=po, layout=layout, specs=tp_model.SPECS)
        _, got, go = tp_model.build(layout, seed=5)
        kept = got.blocks[0].fc1.bias.detach().clone()

        def drop(sd: dict[str, Any]) -> dict[str, Any]:
            return {k: v for k, v in sd.items() if k != "blocks.0.fc1.bias"}

        kw: dict[str, Any] = dict(model=got, optimizer=go, layout=layout, specs=tp_model.SPECS)
        resume_from_checkpoint(root, translate_function=drop, strict=False, **kw)
        info = last_resume_info()
        same = {
            k: torch.equal(v, kept if k == "blocks.0.fc1.bias" else plain.state_dict()[k])
            for k, v in got.state_dict().items()
        }
        out[str(layout)] = {"same": same, "skipped": info.skipped_keys if info else None}
    return out


def alternate_world(rank: int, world: int, root: str) -> dict[str, Any]:
    """save_checkpoint(num_kept_partial_checkpoints=2, async_save) and resume_from_checkpoint, alternated 5
    times: the gloo groups created for background saves (each rebuilt Checkpointer made its own)."""
    made: list[Any] = []
    real = dist.new_group

    def counting(*args: Any, **kwargs: Any) -> Any:
        made.append(real(*args, **kwargs))
        return made[-1]

    dist.new_group = counting  # type: ignore[assignment]  # this rank's process only
    m, o = _linear(0)
    try:
        for i in range(5):
            _step(m, o, i)
            opts = SaveOptions(async_save=True)
            save_checkpoint(root, f"s{i}", model=m, optimizer=o, num_kept_partial_checkpoints=2, options=opts)
            resume_from_checkpoint(root, model=m, optimizer=o)
    finally:
        dist.new_group = real  # type: ignore[assignment]
    info = last_resume_info()
    return {"groups": len(made), "dirs": _dirs(root), "tag": info.tag if info else None}


def rollback_world(rank: int, world: int, root: str) -> dict[str, Any]:
    """s1..s5; a restarted job (a fresh model: its own Checkpointer) resumes s3 by tag and saves s6 with
    retention 3; then s6's manifest is damaged and a third job resumes without a tag."""
    results: dict[str, Any] = {}

    def rollback() -> Any:
        m, o = _linear(0)
        snapshots = {}
        for i in range(1, 6):
            _step(m, o, i)
            save_checkpoint(root, f"s{i}", model=m, optimizer=o, user_content={"step": i})
            snapshots[i] = _params(m)
        m2, o2 = _linear(7)
        back = resume_from_checkpoint(root, tag="s3", model=m2, optimizer=o2)
        _step(m2, o2, 6)
        save_checkpoint(root, "s6", model=m2, optimizer=o2, user_content={"step": 6}, num_kept_partial_checkpoints=3)
        dist.barrier()
        kept = _dirs(root)
        if rank == 0:
            with open(os.path.join(root, "s6_partial", "smpckpt.manifest.json"), "w") as f:
                f.write("{damaged")
        dist.barrier()
        m3, o3 = _linear(9)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            uc = resume_from_checkpoint(root, model=m3, optimizer=o3)
        warned = any("checkpoint 's3' of the job's history" in str(w.message) for w in caught)
        return {"back": back, "kept": kept, "uc": uc, "warned": warned, "same": _same(_params(m3), snapshots[3])}

    _scenario(results, "rollback", rollback)
    return results


def retried_drain_warning_as_error_world(rank: int, world: int, root: str) -> dict[str, Any]:
    """2 nodes of one rank, durable_every=2: step2's drain fails (path refuses rank 0's first file), so
    step3 drains it again, with a warning on rank 0, under a filter making warnings errors, async: rank 0's
    background save alone failed (rev59c F3), and the next save's check refused on every rank."""
    import errno

    import smpckpt.api._drain as drain_module
    from smpckpt import wait_for_saves

    os.environ["LOCAL_WORLD_SIZE"] = "1"
    durable, real_open_sink, refused = os.path.join(root, "durable"), drain_module.open_sink, []

    def refusing(fs: Any, path: str, **kw: Any) -> Any:
        if rank == 0 and "step2_partial" in path and not refused:
            refused.append(path)
            raise OSError(errno.ENOSPC, "injected: no space left on path's storage", path)
        return real_open_sink(fs, path, **kw)

    drain_module.open_sink = refusing  # type: ignore[assignment]
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    kw: dict[str, Any] = dict(local_path=os.path.join(root, f"node{rank}"), replicas=1, durable_every=2)

    def save(step: int, **more: Any) -> None:
        save_checkpoint(durable, f"step{step}", model=model, **kw, **more)
        wait_for_saves()

    try:
        first = [_expect_error(lambda: save(1)), _expect_error(lambda: save(2))]  # step2's drain fails
        dist.barrier()
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            said = _expect_error(lambda: save(3, async_save=True))
        dist.barrier()  # both ranks got here
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            after = _expect_error(lambda: save(4))
        dist.barrier()
    finally:
        drain_module.open_sink = real_open_sink  # type: ignore[assignment]
    return {"first": first, "said": said, "after": after, "durable": sorted(os.listdir(durable))}


def translate_fails_on_one_rank_world(rank: int, world: int, root: str) -> dict[str, Any]:
    """A translate_function that raises on rank 1 alone: every rank raises and no rank's model changes (it
    ran after rank 0 had applied the checkpoint: the ranks went on from different checkpoints)."""
    m, o = _linear(0)
    _step(m, o, 0)
    save_checkpoint(root, "s1", model=m, optimizer=o)
    m2, o2 = _linear(1)
    _step(m2, o2, 1)
    before = _params(m2)

    def fails_on_rank_1(sd: dict[str, Any]) -> dict[str, Any]:
        if rank == 1:
            raise RuntimeError("rank 1's translate_function failed")
        return sd

    said = _expect_error(
        functools.partial(
            resume_from_checkpoint, root, "s1", model=m2, optimizer=o2, translate_function=fails_on_rank_1
        )
    )
    untouched = _same(_params(m2), before)
    dist.barrier()  # both ranks got here: nobody waits for the other inside the resume
    return {"said": said, "untouched": untouched}


def fast_tier_warnings_as_errors_world(rank: int, world: int, root: str) -> dict[str, Any]:
    """Tag-less resumes through the fast tier (each rank its own node) with warnings made errors: a
    warning raised on rank 0 alone inside the fast load (the layout changed, RNG states not restored; the
    fallback when ``newest`` is gone) left rank 0 out of the resume while rank 1 waited in the fallback's
    collective (rev60d F1). Then, warnings left alone, the fallback loads and says it fell back."""
    from smpckpt import Checkpointer, FastTier, Sharding

    os.environ["LOCAL_WORLD_SIZE"] = "1"  # one rank per node: replicas on the peer
    durable = os.path.join(root, "durable")

    def fast() -> FastTier:
        return FastTier(os.path.join(root, "fast", f"node{rank}"), replicas=2, durable_every=1, num_kept_local=None)

    tp2 = ParallelLayout(tp=2)
    ctx, model, opt = tp_model.build(tp2)
    tp_model.train_step(ctx, model, opt, 0)
    with Checkpointer(durable, Sharding(layout=tp2, specs=tp_model.SPECS), fast_tier=fast()) as c:
        c.save("s1", model, opt)
        c.save("s2", model, opt)
        c.wait()
    dist.barrier()
    out: dict[str, Any] = {}
    dp2 = ParallelLayout(dp=2)
    _, other, oopt = tp_model.build(dp2, seed=99)
    with warnings.catch_warnings(), Checkpointer(durable, Sharding(layout=dp2), fast_tier=fast()) as c:
        warnings.simplefilter("error", UserWarning)
        out["layout"] = _expect_error(lambda: c.resume(None, other, oopt))
    dist.barrier()
    _, other, oopt = tp_model.build(dp2, seed=98)  # the warning names the caller's line (rev61h F1)
    with (
        warnings.catch_warnings(record=True) as caught,
        Checkpointer(durable, Sharding(layout=dp2), fast_tier=fast()) as c,
    ):
        warnings.simplefilter("always")
        c.resume(None, other, oopt)
    out["layout_said_at"] = [os.path.basename(w.filename) for w in caught if "layout changed" in str(w.message)]
    dist.barrier()
    if rank == 0:
        os.remove(os.path.join(durable, "newest"))
    dist.barrier()
    _, same, sopt = tp_model.build(tp2, seed=99)
    with Checkpointer(durable, Sharding(layout=tp2, specs=tp_model.SPECS), fast_tier=fast()) as c:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            out["newest"] = _expect_error(lambda: c.resume(None, same, sopt))
        dist.barrier()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            c.resume(None, same, sopt)
        info = c.last_resume_info
        out["loaded"] = (info.tag, info.tier, info.fell_back) if info else None
        out["same"] = _same(_params(same), _params(model))
    return out


class _HalfFull:
    """A received replica's file whose first write stores half its bytes, then fails (injected ENOSPC)."""

    def __init__(self, f: Any) -> None:
        self.f = f

    def write(self, data: memoryview) -> int:
        self.f.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "injected: no space left for the replica", str(self.f.name))

    def fileno(self) -> int:
        return int(self.f.fileno())

    def close(self) -> None:
        self.f.close()


def fast_tier_threads_world(rank: int, world: int, root: str) -> dict[str, Any]:
    """(2 ranks, a node each) Seven tiered saves through one Checkpointer (replicas=2, durable_every=2);
    the replica and drain-copy threads it started (by name): in save 1, in all seven; those alive after
    s7 and after close; s6 fails: rank 1's write of a received replica stops half way; s7 saved after it;
    then node 1's folder lost and s7 resumed from node 0's replicas (bit-exact?)."""
    import shutil
    import threading

    from smpckpt import Checkpointer, FastTier, Sharding
    from smpckpt.storage.tier import writer

    os.environ["LOCAL_WORLD_SIZE"] = "1"
    durable, local = os.path.join(root, "durable"), os.path.join(root, "fast", f"node{rank}")
    ours = ("smpckpt-replica", "smpckpt-drain-copy", "smpckpt-write")
    started: list[str] = []
    start, opened = threading.Thread.start, writer._Receiver._opened

    def counting(self: threading.Thread) -> None:
        started.append(self.name)
        start(self)

    def failing(self: Any, file: int, name: str) -> None:
        opened(self, file, name)
        incoming = self.open[file]
        incoming.file = _HalfFull(incoming.file) if incoming.file is not None else None

    def alive() -> list[tuple[str, int | None]]:
        return sorted((t.name, t.ident) for t in threading.enumerate() if t.name.startswith(ours))

    def sharding() -> Sharding:
        return Sharding(layout=ParallelLayout(tp=2), specs=tp_model.SPECS)

    fast = FastTier(local, replicas=2, durable_every=2, num_kept_local=None)
    ctx, model, opt = tp_model.build(ParallelLayout(tp=2))
    out: dict[str, Any] = {}
    c = Checkpointer(durable, sharding(), fast_tier=fast)
    threading.Thread.start = counting  # type: ignore[method-assign]
    try:
        for step in range(1, 6):
            tp_model.train_step(ctx, model, opt, step)
            c.save(f"s{step}", model, opt)
            c.wait()
            if step == 1:
                out["replica_threads"] = [n for n in started if n.startswith(ours[0])]
        tp_model.train_step(ctx, model, opt, 6)
        if rank == 1:
            writer._Receiver._opened = failing  # type: ignore[method-assign]
        out["failed"] = _expect_error(lambda: (c.save("s6", model, opt), c.wait()))
        writer._Receiver._opened = opened  # type: ignore[method-assign]
        tp_model.train_step(ctx, model, opt, 7)
        c.save("s7", model, opt)
        c.wait()
        out["started"], out["alive"] = [n for n in started if n.startswith(ours)], [n for n, _ in alive()]
    finally:
        threading.Thread.start = start  # type: ignore[method-assign]
        writer._Receiver._opened = opened  # type: ignore[method-assign]
    want = {k: v.clone() for k, v in tp_model.local_state(model, opt).items()}
    c.close()
    out["after_close"] = alive()
    dist.barrier()
    if rank == 1:
        shutil.rmtree(local)  # node 1 lost: its s7 files come back from node 0's replicas
    dist.barrier()
    _, m2, o2 = tp_model.build(ParallelLayout(tp=2), seed=99)
    with Checkpointer(durable, sharding(), fast_tier=fast) as c2:
        c2.resume(None, m2, o2)
        info = c2.last_resume_info
    out["loaded"] = (info.tag, info.tier, info.from_peers) if info else None
    out["exact"] = _same(tp_model.local_state(m2, o2), want)
    with contextlib.suppress(RuntimeError):  # a with body raising: __exit__ ends the threads too (rev61d F3)
        with Checkpointer(durable, sharding(), fast_tier=fast) as c3:
            c3.save("s8", m2, o2)
            raise RuntimeError("the training step failed")
    out["after_exit"] = alive()
    return out


class _Stage(nn.Module):
    def __init__(self, last: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(2, 2)])
        if last:
            self.head = nn.Linear(2, 2)


def pp_translate_drop_world(rank: int, world: int, root: str) -> dict[str, Any]:
    """pp=2: only stage 1 holds ``head``; a translate_function dropping ``head.bias`` under strict=False.
    Rank 0 warns for the whole job, so it must name the key stage 1 dropped (rev61e F2)."""
    from smpckpt import Checkpointer, ResumeOptions, Sharding

    torch.manual_seed(rank)
    ckpt = Checkpointer(os.path.join(root, "d"), Sharding(layout=ParallelLayout(pp=2, pp_layers=(1, 1))))
    ckpt.save("s", _Stage(rank == 1))

    def drop(sd: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in sd.items() if k != "head.bias"}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt.resume("s", _Stage(rank == 1), options=ResumeOptions(strict=False, translate_function=drop))
    said = [str(w.message) for w in caught if "skipped keys" in str(w.message)]
    info = ckpt.last_resume_info
    ckpt.close()
    return {"said": said, "skipped": info.skipped_keys if info else None}


def ctrl_c_on_one_rank_world(rank: int, world: int, root: str) -> dict[str, Any]:
    """hunt62b: rank 1 alone gets a Ctrl-C while the save plans: it raises KeyboardInterrupt, rank 0 a
    CheckpointError naming rank 1; neither waits for the other, the tag is not committed, a retry commits."""
    from smpckpt.planners import ParallelSavePlanner

    m, o = _linear(0)
    _step(m, o, 0)
    real = ParallelSavePlanner.create_local_plan

    def ctrl_c(self: Any) -> Any:
        if rank == 1:
            raise KeyboardInterrupt
        return real(self)

    ParallelSavePlanner.create_local_plan = ctrl_c  # type: ignore[method-assign]
    try:
        save_checkpoint(root, "s1", model=m, optimizer=o)
        said = "no error"
    except BaseException as exc:  # noqa: BLE001 - the class is what is checked
        said = f"{type(exc).__name__}: {exc}"
    finally:
        ParallelSavePlanner.create_local_plan = real  # type: ignore[method-assign]
    dist.barrier()  # both ranks got here
    committed = _newest(root)
    save_checkpoint(root, "s1", model=m, optimizer=o)
    return {"said": said, "newest_after_failure": committed, "newest": _newest(root)}


def ctrl_c_in_a_tiered_resume_world(rank: int, world: int, root: str) -> dict[str, str]:
    """rev62b F1: rank 1 alone gets a Ctrl-C inside the fast tier's dcp.load; it left before the agreement on
    the failure that rank 0 entered, which then waited until rank 1's process went (a collective's error)."""
    import time

    from smpckpt.planners import ParallelLoadPlanner

    os.environ["LOCAL_WORLD_SIZE"] = "2"  # one node: both ranks' fast tier in one folder
    m, o = _linear(0)
    _step(m, o, 0)
    kw: dict[str, Any] = dict(local_path=os.path.join(root, "node0"), replicas=1, durable_every=1)
    save_checkpoint(os.path.join(root, "durable"), "s1", model=m, optimizer=o, **kw)
    real, calls = ParallelLoadPlanner.create_local_plan, []

    def ctrl_c(self: Any) -> Any:
        calls.append(1)
        if rank == 1 and len(calls) == 1:
            raise KeyboardInterrupt
        return real(self)

    ParallelLoadPlanner.create_local_plan = ctrl_c  # type: ignore[method-assign]
    try:
        resume_from_checkpoint(os.path.join(root, "durable"), model=m, optimizer=o, local_path=kw["local_path"])
        said = "resumed"
    except BaseException as exc:  # noqa: BLE001 - the class is what is checked
        said = f"{type(exc).__name__}: {exc}"
    finally:
        ParallelLoadPlanner.create_local_plan = real  # type: ignore[method-assign]
    if rank == 1:
        time.sleep(3)  # the interrupted rank still alive (its handler cleaning up): rank 0 waited this out
    return {"said": said}


def export_out_per_rank_world(rank: int, world: int, root: str) -> dict[str, str]:
    """rev62d F3: export's ``out`` was checked after the agreement and never compared: ``out=123`` on rank 1
    alone left rank 0 waiting for rank 1's process to go; a different folder per rank gave each rank its own
    folder back while the artifact lay in rank 0's."""
    from smpckpt import Checkpointer

    m, _ = _linear(0)
    said: dict[str, str] = {}
    with Checkpointer(root) as ckpt:
        for case, out in (("type", 123 if rank == 1 else None), ("differ", os.path.join(root, f"out{rank}"))):
            try:
                said[case] = f"returned {ckpt.export('e', out, model=m)}"  # type: ignore[arg-type]
            except Exception as exc:  # noqa: BLE001 - the class and text are what is checked
                said[case] = f"{type(exc).__name__}: {exc}"
    return said


def diverging_replica_world(rank: int, world: int, root: str) -> dict[str, str]:
    """hunt62b R1: a DP replica diverging on rank 1 (dtype, shape, a key only it holds, a tie only it holds)."""
    from smpckpt import Checkpointer

    said: dict[str, str] = {}
    for case in ("dtype", "shape", "extra_key", "tie"):
        m = nn.Module()
        m.w = nn.Parameter(torch.ones(6, 4) if rank == 1 and case == "shape" else torch.ones(4, 6))
        m.register_buffer("b", torch.arange(5.0, dtype=torch.float64 if rank == 1 and case == "dtype" else None))
        if rank == 1 and case == "extra_key":
            m.register_buffer("extra", torch.ones(2))
        if case == "tie":  # rev62b F4: tied on rank 1 only
            m.v = m.w if rank == 1 else nn.Parameter(torch.ones(4, 6))
        with Checkpointer(root) as ck:
            said[case] = _expect_error(functools.partial(ck.save, case, m))
    from smpckpt import ParallelLayout, Sharding

    m = nn.Linear(2, 2)
    nn.init.constant_(m.weight, float(rank))  # a TP shard without its spec: the values differ (rev64c F3)
    with Checkpointer(root, Sharding(ParallelLayout(tp=2))) as ck:
        said["values"] = _expect_error(functools.partial(ck.save, "values", m))
    return said


def ddp_batchnorm_world(rank: int, world: int, root: str, how: str) -> dict[str, bool]:
    """hunt67 F1: DDP (broadcast_buffers) makes rank 0's buffers the job's at every forward; between forwards
    each rank holds its own batch's BatchNorm statistics. A save (``how``: sync, async, compiled, full export) keeps the
    job's, on every rank: the values of the job's next forward."""
    from smpckpt import AsyncOptions, Checkpointer, ExportOptions, ResumeOptions

    def built(seed: int) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
        ddp: nn.Module = nn.parallel.DistributedDataParallel(model)
        if how == "compiled":  # torch.compile's wrapper around DDP, the order DDP's documentation gives
            ddp = torch.compile(ddp, backend="eager")  # type: ignore[assignment]
        return model, ddp, torch.optim.SGD(ddp.parameters(), lr=0.1)

    model, ddp, opt = built(0)
    torch.manual_seed(1 + rank)  # each rank its own batch, as a DistributedSampler gives
    ddp(torch.randn(6, 4)).sum().backward()
    opt.step()
    job = {k: v.clone() for k, v in model[1].state_dict().items()}
    for v in job.values():
        dist.broadcast(v, 0)  # what DDP's next forward puts on every rank
    with Checkpointer(root, async_options=AsyncOptions(enabled=how == "async")) as ck:
        if how == "full":
            ck.export("f", model=ddp, optimizer=opt, options=ExportOptions(include_optimizer=True))
        else:
            ck.save("s", ddp, opt)
        ck.wait()
        model2, ddp2, opt2 = built(5)
        ck.resume("f" if how == "full" else None, ddp2, opt2, options=ResumeOptions(partial=how != "full"))
    got = model2[1].state_dict()
    return {k: torch.equal(got[k], job[k]) for k in job}


def ddp_subgroup_save_world(rank: int, world: int, root: str) -> dict[str, bool]:
    """rev67d F4: DDP over the world; rank 0 alone saves it over a group of its own while rank 1 waits. DDP's buffer
    sync is a collective of DDP's group: made there, rank 0 hung; it saves (and resumes) rank 0's values."""
    from smpckpt import Checkpointer, Sharding

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    ddp = nn.parallel.DistributedDataParallel(model)
    torch.manual_seed(1 + rank)
    ddp(torch.randn(6, 4)).sum().backward()
    solo, got = dist.new_group([0]), {}
    if rank == 0:
        want = {k: v.clone() for k, v in model.state_dict().items()}
        with Checkpointer(root, Sharding(process_group=solo)) as ck:
            ck.save("s", ddp)
            back = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
            ck.resume(None, back)
        got = {k: torch.equal(v, want[k]) for k, v in back.state_dict().items()}
    dist.barrier()
    return got


def late_save_world(rank: int, world: int, root: str, late: int) -> dict[str, str]:
    """rev67d F3: rank ``late`` enters save 'b' later than the join timeout (2 s); the others give up on it. The late
    rank's error and later refusal said another rank died, or named the others as not having entered."""
    import time

    from smpckpt import Checkpointer, Sharding
    from smpckpt.errors import CheckpointError

    m, _ = _linear(0)
    ckpt, said = Checkpointer(root, Sharding(join_timeout=2)), {"b": "no error", "again": "no error"}
    ckpt.save("a", m)
    if rank == late:
        time.sleep(5)
    for tag in said:
        try:
            ckpt.save(tag, m)
        except CheckpointError as exc:
            said[tag] = str(exc)
    dist.all_reduce(torch.ones(3))  # training goes on
    return said


def smp_rebuild_world(rank: int, world: int, root: str, asy: bool) -> dict[str, Any]:
    """rev67d F1: smp face, join_timeout set; rank 1 passes a bad ``partial`` to a save whose arguments do not fit the
    model's kept Checkpointer (another root; ``asy``: AsyncOptions added). Rank 1 met the others in the kept one's
    join while they sat in a new one's agreement: a hang. Every rank now fails at once with rank 1's error."""
    import time

    from smpckpt import AsyncOptions, Sharding

    m, _ = _linear(0)
    opts: list[Any] = [Sharding(join_timeout=3)]
    save_checkpoint(os.path.join(root, "A"), "a", model=m, options=opts)
    started, said = time.monotonic(), "no error"
    try:
        save_checkpoint(
            os.path.join(root, "A" if asy else "B"),
            "b",
            partial=True if rank == 0 else "yes",
            model=m,
            options=[*opts, AsyncOptions(enabled=True)] if asy else opts,
        )
    except TypeError as exc:
        said = str(exc)
    took = time.monotonic() - started
    dist.all_reduce(torch.ones(2))  # training goes on
    return {"said": said, "took": took}


def lone_save_world(rank: int, world: int, root: str, savers: tuple[int, ...], asy: bool = False) -> dict[str, Any]:
    """fix67a (hunt66d P2): every rank saves 's1'; then ``savers`` alone save 'emerg' (a SIGTERM handler's
    save) while the other ranks sit in their training all_reduce. Each saver fails within the join timeout
    naming who did not join, then joins that all_reduce (the job goes on); 's1' stays newest, resumed
    bit-exactly. ``asy``: async saves (a background gloo group), and each saver then close()s its Checkpointer
    while the others are in that all_reduce (rev67d F2: it hung in a barrier on the background group)."""
    import time

    from smpckpt import AsyncOptions, Checkpointer, Sharding
    from smpckpt.errors import CheckpointError

    m, o = _linear(0)
    _step(m, o, 0)
    ckpt = Checkpointer(root, Sharding(join_timeout=3), async_options=AsyncOptions(enabled=asy))
    ckpt.save("s1", m, o)
    ckpt.wait()
    saved = {k: v.clone() for k, v in _params(m).items()}
    said, took, again = "no error", 0.0, "no error"
    if rank in savers:
        started = time.monotonic()
        try:
            ckpt.save("emerg", m, o)
        except CheckpointError as exc:
            said = str(exc)
        took = time.monotonic() - started
        try:  # refused at once: this rank's Checkpointer no longer meets the others in step
            ckpt.save("again", m, o)
        except CheckpointError as exc:
            again = str(exc)
        if asy:
            ckpt.close()
    dist.all_reduce(torch.ones(3))  # the others' training collective, still waiting for the savers
    dist.barrier()
    closed = 0.0
    if asy and rank not in savers:  # rev67f F1: a rank that never entered that save closes too (it hung)
        started = time.monotonic()
        ckpt.close()
        closed = time.monotonic() - started
    m2, o2 = _linear(1)
    Checkpointer(root).resume(None, m2, o2)
    return {
        "said": said,
        "took": took,
        "closed": closed,
        "again": again,
        "newest": _newest(root),
        "dirs": _dirs(root),
        "exact": _same(_params(m2), saved) and _optim_same(m, o, m2, o2),
    }

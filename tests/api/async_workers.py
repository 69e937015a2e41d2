"""Processes for the async-save tests: a child killed during a background write, and gloo ranks that
keep running collectives on the default group while a save is in flight."""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import smpckpt
from smpckpt.storage.write.writer import FsspecStorageWriter


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))


def killed_during_background_write(root: str, ready_file: str) -> None:
    """Commit tag ``a``; start an async save of ``b`` whose commit never comes; die by SIGKILL."""
    m = model(0)
    smpckpt.save_checkpoint(root, "a", model=m)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    blocked = threading.Event()

    def never_commits(self: Any, data: bytes) -> None:
        blocked.set()
        threading.Event().wait()  # the data is durable; the manifest is never written

    FsspecStorageWriter._write_manifest = never_commits  # type: ignore[method-assign]
    smpckpt.save_checkpoint(root, "b", model=m, async_save=True)
    blocked.wait(60)
    with open(ready_file, "w") as f:
        f.write("ok")
    os.kill(os.getpid(), signal.SIGKILL)


def training_loop_while_saving(rank: int, world: int, root: str) -> dict[str, Any]:
    """Two async saves while the loop all-reduces on the default group; values saved are the staged ones."""
    m = model(1)  # the same values on both ranks (data parallel)
    snapshots = []
    for tag in ("s1", "s2"):
        snapshots.append({k: v.clone() for k, v in m.state_dict().items()})
        fut = smpckpt.save_checkpoint(root, tag, model=m, async_save=True)
        for _ in range(20):  # the training loop's own collectives, concurrent with the save's
            t = torch.ones(4) * (rank + 1)
            dist.all_reduce(t)
            assert t[0].item() == world * (world + 1) / 2
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(1.5)  # updated right after the save returned
    fut.result()
    smpckpt.wait_for_saves()
    loaded = []
    for tag in ("s1", "s2"):
        fresh = model(7)
        smpckpt.resume_from_checkpoint(root, tag, model=fresh)
        loaded.append({k: v.clone() for k, v in fresh.state_dict().items()})
    newest = open(os.path.join(root, "newest")).read().strip()
    ok = all(torch.equal(loaded[i][k], snapshots[i][k]) for i in range(2) for k in snapshots[i])
    return {"exact": ok, "newest": newest}


def one_rank_refuses_its_staging(rank: int, world: int, root: str) -> dict[str, Any]:
    """overlap_staging: only rank 0 changes a parameter in place before its deferred staging ran (rank 0
    alone evaluates with other weights loaded, or one write raced the copies differently on each rank);
    each rank reports what its future raised, then a second save goes on."""
    import concurrent.futures

    import smpckpt.api._staging as staging
    from smpckpt.api._async import LaneThread

    torch.manual_seed(0)
    m = model(0)
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(4, 64)).sum().backward()
    opt.step()
    entered, release = threading.Event(), threading.Event()
    real = staging.copy_into

    def held(pairs: Any, stream: Any = None) -> None:
        if rank == 0 and isinstance(threading.current_thread(), LaneThread):
            entered.set()
            release.wait(30)
        real(pairs, stream)

    staging.copy_into = held  # type: ignore[assignment]
    opts = smpckpt.AsyncOptions(enabled=True, overlap_staging=True)
    ckpt = smpckpt.Checkpointer(root, async_options=opts)
    fut = ckpt.save("a", m, opt)
    if rank == 0:
        entered.wait(30)
        with torch.no_grad():
            m[0].weight.mul_(2.0)
        release.set()
    try:
        fut.result(timeout=60)
        got = "ok"
    except concurrent.futures.TimeoutError:
        raise AssertionError(f"rank {rank}: the save's future was still running after 60 s") from None
    except smpckpt.CheckpointError as exc:
        got = str(exc)
    try:
        ckpt.wait()  # the failure, once more
    except smpckpt.CheckpointError:
        pass
    staging.copy_into = real  # type: ignore[assignment]
    if rank == 0:
        with torch.no_grad():
            m[0].weight.div_(2.0)  # the replicas equal again (exactly: a power of two)
    want = {k: v.clone() for k, v in m.state_dict().items()}
    ckpt.save("b", m, opt).result(timeout=60)  # type: ignore[union-attr]
    ckpt.close()
    fresh = model(7)
    smpckpt.Checkpointer(root).resume("b", fresh)
    exact = all(torch.equal(v, want[k]) for k, v in fresh.state_dict().items())
    return {
        "error": got,
        "a_committed": os.path.exists(os.path.join(root, "a_partial", "smpckpt.manifest.json")),
        "b_exact": exact,
    }


def one_rank_cannot_stage(rank: int, world: int, root: str, what: str = "buffers") -> dict[str, Any]:
    """Rank 1's staging fails (``what``: its pinned or host buffers cannot be allocated, or its lane's
    thread cannot start, or its drain lane's: a fast tier with a drain each save); each rank reports what its
    save raised, or what its future raised within 60 s; then a second save goes on."""
    import concurrent.futures

    from smpckpt.api._async import LaneThread
    from smpckpt.api._staging import Stager

    m = model(0)
    real, real_start = Stager.stage, LaneThread.start

    def no_memory(self: Any, *args: Any) -> Any:
        raise MemoryError("cannot allocate the staging buffers (injected)")

    def no_thread(self: Any) -> None:
        if what == "thread" or self.name == "smpckpt-drain":
            raise RuntimeError("can't start new thread (injected)")
        real_start(self)

    if rank == 1 and what == "buffers":
        Stager.stage = no_memory  # type: ignore[method-assign]
    if rank == 1 and what in ("thread", "drain"):
        LaneThread.start = no_thread  # type: ignore[method-assign]
    tier = None
    if what == "drain":  # each rank a node of its own, every save drained to root
        os.environ["LOCAL_WORLD_SIZE"] = "1"
        tier = smpckpt.FastTier(f"{root}-fast/node{rank}", durable_every=1)
    ckpt = smpckpt.Checkpointer(root, async_options=smpckpt.AsyncOptions(enabled=True), fast_tier=tier)
    try:
        fut = ckpt.save("a", m)
        assert fut is not None
        fut.result(timeout=60)
        got = "ok"
    except concurrent.futures.TimeoutError:
        raise AssertionError(f"rank {rank}: the save's future was still running after 60 s") from None
    except (MemoryError, RuntimeError, smpckpt.CheckpointError) as exc:
        got = f"{type(exc).__name__}: {exc}"
    Stager.stage, LaneThread.start = real, real_start  # type: ignore[method-assign]
    try:
        ckpt.wait()
    except smpckpt.CheckpointError:
        pass
    ckpt.save("b", m).result(timeout=60)  # type: ignore[union-attr]
    ckpt.close()
    return {"error": got, "b": os.path.exists(os.path.join(root, "b_partial", "smpckpt.manifest.json"))}


def returns_while_saving(root: str) -> None:
    """Commit tag ``a``; start an async save of ``b`` that opens its writer's thread pools only after a
    pause; return at once, as a training script's ``main`` does, without ``wait_for_saves()``."""
    m = model(0)
    smpckpt.save_checkpoint(root, "a", model=m)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    real = FsspecStorageWriter.write_data

    def late(self: Any, plan: Any, planner: Any) -> Any:
        time.sleep(1.0)  # the main thread is in interpreter shutdown by now
        return real(self, plan, planner)

    FsspecStorageWriter.write_data = late  # type: ignore[method-assign]
    smpckpt.save_checkpoint(root, "b", model=m, async_save=True)


def fails_while_saving(root: str, status: str, exit_code: str = "") -> None:
    """Start an async save whose write fails after a pause, and return without waiting for it; with a
    status argument other than "default", set the exit status such a failure gives first; with an
    ``exit_code``, end with ``sys.exit(int(exit_code))`` instead of returning."""
    opts = smpckpt.AsyncOptions(enabled=True)
    if status != "default":
        opts = smpckpt.AsyncOptions(enabled=True, exit_status=None if status == "none" else int(status))

    def broken(self: Any, plan: Any, planner: Any) -> Any:
        time.sleep(0.5)
        raise OSError(28, "No space left on device (injected)")

    FsspecStorageWriter.write_data = broken  # type: ignore[method-assign]
    smpckpt.Checkpointer(root, async_options=opts).save("lost", model=model(0))
    print("main returned", flush=True)
    if exit_code:
        sys.exit(int(exit_code))


def handled_failure(root: str, how: str) -> None:
    """Commit ``a``; save ``a`` again in the background (it fails: committed); the program looks at the failure
    ``how``: ``result`` (caught), ``exception`` (returned), or ``done`` (only asks whether it finished: unseen)."""
    c = smpckpt.Checkpointer(root, async_options=smpckpt.AsyncOptions(enabled=True))
    c.save("a", model=model(0)).result()
    fut = c.save("a", model=model(1))
    if how == "result":
        try:
            fut.result()
        except smpckpt.CheckpointExists as exc:
            print("handled:", type(exc).__name__, flush=True)
    elif how == "exception":
        print("handled:", type(fut.exception()).__name__, flush=True)
    else:
        concurrent.futures.wait([fut])
        print("done:", fut.done(), flush=True)
    print("main returned", flush=True)


def exit_wait_rank(rank: int, root: str, init: str, fail: str) -> None:
    """(a fresh interpreter, rank ``rank`` of 2) Log ``smpckpt`` at DEBUG; commit ``a``; start an async save of
    ``b`` that writes after a pause (failing on rank 1 with ``fail`` "fail"), and return, leaving it to the exit
    wait; the process group is torn down by a plain atexit hook, which runs after the exit wait."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logging.getLogger("smpckpt").addHandler(handler)
    logging.getLogger("smpckpt").setLevel(logging.DEBUG)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    atexit.register(dist.destroy_process_group)
    c = smpckpt.Checkpointer(root, async_options=smpckpt.AsyncOptions(enabled=True))
    c.save("a", model=model(0)).result()
    real = FsspecStorageWriter.write_data

    def late(self: Any, plan: Any, planner: Any) -> Any:
        time.sleep(1.0)  # the main thread is in interpreter shutdown by now
        if fail == "fail" and rank == 1:
            raise OSError(28, "No space left on device (injected)")
        return real(self, plan, planner)

    FsspecStorageWriter.write_data = late  # type: ignore[method-assign]
    c.save("b", model=model(1))
    print("main returned", flush=True)


def a_peer_stops_or_is_slow(rank: int, world: int, root: str, mode: str, bound: float) -> dict[str, Any]:
    """fix70c: at the start of its background write of ``b`` one rank stops itself (``stop0``/``stop1``:
    SIGSTOP, a vanished node keeping its connections) or rank 1 sleeps 2x ``bound``, the job's timeout
    (``slow``: healthy slow I/O), or rank 0 alone spends 2x ``bound`` after the others' part ended (``idle``:
    a healthy peer whose part was short, idle since). Each rank says what its future did, how long it took and ``newest``; the
    other rank then lets the stopped one go, waits for its own thread left behind, and says what is
    committed and what its next save said."""
    import smpckpt.api.checkpointer as ck
    from smpckpt.storage.format.manifest import MANIFEST_NAME

    m = model(0)
    ckpt = smpckpt.Checkpointer(root, async_options=smpckpt.AsyncOptions(enabled=True))
    ckpt.save("a", m).result()  # type: ignore[union-attr]
    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    real, stopped = ck.write_checkpoint, int(mode[-1]) if mode.startswith("stop") else None

    def held(*args: Any) -> None:
        if rank == stopped:
            os.kill(os.getpid(), signal.SIGSTOP)  # until the other rank sends SIGCONT
        elif rank == 1 and mode == "slow":
            time.sleep(2 * bound)
        real(*args)

    ck.write_checkpoint = held  # type: ignore[assignment]
    if mode == "idle":  # rank 0 alone applies retention 2x the bound while rank 1's lane is idle (rev70c H1)
        real_retain = ck.retain

        def slow_retain(*args: Any, **kwargs: Any) -> Any:
            if rank == 0:
                time.sleep(2 * bound)
            return real_retain(*args, **kwargs)

        ck.retain = slow_retain  # type: ignore[assignment]
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    want = {k: v.clone() for k, v in m.state_dict().items()}
    started = time.monotonic()
    fut = ckpt.save("b", m)
    try:
        fut.result(timeout=30)  # type: ignore[union-attr]
        said = "no error"
    except BaseException as exc:  # noqa: BLE001 - reported
        said = f"{type(exc).__name__}: {exc}"
    out: dict[str, Any] = {"said": said, "took": time.monotonic() - started}
    out["newest"] = open(os.path.join(root, "newest")).read().strip()
    if stopped is None:
        ckpt.close()
        fresh = model(9)
        smpckpt.Checkpointer(root).resume("b", fresh)
        out["equal"] = all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items())
        return out
    if rank != stopped:
        os.kill(pids[stopped], signal.SIGCONT)
        deadline = time.monotonic() + 60
        while getattr(ckpt._save_lane, "_current", None) is not None and time.monotonic() < deadline:
            time.sleep(0.05)  # the thread left behind ends now
        try:
            ckpt.save("c", m)
            out["next"] = "no error"
        except BaseException as exc:  # noqa: BLE001 - reported
            out["next"] = f"{type(exc).__name__}: {exc}"
        try:
            ckpt.close()  # raises the kept failure once; tears down no groups (out of step)
            out["closed"] = "no error"
        except BaseException as exc:  # noqa: BLE001 - reported
            out["closed"] = f"{type(exc).__name__}: {exc}"
    # each saw its own b end, after rank 0 decided on the commit: what is committed is settled
    out["newest_after"] = open(os.path.join(root, "newest")).read().strip()
    out["tags"] = sorted(t for t in "abc" if os.path.exists(os.path.join(root, f"{t}_partial", MANIFEST_NAME)))
    return out


class _CountedStore:
    """The job's store as ``smpckpt.api._liveness`` finds it, counting the connections cloned from it."""

    def __init__(self, inner: Any, clones: list[int]) -> None:
        self._inner, self.clones = inner, clones

    def clone(self) -> Any:
        self.clones.append(1)
        return self._inner.clone()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def the_store_host_stops(rank: int, world: int, root: str) -> dict[str, Any]:
    """fix71f, under ``tcp://`` (rank 0 hosts the job's store), after a healthy save ``a``. ``b``: rank 0, the
    store's host, stops itself (SIGSTOP) at the start of its write, and rank 1's lane starts its part 0.5 s
    later (rev70g: a late lane's clone of a stopped host hung its thread). Each rank says what its future did
    and how long it took; rank 1 then lets rank 0 go and waits for its own thread left behind; both say what is committed and how many
    store connections liveness cloned in the process (one per watch that read before: 1,000 connects per save
    at 1,000 ranks)."""
    import smpckpt.api.checkpointer as ck
    from smpckpt.api import _liveness

    clones: list[int] = []
    counted = _CountedStore(_liveness._store(), clones)
    _liveness._store = lambda: counted  # type: ignore[assignment]
    m = model(0)
    ckpt = smpckpt.Checkpointer(root, async_options=smpckpt.AsyncOptions(enabled=True))
    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    real, real_busy = ck.write_checkpoint, _liveness.busy_now
    ckpt.save("a", m).result()  # type: ignore[union-attr]
    out: dict[str, Any] = {}

    def held(*args: Any) -> None:
        if rank == 0:
            os.kill(os.getpid(), signal.SIGSTOP)  # until rank 1 sends SIGCONT
        real(*args)

    def late() -> None:
        time.sleep(0.5)
        real_busy()

    ck.write_checkpoint = held  # type: ignore[assignment]
    if rank == 1:
        _liveness.busy_now = late  # type: ignore[assignment]
    started = time.monotonic()
    try:
        ckpt.save("b", m).result(timeout=30)  # type: ignore[union-attr]
        out["said"] = "no error"
    except BaseException as exc:  # noqa: BLE001 - reported
        out["said"] = f"{type(exc).__name__}: {exc}"
    out["took"] = time.monotonic() - started
    if rank == 1:
        os.kill(pids[0], signal.SIGCONT)
        deadline = time.monotonic() + 30
        while getattr(ckpt._save_lane, "_current", None) is not None and time.monotonic() < deadline:
            time.sleep(0.05)  # the thread left behind ends now
    out["clones"] = len(clones)
    out["newest"] = open(os.path.join(root, "newest")).read().strip()
    return out


def a_background_collective_times_out(rank: int, world: int, root: str) -> dict[str, Any]:
    """fix70c: the background groups made with a 2 s timeout (torch's 30 minutes, shortened), rank 1 writes
    4 s late (alive: its heartbeat beats, no liveness give-up): rank 0's collective times out and the save
    fails; what each rank's next save says (the group is broken: gloo's "pair closure", naming no rank)."""
    import datetime

    import smpckpt.api.checkpointer as ck

    real_new_group = dist.new_group

    def short(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("backend") == "gloo":
            kwargs["timeout"] = datetime.timedelta(seconds=2)
        return real_new_group(*args, **kwargs)

    dist.new_group = short  # type: ignore[assignment]
    m = model(0)
    ckpt = smpckpt.Checkpointer(root, async_options=smpckpt.AsyncOptions(enabled=True))
    ckpt.save("a", m).result()  # type: ignore[union-attr]
    real = ck.write_checkpoint

    def late(*args: Any) -> None:
        if rank == 1:
            time.sleep(4)  # twice the groups' 2 s: rank 0's collective times out well before rank 1 comes
        real(*args)

    ck.write_checkpoint = late  # type: ignore[assignment]
    out: dict[str, Any] = {}
    for tag in ("b", "c", "d"):
        try:
            ckpt.save(tag, m).result(timeout=60)  # type: ignore[union-attr]
            out[tag] = "no error"
        except BaseException as exc:  # noqa: BLE001 - reported
            out[tag] = f"{type(exc).__name__}: {exc}"
        ck.write_checkpoint = real  # type: ignore[assignment]
    out["newest"] = open(os.path.join(root, "newest")).read().strip()
    return out


def a_peer_stops_in_a_drain(rank: int, world: int, root: str) -> dict[str, Any]:
    """fix70c: a fast tier per rank draining every save; in the drain of ``b`` rank 1 stops itself (SIGSTOP)
    before copying. Rank 0 says what its wait said and how long it took, and, once rank 1 is let go and
    its drain thread ended, ``path``'s ``newest`` and what is committed there."""
    import smpckpt.api._drain as drain_module
    from smpckpt.storage.format.manifest import MANIFEST_NAME

    os.environ["LOCAL_WORLD_SIZE"] = "1"
    m = model(0)
    tier = smpckpt.FastTier(f"{root}-fast/node{rank}", durable_every=1, num_kept_local=None)
    ckpt = smpckpt.Checkpointer(root, fast_tier=tier)
    ckpt.save("a", m)
    ckpt.wait()
    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    real = drain_module._Copies.copy_all

    def held(self: Any, dctx: Any, tag: str, files: Any) -> Any:
        if rank == 1 and tag == "b":
            os.kill(os.getpid(), signal.SIGSTOP)  # until rank 0 sends SIGCONT
        return real(self, dctx, tag, files)

    drain_module._Copies.copy_all = held  # type: ignore[method-assign]
    started = time.monotonic()
    ckpt.save("b", m)
    try:
        ckpt.wait()
        said = "no error"
    except BaseException as exc:  # noqa: BLE001 - reported
        said = f"{type(exc).__name__}: {exc}"
    out: dict[str, Any] = {"said": said, "took": time.monotonic() - started}
    if rank == 0:
        os.kill(pids[1], signal.SIGCONT)
        deadline = time.monotonic() + 60
        while getattr(ckpt._drain_lane, "_current", None) is not None and time.monotonic() < deadline:
            time.sleep(0.05)  # the thread left behind ends now
        out["newest"] = open(os.path.join(root, "newest")).read().strip()
        out["tags"] = sorted(t for t in "ab" if os.path.exists(os.path.join(root, f"{t}_partial", MANIFEST_NAME)))
    return out


if __name__ == "__main__":
    if sys.argv[1] == "returns-while-saving":
        returns_while_saving(sys.argv[2])
    elif sys.argv[1] == "handled-failure":
        handled_failure(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "exit-wait-rank":
        exit_wait_rank(int(sys.argv[2]), *sys.argv[3:6])
    elif sys.argv[1] == "fails-while-saving":
        fails_while_saving(*sys.argv[2:5])
    else:
        killed_during_background_write(sys.argv[1], sys.argv[2])


def dcp_process_mode(rank: int, world: int, root: str) -> bool:
    """dcp.async_save in *process* mode (a background process per rank) with our planner and writer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from smpckpt import ShardSpec
    from smpckpt.model.layout import ParallelLayout
    from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner
    from smpckpt.storage import FsspecStorageReader

    torch.manual_seed(rank)
    state = {"model": {"w": torch.randn(64, 32)}}
    want = state["model"]["w"].clone()
    layout, specs = ParallelLayout(tp=2), {"model.w": ShardSpec(0)}
    response = dcp.async_save(
        state,
        storage_writer=FsspecStorageWriter(os.path.join(root, "c")),
        planner=ParallelSavePlanner(layout, specs, enable_plan_caching=False),
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
    )
    getattr(response, "upload_completion", response).result()
    state["model"]["w"].zero_()
    dcp.load(
        state, storage_reader=FsspecStorageReader(os.path.join(root, "c")), planner=ParallelLoadPlanner(layout, specs)
    )
    # Stop DCP's background process now: it would otherwise die reading its pipe when this rank leaves
    # with os._exit, printing an EOFError. DCP has no public call for it; its __del__ asks it to end.
    import torch.distributed.checkpoint._async_process_executor as executor

    proc = getattr(executor, "_CHECKPOINT_PROCESS", None)
    if proc is not None:
        proc.__del__()
    return bool(torch.equal(state["model"]["w"], want))


def tied_dtensor_saves(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """(one gloo rank) A DTensor head tied to its embedding, saved synchronously and asynchronously:
    each save's tie record and data file sizes, and whether each resumes bit-exact and tied."""
    import glob
    import json

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(6, 4)
            self.head = torch.nn.Linear(4, 6, bias=False)
            self.embed.weight = torch.nn.Parameter(distribute_tensor(self.embed.weight.detach(), mesh, [Replicate()]))
            self.head.weight = self.embed.weight

    out: dict[str, Any] = {}
    for name, is_async in (("sync", False), ("async", True)):
        torch.manual_seed(0)
        m = Tied()
        done = smpckpt.save_checkpoint(
            root, name, model=m, options=smpckpt.SaveOptions(async_save=is_async, save_rng=False)
        )
        if is_async:
            done.result()
        folder = os.path.join(root, f"{name}_partial")
        manifest = json.load(open(os.path.join(folder, "smpckpt.manifest.json")))
        back = Tied()
        smpckpt.resume_from_checkpoint(root, name, model=back)
        out[name] = {
            "tied": manifest["extra"]["layout_record"].get("tied"),
            "sizes": sorted(os.path.getsize(p) for p in glob.glob(os.path.join(folder, "*.distcp"))),
            "equal": bool(torch.equal(back.embed.weight.to_local(), m.embed.weight.to_local())),
            "still_tied": back.head.weight is back.embed.weight,
        }
    return out


def destroyed_under_a_background_save(rank: int, world: int, root: str) -> dict[str, Any]:
    """hunt69b F2: an async save in flight, then ``destroy_process_group()`` without ``wait()``: what its future
    raises (it said "dcp.save's world has 1 ranks but the layout ... describes 2")."""
    import smpckpt.api.checkpointer as ck

    m = model(0)
    ckpt = smpckpt.Checkpointer(root, async_options=smpckpt.AsyncOptions(enabled=True))
    ckpt.save("a", m).result()  # type: ignore[union-attr]
    real, release = ck.write_checkpoint, threading.Event()

    def held(*args: Any) -> None:
        release.wait(60)  # until the group is gone
        real(*args)

    ck.write_checkpoint = held  # type: ignore[assignment]
    fut = ckpt.save("b", m)
    dist.destroy_process_group()
    release.set()
    try:
        fut.result(timeout=60)  # type: ignore[union-attr]
        said = "no error"
    except BaseException as exc:  # noqa: BLE001 - reported
        said = f"{type(exc).__name__}: {exc}"
    with contextlib.suppress(Exception):
        ckpt.wait()
    return {"said": said, "newest": open(os.path.join(root, "newest")).read().strip()}


def reused_after_the_group_was_made_again(rank: int, world: int, root: str, init: str) -> dict[str, Any]:
    """hunt69b F3: an in-process restart (destroy_process_group(), init_process_group() again) with the same
    Checkpointer: its save is refused by name; a new Checkpointer, and the smp face's kept one, save on."""
    import datetime

    m = model(0)
    ckpt = smpckpt.Checkpointer(root, async_options=smpckpt.AsyncOptions(enabled=True))
    ckpt.save("a", m).result()  # type: ignore[union-attr]
    smpckpt.save_checkpoint(root + "-smp", "a", model=m, async_save=True).result()  # type: ignore[union-attr]
    smpckpt.wait_for_saves()
    kept = m.__dict__["_smpckpt_checkpointer"].checkpointer  # the smp face's, left behind by the restart
    dist.destroy_process_group()
    timeout = datetime.timedelta(seconds=30)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=timeout)
    try:
        ckpt.save("b", m)
        said = "no error"
    except BaseException as exc:  # noqa: BLE001 - reported
        said = f"{type(exc).__name__}: {exc}"
    fresh = smpckpt.Checkpointer(root, async_options=smpckpt.AsyncOptions(enabled=True))
    fresh.save("c", m).result()  # type: ignore[union-attr]
    fresh.close()
    smpckpt.save_checkpoint(root + "-smp", "b", model=m, async_save=True).result()  # type: ignore[union-attr]
    smpckpt.wait_for_saves()
    newest = [open(os.path.join(r, "newest")).read().strip() for r in (root, root + "-smp")]
    return {"said": said, "newest": newest, "left_staged": kept._stager.nbytes()}  # rev69g M3: freed when replaced

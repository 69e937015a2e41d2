"""Launcher for ``tests/test_clean_exit.py``: many two-rank gloo saves as real, short-lived processes.

``python tests/clean_exit_worker.py --runs 20 --control 2 [--fresh 1] [--out DIR]`` prints one JSON report.

Each run is a fresh pair of rank processes. Both ranks rendezvous (a ``file://`` store, or a TCPStore
on 127.0.0.1 whose port rank 0 takes from the OS and hands over in a file), save a small state dict
with ``dcp.save`` + :class:`~smpckpt.planners.ParallelSavePlanner` +
:class:`~smpckpt.storage.FsspecStorageWriter` into a local folder, tear down the way a user script
does, and leave through **normal interpreter shutdown** (``sys.exit`` -> ``Py_FinalizeEx`` -> C
``exit()``): that is where the bug lives. A gloo worker thread still alive there aborts the process
(``terminate called without an active exception``, SIGABRT) when it releases a finished collective's
tensors and needs the GIL: CPython ends such a thread with ``pthread_exit``, whose unwinding through a
``noexcept`` destructor calls ``std::terminate``.

The abort itself is a race (a few percent of runs on a loaded machine), so every rank also checks,
in an ``atexit`` hook (which runs just before the interpreter starts finalizing), which threads are
still alive: a torch/gloo native thread (``pt_*``, ``gloo*``) or any Python thread other than the
main one is what can abort, and makes the rank exit with :data:`LEFTOVER_EXIT` at once, naming them.
That turns the race into a deterministic check.

Speed: importing torch takes seconds per process (more on a loaded machine), so the launcher imports
torch and smpckpt once, freezes its heap (``gc.freeze()``, so that a child's interpreter shutdown does
not walk and copy it) and ``fork``s the rank processes; every rank still runs its own init, save,
teardown and interpreter shutdown. ``--fresh N`` adds N pairs started as brand-new interpreters
(``subprocess``), the path a real launcher takes.

Teardowns: ``recipe`` (``--runs``, ``--fresh``) = ``dist.barrier()`` then ``dist.destroy_process_group()``,
what the README asks of user scripts; ``none`` (``--control``) = exit right after ``dcp.save``, the
reported bug, which the thread check must catch every time.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback

# One thread per process for the BLAS/OpenMP pools, set before torch and numpy are imported: the
# launcher must fork from a single thread, and the only threads a rank has are the ones checked here.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

#: exit status of a rank that found torch/gloo or Python threads alive when the interpreter began to exit
LEFTOVER_EXIT = 3
#: exit status of a rank whose save or teardown raised
ERROR_EXIT = 1
RUN_TIMEOUT = 60.0  # seconds for one pair, start to exit


def _native_threads() -> list[str]:
    """Names (``comm``) of this process's threads, main thread included (Linux /proc)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended while we looked
            pass
    return sorted(names)


def leftover_threads() -> list[str]:
    """Threads that can abort interpreter shutdown: torch/gloo native threads, non-main Python threads."""
    native = [n for n in _native_threads() if n.startswith(("pt_", "gloo"))]
    python = [f"py:{t.name}" for t in threading.enumerate() if t is not threading.main_thread()]
    return native + python


def _check_at_exit(report: str) -> None:
    left = leftover_threads()
    with open(report, "w") as f:
        json.dump({"leftover": left, "threads": _native_threads()}, f)
    if left:
        sys.stderr.write(f"threads alive at interpreter exit: {left}\n")
        sys.stderr.flush()
        os._exit(LEFTOVER_EXIT)  # deterministic: never let them race interpreter shutdown


def _init_group(rank: int, world: int, run_dir: str, rendezvous: str) -> object | None:
    """Initialise the default gloo group; returns the TCPStore (kept by the caller) or None."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=RUN_TIMEOUT)
    if rendezvous == "file":
        dist.init_process_group(
            "gloo", init_method=f"file://{run_dir}/rendezvous", rank=rank, world_size=world, timeout=timeout
        )
        return None
    port_file = os.path.join(run_dir, "port")
    if rank == 0:
        # port 0: the OS picks a free one, no probing and no race with other processes
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        with open(port_file + ".tmp", "w") as f:
            f.write(str(store.port))
        os.replace(port_file + ".tmp", port_file)
    else:
        deadline = time.monotonic() + RUN_TIMEOUT
        while not os.path.exists(port_file):
            if time.monotonic() > deadline:
                raise TimeoutError("rank 0 never published its TCPStore port")
            time.sleep(0.005)
        with open(port_file) as f:
            port = int(f.read())
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    return store


def rank_main(rank: int, world: int, run_dir: str, teardown: str, rendezvous: str) -> int:
    """One rank: init, save (our planner + writer), tear down; the exit code for this process."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from smpckpt import ParallelLayout, ShardSpec
    from smpckpt.planners import ParallelSavePlanner
    from smpckpt.storage import FsspecStorageWriter, checkpoint_state

    atexit.register(_check_at_exit, os.path.join(run_dir, f"rank{rank}.threads.json"))
    torch.set_num_threads(1)
    try:
        store = _init_group(rank, world, run_dir, rendezvous)
        ckpt = os.path.join(run_dir, "ckpt")
        state = {"w": torch.randn(8, 6) + rank, "b": torch.arange(4.0), "step": 7}  # w: a TP shard
        dcp.save(
            state,
            storage_writer=FsspecStorageWriter(ckpt),
            planner=ParallelSavePlanner(ParallelLayout(tp=world), {"w": ShardSpec(dim=0)}),
        )
        if rank == 0 and checkpoint_state(ckpt) != "committed":
            raise RuntimeError(f"save returned but {ckpt} is {checkpoint_state(ckpt)}")
        if teardown == "recipe":
            dist.barrier()  # every rank is past its last collective before any rank tears down
            dist.destroy_process_group()  # joins the groups' gloo threads while Python still runs
        del store
    except BaseException:  # noqa: BLE001 - reported through stderr and the exit status
        traceback.print_exc()
        return ERROR_EXIT
    return 0


# -- launching -----------------------------------------------------------------------------------------
def _reap(procs: list[tuple[int, int | subprocess.Popen]], deadline: float) -> dict[int, int | str]:
    """Wait for every rank (fork pids or Popen objects) until ``deadline``; exit codes by rank."""
    codes: dict[int, int | str] = {}
    while len(codes) < len(procs):
        for rank, p in procs:
            if rank in codes:
                continue
            if isinstance(p, subprocess.Popen):
                rc = p.poll()
                if rc is not None:
                    codes[rank] = rc
            else:
                pid, status = os.waitpid(p, os.WNOHANG)
                if pid:
                    codes[rank] = os.waitstatus_to_exitcode(status)  # -6 for SIGABRT
        if len(codes) < len(procs) and time.monotonic() > deadline:
            for rank, p in procs:
                if rank not in codes:
                    if isinstance(p, subprocess.Popen):
                        p.kill()
                        p.wait()
                    else:
                        os.kill(p, 9)
                        os.waitpid(p, 0)
                    codes[rank] = "timeout"
        time.sleep(0.005)
    return codes


def _fork_rank(rank: int, world: int, run_dir: str, teardown: str, rendezvous: str) -> int:
    pid = os.fork()
    if pid:
        return pid
    # -- the child: its own stdout/stderr file, then a normal interpreter exit (no os._exit) ---------
    fd = os.open(os.path.join(run_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.exit(rank_main(rank, world, run_dir, teardown, rendezvous))


def _spawn_rank(rank: int, world: int, run_dir: str, teardown: str, rendezvous: str) -> subprocess.Popen:
    log = open(os.path.join(run_dir, f"rank{rank}.log"), "wb")  # noqa: SIM115 - the child owns it
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--rank",
        str(rank),
        "--world",
        str(world),
        "--run-dir",
        run_dir,
        "--teardown",
        teardown,
        "--rendezvous",
        rendezvous,
    ]
    try:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    finally:
        log.close()


def _one_run(index: int, out: str, teardown: str, rendezvous: str, fresh: bool) -> dict:
    run_dir = os.path.join(out, f"run{index:03d}")
    os.makedirs(run_dir)
    start = time.monotonic()
    sys.stdout.flush()
    sys.stderr.flush()
    if fresh:
        procs = [(r, _spawn_rank(r, 2, run_dir, teardown, rendezvous)) for r in range(2)]
    else:
        procs = [(r, _fork_rank(r, 2, run_dir, teardown, rendezvous)) for r in range(2)]
    codes = _reap(procs, start + RUN_TIMEOUT * (3 if fresh else 1))
    ranks = []
    for r in range(2):
        info: dict = {"rank": r, "exit": codes[r]}
        try:
            with open(os.path.join(run_dir, f"rank{r}.threads.json")) as f:
                info.update(json.load(f))
        except (OSError, ValueError):
            info["leftover"] = None  # the atexit check never ran (killed, aborted earlier)
        if codes[r] != 0:
            with open(os.path.join(run_dir, f"rank{r}.log"), errors="replace") as f:
                info["log_tail"] = f.read()[-1500:]
        ranks.append(info)
    return {
        "run": index,
        "teardown": teardown,
        "fresh": fresh,
        "rendezvous": rendezvous,
        "seconds": round(time.monotonic() - start, 3),
        "ranks": ranks,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20, help="forked rank pairs with the recipe teardown")
    p.add_argument("--control", type=int, default=0, help="forked rank pairs that skip the teardown")
    p.add_argument("--fresh", type=int, default=0, help="recipe pairs started as new interpreters")
    p.add_argument(
        "--rendezvous",
        choices=("file", "tcp", "both"),
        default="both",
        help="both: alternate file:// and TCPStore runs",
    )
    p.add_argument("--out", help="folder for run folders (default: a temporary one, removed)")
    # one rank of a --fresh pair (internal)
    p.add_argument("--rank", type=int)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--run-dir")
    p.add_argument("--teardown", choices=("recipe", "none"), default="recipe")
    args = p.parse_args(argv)
    if args.rank is not None:
        sys.exit(rank_main(args.rank, args.world, args.run_dir, args.teardown, args.rendezvous))

    # Import once here; forked ranks inherit it. Nothing here may start a thread before the forks.
    import gc

    import torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401

    import smpckpt.planners  # noqa: F401
    import smpckpt.storage  # noqa: F401

    out = args.out or tempfile.mkdtemp(prefix="smpckpt-clean-exit-")
    os.makedirs(out, exist_ok=True)
    started = time.monotonic()
    gc.collect()
    gc.freeze()
    modes = ["file", "tcp"] if args.rendezvous == "both" else [args.rendezvous]
    plan = [("recipe", False)] * args.runs + [("none", False)] * args.control + [("recipe", True)] * args.fresh
    runs = [_one_run(i, out, teardown, modes[i % len(modes)], fresh) for i, (teardown, fresh) in enumerate(plan)]
    report = {"seconds": round(time.monotonic() - started, 2), "launcher_threads": _native_threads(), "runs": runs}
    if not args.out:
        shutil.rmtree(out, ignore_errors=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()

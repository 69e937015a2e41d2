"""Run a function on N real gloo ranks on 127.0.0.1 (tier-2 tests).

Rendezvous goes through a ``file://`` store in a fresh temp dir, so no port is chosen by hand. Each
rank's return value (picklable) comes back in rank order; an exception on any rank is re-raised in
the parent with that rank's traceback. Every wait is bounded.

Teardown is ordered and its end deterministic. A rank whose function returned waits at a barrier
(no rank tears down while a peer is still inside a collective) and destroys the process group;
then, with its result on disk, it leaves with ``os._exit``. Interpreter shutdown is
skipped on purpose: torch 2.13's DTensor caches keep a ``DeviceMesh`` and its process groups alive
past ``destroy_process_group()``, so their gloo worker threads would otherwise be joined inside
``Py_FinalizeEx``, where a worker still releasing a finished collective's tensors needs the GIL, is
ended by ``pthread_exit`` and aborts the rank (SIGABRT, ``terminate called without an active
exception``), at random, after its work succeeded. A rank whose function raised skips the barrier and
the destroy (a collective may still be in flight on it, and destroying would wait on it): it reports
and exits, and the closed sockets fail any peer still waiting on it at once. No rank runs a full
``gc.collect()`` before it leaves: with ``os._exit`` next, a group held only by a reference cycle goes
with the process anyway, and a full collection walks every object the fork server imported (255,000:
0.2-0.5 CPU-s per rank, over a second of wall time per 4-rank world on 2 cores, minutes of the suite).

Ranks start from a fork server that has imported torch, ``torch.distributed`` and the package once
(:data:`PRELOAD`), not as fresh interpreters: a spawned rank spent about two CPU-seconds importing
them, on every rank of every world, which on a 2-core CI machine was minutes of the suite. The fork
server is started once per test process (before any rank's work, with no thread or process group of
its own), so its children fork from a clean importer. What a fork server would get wrong is the
environment: its children inherit the server's, frozen when it started, so each rank is handed the
parent's environment at call time (a test's ``monkeypatch.setenv`` reaches the ranks as it did when
they were spawned) and the package reads its variables at call time, never at import. Variables torch
reads at its own import (``TORCH_DISTRIBUTED_DEBUG``, ``TORCH_LOGS``) are the fork server's: a test that
needs them set must start its processes itself. Random state is the other thing a fork shares: torch's
default generator (seeded from the OS once per process, at import) and numpy's would be the same on
every rank, hiding a rank-mixup of RNG states or replicas drifting apart, so each rank reseeds both
from the OS first, as a fresh interpreter would.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["run_world", "RankFailed"]

#: imported once by the fork server; every rank forks from it with these modules loaded. transformers'
#: models (1.1 CPU-s a rank, ~20 ranks in the suite: fix73d) start no thread at import, so forking stays safe
PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "smpckpt", "transformers.modeling_utils"]


class RankFailed(AssertionError):
    pass


def _teardown() -> None:
    """After ``fn`` returned on this rank: barrier, then destroy the groups while Python still runs."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return  # fn tore the group down itself
    try:
        dist.barrier()  # every rank is past its last collective before any rank destroys its groups
    except Exception:  # noqa: BLE001 - a peer failed or left; its own report says why
        return  # a broken group goes with the process (os._exit below)
    dist.destroy_process_group()  # no gc.collect(): os._exit follows (see the module docstring)


def _tcp_store(rank: int, world_size: int, out_dir: str, timeout: Any) -> Any:
    """The job's TCPStore: rank 0 hosts it on port 0 (the OS picks a free one: no port chosen in the parent and
    released before the ranks bind it) and publishes the port in a file the others wait for
    (tests/clean_exit_worker.py does the same)."""
    import time

    import torch.distributed as dist

    port_file = os.path.join(out_dir, "port")
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        with open(port_file + ".tmp", "w") as f:
            f.write(str(store.port))
        os.replace(port_file + ".tmp", port_file)
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while not os.path.exists(port_file):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 never published its TCPStore port in {port_file}")
        time.sleep(0.005)
    with open(port_file) as f:
        port = int(f.read())
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)


def _entry(
    rank: int,
    world_size: int,
    init_method: str,
    out_dir: str,
    env: dict[str, str],
    fn: Callable[..., Any],
    args: tuple,
    pg_timeout: float | None = None,
) -> None:
    import datetime

    import numpy as np
    import torch
    import torch.distributed as dist

    os.environ.clear()  # the caller's environment now, not the fork server's from when it started
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.seed()  # a seed of this process's own, as a spawned interpreter draws at import (see above)
    np.random.seed()
    result: Any
    try:
        timeout = datetime.timedelta(seconds=pg_timeout) if pg_timeout is not None else None
        if init_method == "tcp":  # rank 0 hosts the job's store, on a port the OS picked (no race)
            store = _tcp_store(rank, world_size, out_dir, timeout or dist.default_pg_timeout)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        else:
            dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
        result = ("ok", fn(rank, world_size, *args))
        _teardown()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent with its traceback
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    # Not a normal interpreter exit: see the module docstring. Exit status 0 either way; the result
    # file says ok or error.
    os._exit(0)


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 240.0,
    pg_timeout: float | None = None,
    tcp: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; return their results.
    ``pg_timeout``: the default group's timeout in seconds (``None``: torch's default). ``tcp``: rendezvous
    through a TCPStore that rank 0 hosts on a loopback port the OS picks (the job's store, as under ``tcp://``
    in a real job) instead of ``file://``.

    ``fn`` must be importable (a module-level function). Raises :class:`RankFailed` naming every rank
    that raised or did not finish within ``timeout`` seconds.
    """
    # Takes effect when this process first starts its fork server; later calls change nothing.
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory(prefix="smpckpt-world-") as tmp:
        init_method = f"file://{os.path.join(tmp, 'rendezvous')}"
        if tcp:
            init_method = "tcp"  # rank 0 makes the store (_tcp_store)
        ctx = mp.start_processes(
            _entry,
            args=(world_size, init_method, tmp, dict(os.environ), fn, args, pg_timeout),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        deadline_ok = True
        import time

        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                deadline_ok = False
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                break
        results: list[Any] = []
        failures: list[str] = []
        for rank in range(world_size):
            path = os.path.join(tmp, f"rank{rank}.pkl")
            if not os.path.exists(path):
                failures.append(f"rank {rank}: no result ({'timed out' if not deadline_ok else 'died'})")
                results.append(None)
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                failures.append(f"rank {rank}: {value}")
            results.append(value)
        if failures:
            raise RankFailed("\n".join(failures))
        return results

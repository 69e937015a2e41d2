"""Rank functions for tests/storage/test_tier_stream.py: two ranks, each a node of its own, sending the
files they write to each other with :class:`smpckpt.storage.tier.Replicator`; and a rank whose data sends
are held back (a peer that does not take its bytes), then released or failed, to watch its writer wait."""

from __future__ import annotations

import json
import os
import threading
import time
import zlib
from typing import Any

import torch.distributed as dist

from smpckpt.storage.backends._sinks import LocalSink
from smpckpt.storage.tier import Replicator

BIG = 3 << 20  # larger than the coalescing size: sent as its own message while it is written


def payload(rank: int, name: str, size: int) -> bytes:
    """Distinct bytes per rank and file."""
    seed = (zlib.crc32(f"{rank}/{name}".encode()) & 0xFF) or 1
    return bytes((seed * (i + 1)) % 251 for i in range(256)) * (size // 256) + b"x" * (size % 256)


def exchange(rank: int, world: int, base: str) -> dict[str, Any]:
    """Each rank writes four files into its own folder through the replicator: one in many small writes,
    one in big writes, one empty, and one aborted half-way; rank 1 also names a file ``../escape``
    (its receiver refuses it, without blocking the stream). What each folder holds afterwards, and the
    errors each rank saw."""
    folder = os.path.join(base, f"node{rank}")
    os.makedirs(folder, exist_ok=True)
    groups = [dist.new_group(backend="gloo") for _ in range(2)]
    rep = Replicator(
        rank=rank, world_size=world, local_world_size=1, replicas=2, groups=groups, folder=folder, sync=True
    )
    rep.start()
    files = {"small.bin": 100_003, "big.bin": 2 * BIG + 17, "empty.bin": 0}
    for name, size in files.items():
        data = payload(rank, name, size)
        sink = rep.sink(LocalSink(os.path.join(folder, f"own-{rank}-{name}"), sync=True), f"from{rank}-{name}")
        step = 999 if name == "small.bin" else BIG
        for i in range(0, len(data), step):
            sink.write(memoryview(data)[i : i + step])
        sink.commit()
    sink = rep.sink(LocalSink(os.path.join(folder, f"own-{rank}-aborted"), sync=True), f"from{rank}-aborted.bin")
    sink.write(memoryview(payload(rank, "aborted", BIG)))
    sink.abort()
    if rank == 1:
        sink = rep.sink(LocalSink(os.path.join(folder, "own-1-escape"), sync=True), "../escape")
        sink.write(memoryview(b"not here"))
        sink.commit()
        sink = rep.sink(LocalSink(os.path.join(folder, "own-1-after"), sync=True), "from1-after.bin")
        sink.write(memoryview(payload(1, "after", 5000)))
        sink.commit()
    outcome = rep.close()
    dist.barrier()
    peer = 1 - rank
    want = {f"from{peer}-{name}": payload(peer, name, size) for name, size in files.items()}
    if peer == 1:
        want["from1-after.bin"] = payload(1, "after", 5000)
    got = {}
    for name in want:
        if os.path.exists(os.path.join(folder, name)):
            with open(os.path.join(folder, name), "rb") as f:
                got[name] = f.read() == want[name]
    return {
        "listing": sorted(os.listdir(folder)),
        "received": sorted(t.name for t in outcome.received),
        "errors": outcome.errors,
        "exact": got,
        "escaped": os.path.exists(os.path.join(base, "escape")),
    }


# -- the senders' queue bounded by bytes ------------------------------------------------------------------
CAP = 4 << 20  #: the queue cap the tests give the replicator
WRITE = 1 << 20  #: each write: its own message (above the coalescing size)
WRITES = 16  #: 16 MiB in all: four times the cap


def _held_back_sends(rank: int) -> tuple[Any, threading.Event, dict[str, int], Any]:
    """Rank ``rank``'s data sends wait for the returned event (a peer that does not take its bytes); the
    bytes each rank's senders finished sending are counted (before the replicator learns of it)."""
    import smpckpt.storage.tier.writer as writer

    gate = threading.Event()
    counts = {"sent": 0}
    real_send = writer._Sender._send

    def held_send(self: Any, kind: int, file: int, payload: Any, n: int, extra: int) -> None:
        if kind == writer.DATA and rank == 0:
            if not gate.wait(120):
                raise TimeoutError("the test never released the sends")
            if counts.get("fail"):
                raise ConnectionError("the peer is gone (injected)")
        real_send(self, kind, file, payload, n, extra)
        if kind == writer.DATA:
            counts["sent"] += n

    writer._Sender._send = held_send  # type: ignore[method-assign]
    return writer, gate, counts, real_send


def _write_held(rep: Any, folder: str, data: bytes, counts: dict[str, int], out: dict[str, Any]) -> None:
    """(rank 0's producer thread) One file in ``WRITES`` writes; after each, what its senders hold queued
    (written but not yet sent: an upper bound, the send is counted before the replicator releases it)."""
    sink = rep.sink(LocalSink(os.path.join(folder, "own-0-held.bin"), sync=False), "from0-held.bin")
    written = 0
    try:
        for i in range(WRITES):
            sink.write(memoryview(data)[i * WRITE : (i + 1) * WRITE])
            written += WRITE
            out["peak"] = max(out["peak"], written - counts["sent"])
        out["written"] = True
        sink.commit()
    except Exception as exc:  # noqa: BLE001 - the failing case expects it
        out["error"] = f"{type(exc).__name__}: {exc}"
        sink.abort()


def _wait_blocked_or_done(rep: Any, out: dict[str, Any], thread: threading.Thread) -> bool:
    """Until rank 0's producer waits for its senders (the cap reached) or wrote everything (no cap); a
    bounded wait for a state, not a sleep. Whether it was seen waiting."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if getattr(rep, "waiting", 0) > 0:
            return True
        if out.get("written") or not thread.is_alive():
            return False
        time.sleep(0.01)
    raise TimeoutError("rank 0's producer neither waited nor finished")


def _capped_replicator(rank: int, world: int, base: str) -> tuple[Any, Any, str, Replicator]:
    """This rank's data sends held back (the gate, the counts), its node folder and a started
    :class:`Replicator` whose queue is capped at ``CAP``."""
    _, gate, counts, _ = _held_back_sends(rank)
    folder = os.path.join(base, f"node{rank}")
    os.makedirs(folder, exist_ok=True)
    rep = Replicator(
        rank=rank,
        world_size=world,
        local_world_size=1,
        replicas=2,
        groups=[dist.new_group(backend="gloo")],
        folder=folder,
        sync=False,
        max_queued=CAP,
    )
    rep.start()
    return gate, counts, folder, rep


def bounded_queue(rank: int, world: int, base: str) -> dict[str, Any]:
    """Rank 0 writes 16 MiB while its data sends are held back (cap 4 MiB): it must wait with at most the
    cap queued; released, the file reaches rank 1 whole."""
    gate, counts, folder, rep = _capped_replicator(rank, world, base)
    data = payload(0, "held", WRITES * WRITE)
    out: dict[str, Any] = {"peak": 0}
    if rank == 0:
        producer = threading.Thread(target=_write_held, args=(rep, folder, data, counts, out))
        producer.start()
        out["waited"] = _wait_blocked_or_done(rep, out, producer)
        out["peak_while_held"] = out["peak"]
        gate.set()
        producer.join(120)
    outcome = rep.close()
    dist.barrier()
    if rank == 1:
        with open(os.path.join(folder, "from0-held.bin"), "rb") as f:
            out["exact"] = f.read() == data
    out["errors"] = outcome.errors
    return out


def failed_peer(rank: int, world: int, base: str) -> dict[str, Any]:
    """As :func:`bounded_queue`, but rank 0's held sends then fail (the peer's connection lost): the
    waiting producer must wake with an error naming the peer, not hang. Rank 0's report goes to a file:
    rank 1 then leaves without a result (rank 0's broken channel never sends it the end of the stream)."""
    gate, counts, folder, rep = _capped_replicator(rank, world, base)
    done = os.path.join(base, "rank0-done")
    if rank == 1:
        deadline = time.monotonic() + 120
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.01)
        os._exit(0)  # a stopped peer: rank 0's receiver from it fails at once, its close() returns
    out: dict[str, Any] = {"peak": 0}
    producer = threading.Thread(target=_write_held, args=(rep, folder, payload(0, "held", WRITES * WRITE), counts, out))
    producer.start()
    out["waited"] = _wait_blocked_or_done(rep, out, producer)
    counts["fail"] = 1
    gate.set()
    producer.join(60)
    out["producer_alive"] = producer.is_alive()
    with open(os.path.join(base, "report.json"), "w") as f:
        json.dump(out, f)
    with open(done, "w"):
        pass
    outcome = rep.close()
    out["errors"] = outcome.errors
    with open(os.path.join(base, "report.json"), "w") as f:
        json.dump(out, f)
    return out


# -- two saves' replicators over one Workers (rss61) -------------------------------------------------------
def reused_workers(rank: int, world: int, base: str) -> dict[str, Any]:
    """Two saves, each a Replicator over the same :class:`Workers`, each sending a file written in one
    write of twice ``CHUNK`` and more: the largest data message queued, the threads of the workers after
    each save (names, idents) and after close, whether the peer's file arrived byte-exact."""
    from smpckpt.storage.tier import Workers
    from smpckpt.storage.tier.writer import CHUNK, DATA

    groups, workers = [dist.new_group(backend="gloo")], Workers("smpckpt-test-replica")
    sizes: list[int] = []
    out: dict[str, Any] = {"threads": [], "exact": [], "errors": []}

    def threads() -> list[tuple[str, int | None]]:
        return sorted((t.name, t.ident) for t in threading.enumerate() if t.name.startswith(workers.name))

    for save in range(2):
        folder, size = os.path.join(base, f"save{save}", f"node{rank}"), 2 * CHUNK + 5
        os.makedirs(folder)
        rep = Replicator(
            rank=rank,
            world_size=world,
            local_world_size=1,
            replicas=2,
            groups=groups,
            folder=folder,
            sync=False,
            workers=workers,
        )
        put = rep._put

        def spy(f: Any, kind: int, data: Any = None, n: int = 0, extra: int = 0, put: Any = put) -> None:
            if kind == DATA:
                sizes.append(len(data))
            put(f, kind, data, n, extra)

        rep._put = spy  # type: ignore[method-assign]
        rep.start()
        sink = rep.sink(LocalSink(os.path.join(folder, "own"), sync=False), "from.bin")
        sink.write(memoryview(payload(rank, f"huge{save}", size)))
        sink.commit()
        out["errors"] += rep.close().errors
        dist.barrier()
        out["threads"].append(threads())
        with open(os.path.join(folder, "from.bin"), "rb") as f:
            out["exact"].append(f.read() == payload(1 - rank, f"huge{save}", size))
    workers.close()
    return {**out, "largest": max(sizes), "chunk": CHUNK, "after_close": threads()}

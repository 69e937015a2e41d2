"""What reading ``.metadata`` through the bounded, allow-listed unpickler costs.

``load_metadata`` (``smpckpt.storage.format._safe_pickle``) runs the C unpickler with guards: a Python
``__setstate__`` per DCP object (bounded BUILD), a Python call per ``torch.Size`` (charged to the
load's budget), and a pass at the end turning per-load stand-ins into the real classes. Measured here
against a plain ``pickle.loads`` of the same bytes with the collector paused as ``load_metadata``
pauses it (no allow-list, no bounds: what stock DCP does, less its collections),
for a Megatron-like Metadata of ``--tensors`` tensors in ``--chunks`` chunks each (the storage index
has one record per chunk), interleaved rounds, medians of CPU time (``time.process_time``: the
machines these run on are shared) and of the ratio per round.

    python benchmarks/bench_metadata_load.py [--quick] [--out benchmarks/out/metadata_load.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import platform
import statistics
import time
from datetime import datetime, timezone
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from smpckpt._gc import gc_paused
from smpckpt.storage.format._safe_pickle import load_metadata


def metadata(tensors: int, chunks: int) -> Metadata:
    """A Metadata as DCP writes it: per tensor its chunks, per chunk a storage record and planner path."""
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for t in range(tensors):
        key = f"model.layers.{t}.mlp.weight"
        offsets = [torch.Size([c * 128, 0]) for c in range(chunks)]
        state[key] = TensorStorageMetadata(
            properties=TensorProperties(dtype=torch.bfloat16),
            size=torch.Size([chunks * 128, 4096]),
            chunks=[ChunkStorageMetadata(offsets=o, sizes=torch.Size([128, 4096])) for o in offsets],
        )
        for c, o in enumerate(offsets):
            storage[MetadataIndex(key, o)] = _StorageInfo(f"__{c}_0.distcp", t * 1 << 20, 1 << 20)
    planner_data = {k: ("model", k.removeprefix("model.")) for k in state}
    return Metadata(state, planner_data=planner_data, storage_data=storage)


def _plain(data: bytes) -> Any:
    with gc_paused():
        return pickle.loads(data)


def _cpu(fn: Any) -> float:
    gc.collect()
    start = time.process_time()
    fn()
    return time.process_time() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small Metadata and few rounds (seconds)")
    ap.add_argument("--tensors", type=int, default=None, help="tensors (default 5000, quick 200)")
    ap.add_argument("--chunks", type=int, default=8, help="chunks per tensor")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 15, quick 3)")
    ap.add_argument("--out", default="benchmarks/out/metadata_load.json")
    args = ap.parse_args()
    tensors = args.tensors or (200 if args.quick else 5000)
    rounds = args.rounds or (3 if args.quick else 15)
    data = pickle.dumps(metadata(tensors, args.chunks), protocol=pickle.HIGHEST_PROTOCOL)
    if load_metadata(data, where="bench") != pickle.loads(data):
        raise SystemExit("the bounded load differs from pickle.loads")
    bounded: list[float] = []
    plain: list[float] = []
    for i in range(rounds):
        # alternate which goes first: neither always meets the collector's leftovers
        pair = [("bounded", lambda: load_metadata(data, where="bench")), ("plain", lambda: _plain(data))]
        for name, fn in pair if i % 2 else pair[::-1]:
            (bounded if name == "bounded" else plain).append(_cpu(fn))
    ratio = statistics.median(b / p for b, p in zip(bounded, plain))
    b_s, p_s = statistics.median(bounded), statistics.median(plain)
    print(f".metadata of {tensors} tensors x {args.chunks} chunks: {len(data) / 2**20:.1f} MiB, {rounds} rounds")
    print(f"  load_metadata (bounded)  {b_s * 1e3:8.1f} ms CPU")
    print(f"  pickle.loads (no checks) {p_s * 1e3:8.1f} ms CPU")
    print(f"  ratio (median per round) {ratio:.2f}x")
    result = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "tensors": tensors,
        "chunks": args.chunks,
        "bytes": len(data),
        "rounds": rounds,
        "cpu_ms": {"bounded": b_s * 1e3, "plain": p_s * 1e3},
        "ratio": ratio,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

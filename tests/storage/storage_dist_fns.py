"""Rank functions for the multi-process tests (module-level so spawned ranks can import them)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException

# No module-level warning filters: spawned ranks import this module, and a blanket "ignore" here hid
# every warning the ranks raise (they raise none today; a new one must be seen).


def full_w(seed: int) -> torch.Tensor:
    return torch.randn(64, 48, generator=torch.Generator().manual_seed(seed))


def _sharded_state(mesh: Any, seed: int) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    return {
        "w": distribute_tensor(full_w(seed), mesh, [Shard(0)]),
        "b": torch.arange(10.0) + seed,
        "step": seed,
    }


def _full_from(mesh: Any, like: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, distribute_tensor

    return {"w": distribute_tensor(torch.zeros(64, 48), mesh, [Replicate()]), "b": torch.zeros(10), "step": None}


class _FailOnRank(DefaultSavePlanner):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.bad_rank = rank

    def resolve_data(self, write_item: Any) -> Any:
        if dist.get_rank() == self.bad_rank:
            raise RuntimeError(f"injected failure on rank {self.bad_rank}")
        return super().resolve_data(write_item)


def save_load_and_fail(rank: int, world: int, url: str, opts: dict[str, Any]) -> dict[str, Any]:
    """Save sharded state, load it into a replicated layout, then fail an overwrite on rank 1."""
    from torch.distributed.device_mesh import init_device_mesh

    from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter, checkpoint_state, read_manifest

    mesh = init_device_mesh("cpu", (world,))
    returned = dcp.save(_sharded_state(mesh, 1), storage_writer=FsspecStorageWriter(url, storage_options=opts))
    stored = FsspecStorageReader(url, storage_options=opts).read_metadata()
    out = _full_from(mesh, {})
    dcp.load(out, storage_reader=FsspecStorageReader(url, storage_options=opts))
    ok_first = (
        torch.equal(out["w"].full_tensor(), full_w(1))
        and torch.equal(out["b"], torch.arange(10.0) + 1)
        and out["step"] == 1
    )
    save_id = read_manifest(url, opts).save_id
    failed_everywhere = False
    writer = FsspecStorageWriter(url, storage_options=opts, overwrite=True)
    try:
        dcp.save(_sharded_state(mesh, 2), storage_writer=writer, planner=_FailOnRank(1))
    except CheckpointException as exc:
        failed_everywhere = "injected failure on rank 1" in str(exc)
        # rank 0 completed its files of the failed save; each rank removes its own
        not_removed = writer.discard_failed_save()
    dist.barrier()
    fs, path = writer.fs, writer.path
    on_disk = {p[len(path) + 1 :] for p in fs.find(path) if p.endswith(".distcp")}
    out2 = _full_from(mesh, {})
    dcp.load(out2, storage_reader=FsspecStorageReader(url, storage_options=opts))
    return {
        "ok_first": ok_first,
        # what dcp.save returns on every rank (broadcast as the metadata file's bytes) maps every index
        # to what the committed file records
        "returned_index": type(returned.storage_data).__name__ == "CommittedView"
        and dict(returned.storage_data) == dict(stored.storage_data)
        and dict(returned.state_dict_metadata) == stored.state_dict_metadata
        and len(stored.storage_data) >= 3,
        "failed_everywhere": failed_everywhere,
        "old_still_loads": torch.equal(out2["w"].full_tensor(), full_w(1)) and out2["step"] == 1,
        "same_commit": read_manifest(url, opts).save_id == save_id,
        "state": checkpoint_state(url, opts),
        "files": len(read_manifest(url, opts).files),
        # only the committed generation's data files are left
        "stray_files": sorted(on_disk - {f.name for f in read_manifest(url, opts).files}),
        "not_removed": not_removed,
    }


def reshard_load(rank: int, world: int, url: str) -> dict[str, Any]:
    """Load a TP=1 checkpoint of ``big`` [4096, 256] as dim-0 shards; report bytes read vs needed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from smpckpt.storage import FsspecStorageReader

    mesh = init_device_mesh("cpu", (world,))
    full = torch.randn(4096, 256, generator=torch.Generator().manual_seed(3))
    dest = {"big": distribute_tensor(torch.zeros(4096, 256), mesh, [Shard(0)])}
    reader = FsspecStorageReader(url)
    dcp.load(dest, storage_reader=reader)
    local = dest["big"].to_local()
    rows = 4096 // world
    stats = reader.last_read_stats
    assert stats is not None
    return {
        "equal": torch.equal(local, full[rank * rows : (rank + 1) * rows]),
        "needed": stats.bytes_needed,
        "read": stats.bytes_read,
        "local_bytes": local.numel() * local.element_size(),
    }


def killed_rank(rank: int, world: int, url: str) -> None:
    """Rank 1 dies (os._exit) in the middle of writing its data; rank 0 must error out, not hang."""
    from torch.distributed.device_mesh import init_device_mesh

    from smpckpt.storage import FsspecStorageWriter

    class Dying(FsspecStorageWriter):
        def _open_sink(self, name: str) -> Any:
            if rank == 1:
                sink = super()._open_sink(name)
                sink.write(memoryview(b"partial bytes"))
                os._exit(17)
            return super()._open_sink(name)

    mesh = init_device_mesh("cpu", (world,))
    dcp.save(_sharded_state(mesh, 5), storage_writer=Dying(url, overwrite=True))


def kill_entry(rank: int, world: int, init_file: str, url: str, out_dir: str) -> None:
    """Own process entry for the kill test (the shared harness stops all ranks when one dies)."""
    import datetime
    import traceback

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    try:
        killed_rank(rank, world, url)
        result = "saved"
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        result = f"error: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(result)
    os._exit(0)

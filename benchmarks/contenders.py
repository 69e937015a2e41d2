"""The contenders of the benchmark driver (``bench.py``): one small save/load pair each.

Every pair takes ``(state, url)``: ``state`` is this rank's flat ``{key: tensor}`` (its TP shards; the
checkpoint holds it under ``"model"``), ``url`` a fresh folder or ``s3://bucket/prefix`` for this round.
``save`` returns when the checkpoint is durable; ``load`` fills preallocated tensors in place and returns
the reader's ``ReadStats`` when it has them (smpckpt) or None.

Every DCP-based contender runs with smpckpt's ``ParallelSavePlanner``/``ParallelLoadPlanner``: they
compare *storage* layers, and DCP's default planner would drop plain same-name TP shards (it takes them
for replicas). So all of them write the same items; only the writer/reader differs. Raw I/O and
torch.save write each rank's whole local state to a file of its own (``rank<r>/``).

CUDA tensors: the DCP writers copy device to host inside ``save`` (so does torch.save); the raw ceiling
copies with ``.cpu()`` inside its timer and loads through host buffers, so the copies are counted for all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from bench_storage import raw_load, raw_save, torch_load, torch_save
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

from smpckpt import gc_frozen
from smpckpt.model.layout import ParallelLayout
from smpckpt.model.specs import ShardSpec
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter, FullArtifactWriter

__all__ = ["Ctx", "Contender", "State", "contenders", "select", "OURS", "OURS_FULL"]

State = dict[str, torch.Tensor]
OURS = "smpckpt partial"
OURS_FULL = "smpckpt full"
LOCAL = frozenset({"disk", "shm"})
ANY = frozenset({"disk", "shm", "s3"})


@dataclasses.dataclass(frozen=True)
class Ctx:
    """What every contender of one run shares."""

    layout: ParallelLayout
    specs: dict[str, ShardSpec]
    rank: int
    s3_options: dict[str, Any]  #: s3fs storage options (empty without S3)
    region: str = "us-east-1"
    process_group: Any = None  #: the group DCP coordinates on (gloo beside an NCCL default group)


@dataclasses.dataclass(frozen=True)
class Contender:
    name: str
    save: Callable[[State, str], None]
    load: Callable[[State, str], Any]
    storages: frozenset[str]  #: where it runs: disk, shm, s3
    unavailable: str = ""  #: why it cannot run here (then it is listed as skipped)
    #: runs only when ``--contenders`` names it by a part of its name no regular contender shares
    opt_in: bool = False


def _sp(ctx: Ctx) -> ParallelSavePlanner:
    return ParallelSavePlanner(ctx.layout, ctx.specs, rank=ctx.rank, enable_plan_caching=False)


def _lp(ctx: Ctx) -> ParallelLoadPlanner:
    return ParallelLoadPlanner(ctx.layout, ctx.specs, rank=ctx.rank)


def _opts(ctx: Ctx, url: str) -> dict[str, Any]:
    return ctx.s3_options if url.startswith("s3://") else {}


def _dcp_pair(
    ctx: Ctx, writer: Callable[[str], Any], reader: Callable[[str], Any], *, frozen: bool = False
) -> tuple[Callable[[State, str], None], Callable[[State, str], Any]]:
    """save/load through dcp with our planners and the given writer/reader factories; ``frozen``:
    inside ``smpckpt.gc_frozen()``, as ``save_checkpoint``/``resume_from_checkpoint`` run them."""

    def around() -> contextlib.AbstractContextManager[None]:
        return gc_frozen() if frozen else contextlib.nullcontext()

    def save(sd: State, url: str) -> None:
        with around():
            dcp.save({"model": sd}, storage_writer=writer(url), planner=_sp(ctx), process_group=ctx.process_group)

    def load(dest: State, url: str) -> Any:
        r = reader(url)
        with around():
            dcp.load({"model": dest}, storage_reader=r, planner=_lp(ctx), process_group=ctx.process_group)
        return getattr(r, "last_read_stats", None)

    return save, load


def _rank_dir(url: str, rank: int) -> str:
    return os.path.join(url, f"rank{rank}")


def _host(sd: State) -> State:
    """CPU copies of CUDA tensors (the device-to-host copy is part of the contender's time)."""
    return {k: v.cpu() if v.is_cuda else v for k, v in sd.items()}


def _per_rank_pair(
    ctx: Ctx, save_fn: Callable[[State, str], None], load_fn: Callable[[State, str], None]
) -> tuple[Callable[[State, str], None], Callable[[State, str], Any]]:
    """A per-rank file contender (raw I/O, torch.save) on host copies of CUDA tensors."""

    def save(sd: State, url: str) -> None:
        save_fn(_host(sd), _rank_dir(url, ctx.rank))

    def load(dest: State, url: str) -> None:
        host = {k: torch.empty(v.shape, dtype=v.dtype) if v.is_cuda else v for k, v in dest.items()}
        load_fn(host, _rank_dir(url, ctx.rank))
        for k, v in dest.items():
            if v.is_cuda:
                v.copy_(host[k])

    return save, load


def _s3tc(ctx: Ctx) -> Contender:
    name = "s3torchconnector"
    try:
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
    except Exception as exc:  # an optional contender: any import failure only skips it
        return Contender(name, _never, _never, frozenset({"s3"}), f"import failed: {exc!r}")
    # path-style: the loopback endpoint is an IP address; the endpoint itself comes from AWS_ENDPOINT_URL
    cfg = S3ClientConfig(force_path_style=True)
    save, load = _dcp_pair(
        ctx,
        lambda url: S3StorageWriter(ctx.region, url, s3client_config=cfg),
        lambda url: S3StorageReader(ctx.region, url, s3client_config=cfg),
    )
    return Contender(name, save, load, frozenset({"s3"}))


def _never(*_args: Any) -> None:
    raise RuntimeError("unavailable contender")


def contenders(ctx: Ctx) -> list[Contender]:
    """All contenders, in a fixed order (the driver rotates it per round)."""

    def ours_writer(u: str) -> FsspecStorageWriter:
        return FsspecStorageWriter(u, storage_options=_opts(ctx, u), process_group=ctx.process_group)

    def ours_reader(u: str) -> FsspecStorageReader:
        return FsspecStorageReader(u, storage_options=_opts(ctx, u))

    # ours run as the API runs them: the process's objects frozen out of cyclic collections meanwhile
    ours = _dcp_pair(ctx, ours_writer, ours_reader, frozen=True)
    full = _dcp_pair(
        ctx,
        lambda u: FullArtifactWriter(u, storage_options=_opts(ctx, u), process_group=ctx.process_group),
        ours_reader,
        frozen=True,
    )
    # an A/B of that freeze (what dcp.save with our planner and storage gives without it)
    unfrozen = _dcp_pair(ctx, ours_writer, ours_reader)
    # a diagnostic: the same checkpoints loaded without verifying checksums (what hashing costs)
    unverified = _dcp_pair(
        ctx,
        ours_writer,
        lambda u: FsspecStorageReader(u, storage_options=_opts(ctx, u), verify_checksums=False),
        frozen=True,
    )
    # an A/B of the local request size (reader default 32 MiB on local filesystems, 64 MiB before)
    requests_64 = _dcp_pair(
        ctx,
        ours_writer,
        lambda u: FsspecStorageReader(u, storage_options=_opts(ctx, u), max_request_bytes=64 << 20),
        frozen=True,
    )
    # an A/B of the reader's thread count (its default: 4, at most the rank's CPUs on local paths, at least 2;
    # on the 2-vCPU VM the default is 2, so this equals it there: compare on a machine with more CPUs)
    threads_2 = _dcp_pair(
        ctx,
        ours_writer,
        lambda u: FsspecStorageReader(u, storage_options=_opts(ctx, u), thread_count=2),
        frozen=True,
    )
    # a diagnostic of the device stage on the CPU: every tensor through the staging pool (its CPU stand-in,
    # SMPCKPT_TEST_DEVICE=cpu), as CUDA tensors go, against "smpckpt partial" writing them in place
    staged = _stand_in(*_dcp_pair(ctx, ours_writer, ours_reader, frozen=True))
    fs_default = _dcp_pair(ctx, FileSystemWriter, FileSystemReader)
    # tuned: several files in flight per rank (the reader has no knobs; it reads what was written)
    fs_tuned = _dcp_pair(ctx, lambda u: FileSystemWriter(u, thread_count=4), FileSystemReader)
    # on S3 the default sync_files=True makes DCP call os.sync() for the whole host (S3File has no
    # fileno); an S3 object is durable once its upload completes, so sync is off there
    fsspec = _dcp_pair(
        ctx,
        lambda u: FsspecWriter(u, sync_files=not u.startswith("s3://"), **_opts(ctx, u)),
        lambda u: FsspecReader(u, **_opts(ctx, u)),
    )
    return [
        Contender("raw write+fsync / read", *_per_rank_pair(ctx, raw_save, raw_load), LOCAL),
        Contender(OURS, *ours, ANY),
        Contender(OURS_FULL, *full, ANY),
        Contender("DCP FileSystemWriter defaults", *fs_default, LOCAL),
        Contender("DCP FileSystemWriter thread_count=4", *fs_tuned, LOCAL),
        Contender("DCP FsspecWriter", *fsspec, ANY),
        _s3tc(ctx),
        Contender("torch.save per rank", *_per_rank_pair(ctx, torch_save, torch_load), LOCAL),
        Contender("smpckpt partial, loads unverified", *unverified, ANY, opt_in=True),
        Contender("smpckpt partial, 64 MiB read requests", *requests_64, ANY, opt_in=True),
        Contender("smpckpt partial, gc not frozen", *unfrozen, ANY, opt_in=True),
        Contender("smpckpt partial, 2 read threads", *threads_2, ANY, opt_in=True),
        Contender("smpckpt partial, staged (CPU stand-in)", *staged, ANY, opt_in=True),
    ]


def _stand_in(
    save: Callable[[State, str], None], load: Callable[[State, str], Any]
) -> tuple[Callable[[State, str], None], Callable[[State, str], Any]]:
    """``save``/``load`` with ``SMPCKPT_TEST_DEVICE=cpu`` set around them (neighbouring staged tensors share a read)."""

    @contextlib.contextmanager
    def env() -> Iterator[None]:
        old = os.environ.get("SMPCKPT_TEST_DEVICE")
        os.environ["SMPCKPT_TEST_DEVICE"] = "cpu"
        try:
            yield
        finally:
            if old is None:
                del os.environ["SMPCKPT_TEST_DEVICE"]
            else:
                os.environ["SMPCKPT_TEST_DEVICE"] = old

    def staged_save(sd: State, url: str) -> None:
        with env():
            save(sd, url)

    def staged_load(dest: State, url: str) -> Any:
        with env():
            return load(dest, url)

    return staged_save, staged_load


def select(all_: Sequence[Contender], storage: str, names: Sequence[str] | None) -> list[Contender]:
    """The contenders that run on ``storage`` (and match ``names``, substrings, when given)."""
    out = [c for c in all_ if storage in c.storages]
    regular = [c.name.lower() for c in all_ if not c.opt_in]
    if not names:
        return [c for c in out if not c.opt_in]
    wanted = [n.lower() for n in names]
    return [
        c
        for c in out
        if any(n in c.name.lower() and (not c.opt_in or not any(n in r for r in regular)) for n in wanted)
    ]

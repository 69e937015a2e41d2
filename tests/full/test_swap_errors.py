"""A full save whose row swap fails while the previous swap block's write is failing too (tier 1).

The swap thread writes one block while the next tensor's rows cross the process group. When both go
wrong (a peer lost, the disk full), the error raised is the swap's; the write's failure must still be
reported with it, naming the file, instead of vanishing with the block-writer thread.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

import smpckpt.storage.full._write as full_write
from smpckpt.storage.backends._folder import Folder
from smpckpt.storage.backends._fs import open_fs
from smpckpt.storage.format._staging import MIN_STAGING_BYTES, Stages
from smpckpt.storage.full._exchange import Block, Exchange
from smpckpt.storage.full._source import FullWrite, RankFullData

INDEX = MetadataIndex("model.w")
BOX = FullWrite(
    item=INDEX,
    key="model.w",
    file="model.safetensors",
    start=0,
    view=(2, 4),
    offsets=(0, 0),
    sizes=(2, 2),
    perm=(0, 1),
    dest_offsets=(0, 0),
    dtype=torch.float32,
)


class _Planner:
    def resolve_data(self, item: WriteItem) -> torch.Tensor:
        return torch.zeros(2, 2)


class _SwapThenFail:
    """The first swap hands back a block; the second finds its peer gone."""

    calls = 0

    def __init__(self, rank: int, process_group: Any) -> None:
        pass

    def swap(self, batch: list[Exchange], my_buf: dict[FullWrite, memoryview]) -> list[Block]:
        type(self).calls += 1
        if type(self).calls > 1:
            raise RuntimeError("peer 1 closed the connection")
        return [Block(BOX, memoryview(b""), ())]


def _disk_full(self: Any, got: list[Block]) -> None:
    raise OSError(28, "No space left on device")


def test_a_failed_block_write_is_reported_with_the_swap_error_that_followed_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / BOX.file).write_bytes(bytes(32))
    first, second = (Exchange(boxes=((0, BOX),), blocks=((0, 0, 2),), batch=b) for b in (0, 1))
    data = RankFullData("save", 0, (), (), 4096, world=2, exchanges=(first, second))
    item = WriteItem(index=INDEX, type=WriteItemType.TENSOR)
    monkeypatch.setattr(_SwapThenFail, "calls", 0)
    monkeypatch.setattr(full_write, "Swapper", _SwapThenFail)
    logged: list[str] = []
    monkeypatch.setattr(full_write.log, "error", lambda msg, *args: logged.append(msg % args))
    monkeypatch.setattr(full_write._RankWriter, "_write_blocks", _disk_full)
    stages = Stages(MIN_STAGING_BYTES)  # the writer's staging pool (swaps do not use it)
    try:
        with (
            Folder(open_fs(str(tmp_path))[0], str(tmp_path)) as folder,
            full_write._RankWriter(folder, data, [item], _Planner(), stages) as writer,  # type: ignore[arg-type]
        ):
            with pytest.raises(RuntimeError, match="peer 1 closed the connection") as raised:
                writer._swap_all(None)
    finally:
        stages.close()
    # Python 3.11+: a note on the raised error; before: a log line
    told = " ".join(getattr(raised.value, "__notes__", [])) if sys.version_info >= (3, 11) else " ".join(logged)
    assert "writing the previous swap blocks into model.safetensors failed too" in told
    assert "No space left on device" in told

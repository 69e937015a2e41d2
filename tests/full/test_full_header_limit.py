"""A full artifact's safetensors headers stay under the readers' limit (hunt73a).

The reference reader (and ours, ``MAX_HEADER``) refuses a header above 100 MB. The exporter cut files by
tensor bytes only, so a state of many small tensors (an MoE with unfused experts: about a million keys of
~100 header bytes each under the 5 GB default) was written as one file that no reader opens: the export
succeeded and every load of it failed, ``CheckpointCorrupt: safetensors header ... implausibly large``.
Here the limit is lowered so a few hundred keys cross it; ``tests/sizes/test_many_keys.py`` crosses the
real one."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from smpckpt import resume_from_checkpoint, save_checkpoint
from smpckpt.storage.full import _plan, _source

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _experts(n: int, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    m = nn.Module()
    m.experts = nn.ParameterList(nn.Parameter(torch.randn(2, 3, generator=g)) for _ in range(n))
    return m


def _headers(folder: Path) -> dict[str, int]:
    out = {}
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            with open(folder / name, "rb") as f:
                out[name] = struct.unpack("<Q", f.read(8))[0]
    return out


def test_export_cuts_files_under_the_header_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the exporter keeps _HEADER_SLACK for the header's fixed part: a limit equal to it (as here before,
    # rev73e 4) left no room for entries, a file per key whatever _header_bound said, and a bound of 1 byte a
    # key passed. 3000 bytes past the slack: ~40 keys' entries a file, so 400 keys need about 10 files
    room = 3000
    limit = _plan._HEADER_SLACK + room
    monkeypatch.setattr(_source, "MAX_HEADER", limit)
    model = _experts(400, 1)
    save_checkpoint(tmp_path, "full", partial=False, model=model)
    folder = tmp_path / "full"
    headers = _headers(folder)
    assert len(headers) > 1 and max(headers.values()) <= limit, headers
    # and filled: the bound is tight (an entry's bytes, never under), so a file's entries come within one
    # entry (~75 bytes, 200 allowed) of the room; a bound too loose cuts files early and fails here
    assert max(headers.values()) > room - 200, headers
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(model.state_dict())
    got = _experts(400, 2)
    resume_from_checkpoint(tmp_path, "full", partial=False, model=got)
    want = model.state_dict()
    for k, v in got.state_dict().items():
        assert torch.equal(v, want[k]), k
    # the stock reader opens every file and finds every tensor
    stock = {k: v for name in headers for k, v in load_file(str(folder / name)).items()}
    assert stock.keys() == want.keys() and all(torch.equal(stock[k], want[k]) for k in want)

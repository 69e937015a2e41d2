"""Objects at real key counts (obj63): N tiny parameters (10 a layer) with Adam stepped once -- 15 keys a
parameter, 11 of them hyper-parameter objects in torch's flattened optimizer format. One process, one tree:
CPU (process_time) and wall seconds of save_checkpoint, resume_from_checkpoint (checked bit-exact),
convert_checkpoint (to torch_save) and stock dcp.save/dcp.load of the same state (get_state_dict).
Prints one JSON line. Side by side: run it A B A B with PYTHONPATH set to each tree.

    python benchmarks/bench_objects.py N LABEL [ROOT]
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import smpckpt
from smpckpt import resume_from_checkpoint, save_checkpoint
from smpckpt.tools.convert import convert_checkpoint


class Layers(nn.Module):
    def __init__(self, n: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.layers = nn.ModuleList()
        for _ in range(n // 10):
            layer = nn.Module()
            for j in range(10):
                layer.register_parameter(f"p{j}", nn.Parameter(torch.randn(4, generator=g)))
            self.layers.append(layer)


def stepped(n: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    m = Layers(n, seed)
    opt = torch.optim.Adam(m.parameters())
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return m, opt


def main() -> None:
    warnings.simplefilter("ignore")
    n, label = int(sys.argv[1]), sys.argv[2]
    root = sys.argv[3] if len(sys.argv) > 3 else f"/dev/shm/bench_objects_{label}_{n}"
    shutil.rmtree(root, ignore_errors=True)
    m, opt = stepped(n, 1)
    m2, opt2 = stepped(n, 2)
    out: dict[str, object] = {"N": n, "label": label, "tree": os.path.dirname(os.path.dirname(smpckpt.__file__))}

    def timed(name: str, f: Callable[[], object]) -> None:
        gc.collect()
        c, w = time.process_time(), time.perf_counter()
        f()
        out[name] = (round(time.process_time() - c, 2), round(time.perf_counter() - w, 2))

    def dcp_save() -> None:
        msd, osd = get_state_dict(m, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/dcp")

    def dcp_load() -> None:
        msd, osd = get_state_dict(m2, opt2)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=f"{root}/dcp")
        set_state_dict(m2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    timed("save", lambda: save_checkpoint(root, "s1", model=m, optimizer=opt))
    timed("resume", lambda: resume_from_checkpoint(root, "s1", model=m2, optimizer=opt2))
    s1, s2 = opt.state_dict(), opt2.state_dict()
    bad = sum(not torch.equal(v, s2["state"][k][kk]) for k in s1["state"] for kk, v in s1["state"][k].items())
    bad += sum(not torch.equal(v, m2.state_dict()[k]) for k, v in m.state_dict().items())
    bad += sum(a != b for a, b in zip(s1["param_groups"], s2["param_groups"]))
    out["mismatches"] = bad
    timed("convert", lambda: convert_checkpoint(f"{root}/s1_partial", f"{root}/conv.pt"))
    timed("dcp_save", dcp_save)
    timed("dcp_load", dcp_load)
    out["metadata_bytes"] = os.path.getsize(f"{root}/s1_partial/.metadata")
    shutil.rmtree(root, ignore_errors=True)
    print("JSON", json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

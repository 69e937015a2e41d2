"""The jobs of ``test_root_jobs.py``: the other job (a process of its own) and a 2-rank world refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from smpckpt import Checkpointer, FastTier, Retention
from smpckpt.errors import RootInUse

#: the other job: builds the model below, resumes (argv[3] == "resume") or not, saves argv[2] (keeping 1); with
#: argv[5], through a fast tier in that folder (drained at each save)
_JOB = r"""
import json, sys, torch
from torch import nn
import smpckpt
root, tag, resume, options = sys.argv[1], sys.argv[2], sys.argv[3] == "resume", json.loads(sys.argv[4])
tier = smpckpt.FastTier(sys.argv[5], replicas=1) if len(sys.argv) > 5 else None
torch.manual_seed(1)
m = nn.Linear(4, 2)
o = torch.optim.AdamW(m.parameters(), lr=1e-2)
m(torch.randn(3, 4)).sum().backward()
o.step()
where = smpckpt.Location(root, storage_options=options)
with smpckpt.Checkpointer(where, fast_tier=tier, retention=smpckpt.Retention(num_kept_partial_checkpoints=1)) as ckpt:
    if resume:
        ckpt.resume(model=m, optimizer=o)
        print("resumed", ckpt.last_resume_info.tag, flush=True)
    ckpt.save(tag, m, o)
"""


#: a job in steps: saves each tag of argv[2] (comma-separated), keeping none; before each after the first, it says
#: "saved <tag>" and waits for a line on stdin (the test orders the two jobs' calls)
_STEPPED = r"""
import sys, torch
from torch import nn
import smpckpt
torch.manual_seed(1)
m = nn.Linear(4, 2)
o = torch.optim.AdamW(m.parameters(), lr=1e-2)
with smpckpt.Checkpointer(sys.argv[1]) as ckpt:
    for i, tag in enumerate(sys.argv[2].split(",")):
        if i:
            print("saved", prev, flush=True)
            sys.stdin.readline()
        ckpt.save(tag, m, o)
        prev = tag
"""


#: the job before a restart: saves a1 and a2 into the fast tier, a2 drained to path (durable_every=2)
_TIERED = r"""
import json, sys, torch
from torch import nn
import smpckpt
torch.manual_seed(1)
m = nn.Linear(4, 2)
o = torch.optim.AdamW(m.parameters(), lr=1e-2)
where = smpckpt.Location(sys.argv[1], storage_options=json.loads(sys.argv[3]))
with smpckpt.Checkpointer(where, fast_tier=smpckpt.FastTier(sys.argv[2], replicas=1, durable_every=2)) as ckpt:
    ckpt.save("a1", m, o)
    ckpt.save("a2", m, o)
"""


def tiered_job(root: str, fast: str, options: dict[str, Any]) -> None:
    """Run :data:`_TIERED` to its end."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-c", _TIERED, root, fast, json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the tiered job failed: {done.stderr[-3000:]}")


def stepped_job(root: str, tags: str) -> subprocess.Popen[str]:
    """The other job, saving ``tags`` one by one: ``.stdout.readline()`` waits for a save, a line to stdin goes on."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    args = [sys.executable, "-c", _STEPPED, root, tags]
    return subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(3, 4)).sum().backward()
    o.step()
    return m, o


def other_job(
    root: str, tag: str, resume: bool = False, options: dict[str, Any] | None = None, fast: str | None = None
) -> str:
    """Run the other job to its end (``fast``: through a fast tier in that folder); its stdout and stderr."""
    done = subprocess.run(
        [sys.executable, "-c", _JOB, root, tag, "resume" if resume else "fresh", json.dumps(options)]
        + ([fast] if fast is not None else []),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    if done.returncode != 0:
        raise RuntimeError(f"the other job failed: {done.stderr[-3000:]}")
    return done.stdout + done.stderr


def refused_world(rank: int, world: int, root: str) -> dict[str, Any]:
    """Two ranks save s1; the other job saves t1 into the root; the next save: refused on every rank alike."""
    m, o = model()
    with Checkpointer(root, retention=Retention(num_kept_partial_checkpoints=1)) as ckpt:
        ckpt.save("s1", m, o)
        if rank == 0:
            other_job(root, "t1")
        dist.barrier()
        try:
            ckpt.save("s2", m, o)
        except RootInUse as exc:
            return {"error": str(exc), "dirs": sorted(os.listdir(root))}
    return {"error": None}


def refused_tiered_resume_world(rank: int, world: int, root: str, fast: str) -> dict[str, Any]:
    """Two ranks of one node save s1 through a fast tier; the other job saves t1 into the root; the tag-less
    resume: refused on every rank alike (the same words), nothing applied."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    m, o = model()
    with Checkpointer(root, fast_tier=FastTier(fast, replicas=1)) as ckpt:
        ckpt.save("s1", m, o)
        ckpt.wait()
        if rank == 0:
            other_job(root, "t1")
        dist.barrier()
        before = {k: v.clone() for k, v in m.state_dict().items()}
        try:
            ckpt.resume(model=m, optimizer=o)
        except RootInUse as exc:
            same = all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
            return {"error": str(exc), "unchanged": same}
    return {"error": None}

"""A large ``user_content`` costs one copy of itself, not three (fix68b).

Its ``torch.save`` record was copied into an ``ObjectBytes``, into the planner's bytes and into the writer's
buffer; at a resume into an ``ObjectBytes`` and into a ``BytesIO``: a 1 GiB tensor peaked about 3 GiB above
the state at either. Each case runs in a child process of its own, its peak RSS (``VmHWM``) read there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

S_MIB = 256  #: the tensor's size; the bounds below are in units of it

_CHILD = """
import sys, torch, torch.nn as nn
from smpckpt import SaveOptions, resume_from_checkpoint, save_checkpoint
mode, root, how, mib = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
def hwm():
    return next(int(l.split()[1]) >> 10 for l in open("/proc/self/status") if l.startswith("VmHWM"))
kw = {"async": {"options": SaveOptions(async_save=True)}, "full": {"partial": False}}.get(how, {})
want = torch.arange((mib << 20) // 4, dtype=torch.int32)
if mode == "save":
    base = hwm()  # the state (the tensor) is here already
    fut = save_checkpoint(root, "t", model=nn.Linear(2, 2), user_content={"big": want}, **kw)
    if fut is not None:
        fut.result()
else:
    base = hwm() + mib  # the state is the resumed tensor
    got = resume_from_checkpoint(root, "t", model=nn.Linear(2, 2), partial=how != "full")
    if not torch.equal(got["big"], want):
        raise SystemExit("user_content came back different")
print(hwm() - base)
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sync", "async", "full"])
def test_a_large_user_content_peaks_at_one_copy_above_the_state(tmp_path: Path, how: str) -> None:
    for mode in ("save", "resume"):
        run = subprocess.run(
            [sys.executable, "-c", _CHILD, mode, str(tmp_path), how, str(S_MIB)], capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr[-3000:]
        over = int(run.stdout.split()[-1])
        # one copy (the record) plus what torch.save/torch.load hold; 3 copies before the fix
        assert over < 1.5 * S_MIB, f"{how} {mode}: peak RSS {over} MiB above the state, over 1.5 x {S_MIB} MiB"

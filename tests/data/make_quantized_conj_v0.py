"""How tests/data/quantized_v0 and tests/data/conj_v0 were made (once; never regenerate), by smpckpt at commit
55b1992 (before 1626930 refused quantized tensors and c4a7f4e stopped tying a conjugate view to its base):

* quantized_v0: a model with qint8, quint8 and qint32 buffers (per tensor); only their integers were stored,
  under the quantized dtypes.
* conj_v0: a complex parameter ``w`` and a buffer ``wc`` that is ``w.conj()``: stored once, ``wc`` recorded as
  a tie of ``w`` (its conjugate bit lost).

Run from a checkout of 55b1992 (see make_tied_v0.py for the PYTHONPATH staging): ``python THIS OUT``."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import smpckpt

INTEGERS = torch.tensor([-3.0, 0.5, 2.0, 7.5])


class Quantized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("q8", torch.quantize_per_tensor(INTEGERS, 0.5, 3, torch.qint8))
        self.register_buffer("qu8", torch.quantize_per_tensor(INTEGERS, 0.25, 40, torch.quint8))
        self.register_buffer("q32", torch.quantize_per_tensor(INTEGERS, 0.5, -7, torch.qint32))


class Conj(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1 + 2j, -3 + 0.5j, 4 - 1j]))
        self.register_buffer("wc", self.w.detach().conj())


if __name__ == "__main__":
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    options = smpckpt.SaveOptions(save_rng=False)
    smpckpt.save_checkpoint(str(out / "quantized_v0"), "t", model=Quantized(), options=options)
    smpckpt.save_checkpoint(str(out / "conj_v0"), "t", model=Conj(), options=options)

"""A CPU tensor's own bytes as a flat memoryview, without a copy (one job, for every reader and writer).

Each torch call drops and retakes the GIL. With a writer or reader thread per file that is a queue per
call: a save of 2,700 small tensors spent more time in ``detach``/``reshape``/``view`` than in its
writes. So a tensor of a numpy dtype is turned into bytes with one torch call (``numpy()``) and numpy
does the rest; other dtypes (bfloat16, float8) take the ``view(torch.uint8)`` route.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch

__all__ = ["cpu_bytes"]


def cpu_bytes(t: torch.Tensor) -> memoryview | None:
    """The bytes of ``t`` in row-major order as a flat ``"B"`` memoryview over its own memory, when
    ``t`` is a contiguous CPU tensor that needs no grad; ``None`` otherwise (another device, not
    contiguous, requiring grad, a conjugate or negative view)."""
    try:
        arr = t.numpy()
    except (TypeError, RuntimeError):  # no numpy dtype, or a tensor numpy cannot share
        if t.device.type != "cpu" or t.requires_grad or not t.is_contiguous() or t.is_conj() or t.is_neg():
            return None
        try:
            return memoryview(cast(Any, t.reshape(-1).view(torch.uint8).numpy()))
        except (RuntimeError, TypeError, ValueError):
            return None
    if not arr.flags.c_contiguous:
        return None
    return memoryview(cast(Any, arr.reshape(-1).view(np.uint8)))

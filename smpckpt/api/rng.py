"""Per-rank random number generator states as weights-only-safe values (tensors, ints, floats, str).

Captured: torch's CPU generator, every CUDA device's generator (when CUDA is available), Python's
``random`` module and NumPy's legacy global generator (``np.random``, when NumPy is installed; stored
from ``bit_generator.state``-style dicts, never the legacy tuple with a NumPy array, because plain
weights-only loading rejects NumPy objects).

The checkpoint stores rank ``r``'s states under ``rng.rank<r>.*`` (rank-unique keys, ``rank_local``),
so they are never deduplicated across replicas.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["get_rng_state", "set_rng_state", "rng_components"]

_np: Any
try:  # NumPy is optional
    import numpy as _np
except ImportError:  # pragma: no cover - depends on the environment
    _np = None


def get_rng_state() -> dict[str, Any]:
    """This process's generator states: ``{"torch": ..., "python": ..., ["numpy": ...], ["cuda": ...]}``."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": int(version), "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
    }
    if _np is not None:
        np_state = _np.random.get_state(legacy=False)
        state["numpy"] = {
            "bit_generator": str(np_state["bit_generator"]),
            "key": torch.from_numpy(np_state["state"]["key"].astype("int64")),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        }
    if torch.cuda.is_available():
        # a dict, not a list: DCP flattens dicts by key, and device indices stay explicit
        state["cuda"] = {str(i): s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    return state


def rng_components(state: Mapping[str, Any]) -> tuple[str, ...]:
    return tuple(state)


def set_rng_state(state: Mapping[str, Any], components: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """Restore the generators in ``state`` (only ``components`` when given); returns what was restored.

    A CUDA state saved with more devices than are visible restores the visible ones.
    """
    restored: list[str] = []
    wanted = set(state if components is None else components)
    if "torch" in wanted and "torch" in state:
        torch.set_rng_state(state["torch"].to(torch.uint8))
        restored.append("torch")
    if "python" in wanted and "python" in state:
        py = state["python"]
        random.setstate((int(py["version"]), tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
        restored.append("python")
    if "numpy" in wanted and "numpy" in state and _np is not None:
        np_state = state["numpy"]
        _np.random.set_state(
            {
                "bit_generator": np_state["bit_generator"],
                "state": {"key": np_state["key"].numpy().astype("uint32"), "pos": int(np_state["pos"])},
                "has_gauss": int(np_state["has_gauss"]),
                "gauss": float(np_state["gauss"]),
            }
        )
        restored.append("numpy")
    if "cuda" in wanted and "cuda" in state and torch.cuda.is_available():
        for index, s in state["cuda"].items():
            if int(index) < torch.cuda.device_count():
                torch.cuda.set_rng_state(s.to(torch.uint8), int(index))
        restored.append("cuda")
    return tuple(restored)

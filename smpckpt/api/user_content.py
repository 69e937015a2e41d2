"""user_content: serialised once on save, deserialised once (weights-only) on resume.

It is stored as one ``torch.save`` record inside the checkpoint (an :class:`~smpckpt.planners.ObjectBytes`
value the planners pass through untouched), so it is checksummed and committed with the tensors and
stock ``torch.load`` reads the record directly.

Per-rank random number generator states as weights-only-safe values (tensors, ints, floats, str).

Captured: torch's CPU generator, every CUDA device's generator (when CUDA is available), Python's
``random`` module and NumPy's legacy global generator (``np.random``, when NumPy is installed; stored
from ``bit_generator.state``-style dicts, never the legacy tuple with a NumPy array, because plain
weights-only loading rejects NumPy objects).

The checkpoint stores rank ``r``'s states under ``rng.rank<r>.*`` (rank-unique keys, ``rank_local``),
so they are never deduplicated across replicas.
"""

from __future__ import annotations

import io
import pickle
import random
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from smpckpt.errors import CheckpointCorrupt, UnsafeCheckpoint

__all__ = [
    "encode_user_content",
    "decode_user_content",
    "describe_user_content",
    "weights_only_safe",
    "get_rng_state",
    "set_rng_state",
    "rng_components",
]


def weights_only_safe(value: Any) -> bool:
    """Whether ``torch.load(weights_only=True)`` accepts ``value`` once saved: tried, not guessed from
    types (a type walk had called ``b""`` and ``frozenset`` safe; torch's allow-list refuses both)."""
    try:
        return _loads_weights_only(_encode(value))
    except TypeError:
        return False


def encode_user_content(user_content: Any, *, stacklevel: int = 1) -> tuple[bytes, bool]:
    """``(torch.save bytes, loads weights-only)``: the one serialisation of ``user_content`` on save.
    When it will not load weights-only, a warning says so now, not at the resume (``stacklevel``: the
    frame that warnings name: 1 is this function's caller)."""
    data = _encode(user_content)
    weights_only = _loads_weights_only(data)
    if not weights_only:
        warnings.warn(
            "user_content holds objects weights-only loading rejects; resuming it will need allow_pickle=True. "
            "Prefer dicts of tensors, numbers, strings and lists.",
            stacklevel=stacklevel + 1,
        )
    return data, weights_only


def describe_user_content(user_content: Any) -> dict[str, Any]:
    """What the manifest records of ``user_content`` (``smpckpt inspect`` shows it without loading it)."""
    keys = [str(k) for k in user_content] if isinstance(user_content, Mapping) else None
    return {"user_content_type": type(user_content).__name__, "user_content_keys": keys}


def _encode(value: Any) -> bytes:
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise TypeError(f"user_content cannot be serialised with torch.save: {exc}") from exc
    return buf.getvalue()


def _loads_weights_only(data: bytes) -> bool:
    """The resume's own check, run on the saved bytes (tensors land on ``meta``: no copy of their data)."""
    try:
        torch.load(io.BytesIO(data), weights_only=True, map_location="meta")
    except pickle.UnpicklingError:
        return False
    except Exception:  # noqa: BLE001 - a tensor kind meta cannot hold: try it as the resume loads it
        try:
            torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except pickle.UnpicklingError:
            return False
    return True


def decode_user_content(data: Any, *, allow_pickle: bool, nested: bool = False) -> Any:
    """The one deserialisation on resume. ``nested``: checkpoints of ``save_checkpoint/1`` wrapped the
    record in a second pickle (a ``bytes`` object), unwrapped here."""
    if data is None or data == b"":
        return None
    if not isinstance(data, (bytes, bytearray)):
        raise CheckpointCorrupt(f"user_content is stored as {type(data).__name__}, expected bytes")
    try:
        value = torch.load(io.BytesIO(data), weights_only=not allow_pickle, map_location="cpu")
        if nested:
            return decode_user_content(value, allow_pickle=allow_pickle)
        return value
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpoint(
            f"user_content needs arbitrary code to unpickle ({exc}); pass allow_pickle=True only if you trust "
            "this checkpoint"
        ) from exc


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

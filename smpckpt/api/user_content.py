"""user_content: serialised once on save, deserialised once (weights-only) on resume.

It is stored as one ``torch.save`` record inside the checkpoint (an :class:`~smpckpt.planners.ObjectBytes`
value the planners pass through untouched), so it is checksummed and committed with the tensors and
stock ``torch.load`` reads the record directly.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from smpckpt.errors import CheckpointCorrupt, UnsafeCheckpoint

__all__ = ["encode_user_content", "decode_user_content", "describe_user_content", "weights_only_safe"]


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

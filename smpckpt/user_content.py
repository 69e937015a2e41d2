"""user_content: serialised once on save, deserialised once (weights-only) on resume.

It is stored as one ``torch.save`` record inside the checkpoint (an :class:`~smpckpt.planners.ObjectBytes`
value the planners pass through untouched), so it is checksummed and committed with the tensors and
stock ``torch.load`` reads the record directly.
"""

from __future__ import annotations

import collections
import io
import pickle
from typing import Any

import torch

from smpckpt.errors import CheckpointCorrupt, UnsafeCheckpoint

__all__ = ["encode_user_content", "decode_user_content", "weights_only_safe"]

_LEAVES = (str, bytes, int, float, bool, complex, type(None), torch.Tensor, torch.dtype, torch.device, torch.Size)
_CONTAINERS = (dict, collections.OrderedDict, list, tuple, set, frozenset)
_MAX_DEPTH = 64


def weights_only_safe(value: Any, _depth: int = 0) -> bool:
    """Whether ``torch.load(weights_only=True)`` accepts ``value`` (a conservative type walk, no pickling)."""
    if _depth > _MAX_DEPTH:
        return False
    if isinstance(value, _LEAVES) and (type(value) in _LEAVES or isinstance(value, torch.Tensor)):
        return True
    if type(value) in _CONTAINERS:
        items = value.items() if isinstance(value, dict) else ((None, v) for v in value)
        return all(
            (k is None or weights_only_safe(k, _depth + 1)) and weights_only_safe(v, _depth + 1) for k, v in items
        )
    return False


def encode_user_content(user_content: Any) -> tuple[bytes, bool]:
    """``(torch.save bytes, loads weights-only)``: the one serialisation of ``user_content`` on save."""
    buf = io.BytesIO()
    try:
        torch.save(user_content, buf)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise TypeError(f"user_content cannot be serialised with torch.save: {exc}") from exc
    return buf.getvalue(), weights_only_safe(user_content)


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

"""The exceptions smpckpt raises.

All derive from :class:`CheckpointError` (an ``Exception``), so ``except Exception`` catches a failed
save or load. DCP reports rank failures as ``CheckpointException``, a ``BaseException``; the public API
translates it at its boundary and keeps the original as ``__cause__``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

E = TypeVar("E", bound=BaseException)

# the base; a stored checkpoint's state; what the caller passed does not fit
__all__ = ["CheckpointError", "CheckpointNotFound", "CheckpointCorrupt", "CheckpointExists", "UnsafeCheckpoint"]
__all__ += ["LayoutMismatch", "SpecError", "ReplicaMismatch", "NodeFull", "RootInUse"]


class CheckpointError(Exception):
    """Base class of every error smpckpt raises on purpose."""


class CheckpointNotFound(CheckpointError, FileNotFoundError):
    """No committed checkpoint where one was asked for (or its files are missing)."""


class CheckpointCorrupt(CheckpointError):
    """Stored bytes or metadata do not match what the checkpoint recorded (checksum, size, format)."""


class CheckpointExists(CheckpointError, FileExistsError):
    """A committed checkpoint is already at the target and ``overwrite`` was not given."""


class LayoutMismatch(CheckpointError):
    """The state dict does not fit the checkpoint: missing/unexpected keys, shapes or dtypes differ."""


class SpecError(CheckpointError, ValueError):
    """A :class:`~smpckpt.ShardSpec` or :class:`~smpckpt.ParallelLayout` does not fit the tensors given."""


class ReplicaMismatch(CheckpointError):
    """Ranks that should hold identical replicas disagree (often: a tensor-parallel shard without a spec)."""


class NodeFull(CheckpointError):
    """A node could not store a fast-tier part or metadata it fetched (its disk full, over quota or past a
    file-size limit): the copy is intact on its peers, so a resume raises this on every rank rather than load
    an older save in its place (path's drained copy of the same save loads instead)."""


class RootInUse(CheckpointError):
    """Another job saves into this checkpoint root (its checkpoint, committed after this job's last save, is the
    newest): this job's save is refused before anything is written. Give each job its own ``path``."""


class UnsafeCheckpoint(CheckpointError):
    """Stored objects need arbitrary code execution to load; refused unless ``allow_pickle=True``."""


def not_dense(key: str, layout: object, shape: tuple[int, ...]) -> SpecError:
    """The error for a sparse (or other non-strided) tensor at ``key``: planners and writers alike raise it."""
    return SpecError(
        f"{key}: a {layout} tensor (shape {shape}) cannot be saved or loaded; only dense (strided) tensors can: "
        "store .to_dense(), or the sparse tensor's indices and values as two tensors"
    )


def not_plain(key: str, value: torch.Tensor) -> SpecError:
    """The error for a tensor at ``key`` that is not a plain dense one (planners and writers alike raise it):
    nested; quantized, whose integers alone would be saved and loaded into the destination's own scale and
    zero-point (other values, silently); sparse or another layout (:func:`not_dense`)."""
    if value.is_nested:
        return SpecError(
            f"{key}: a nested tensor ({value.layout}) cannot be saved or loaded; only dense (strided) tensors can: "
            "store its .unbind() pieces as tensors of their own, or .to_padded_tensor() and the lengths"
        )
    if not value.is_quantized:
        return not_dense(key, value.layout, tuple(value.shape))
    try:
        scheme = f", {value.qscheme()}"
    except RuntimeError:  # a quantized tensor without a quantizer (torch.empty(3, dtype=torch.qint8)) has none
        scheme = ""
    return SpecError(
        f"{key}: a quantized tensor ({value.dtype}{scheme}, shape {tuple(value.shape)}) cannot be saved "
        "or loaded: its scale and zero-point would not be restored (a load copies its integers into the "
        "destination's own quantization); store .dequantize(), or .int_repr() and its q_scale() and q_zero_point() "
        "(per channel: q_per_channel_scales(), q_per_channel_zero_points(), q_per_channel_axis()) as entries of "
        "their own and quantize again after the load; a quantized model's state_dict() passed in user_content "
        "keeps them"
    )


#: the quantized dtypes by name (this module does not import torch): a checkpoint's record of one holds its
#: integers alone
_QUANTIZED = frozenset({"torch.qint8", "torch.quint8", "torch.qint32", "torch.quint4x2", "torch.quint2x4"})


def stored_integers(dtype: torch.dtype) -> torch.dtype | None:
    """The integer dtype whose bits a checkpoint's record of quantized ``dtype`` holds (``None``: not one of
    those): smpckpt before quantized tensors were refused stored their integers alone, under the quantized
    dtype; a destination of this dtype reads them back as they are (old checkpoints keep loading)."""
    import torch  # noqa: PLC0415 - loaded already by whoever holds a dtype

    return {torch.qint8: torch.int8, torch.quint8: torch.uint8, torch.qint32: torch.int32}.get(dtype)


def quantized_record_fits(key: str, saved: torch.dtype, shape: tuple[int, ...], dest: torch.dtype) -> bool:
    """Whether a destination of ``dest`` reads a checkpoint's record of ``saved`` as its bits: a quantized
    record's integers (saved by smpckpt before quantized tensors were refused) fit the integer dtype they are,
    any other destination is refused saying so (raised); ``False`` for a record of another dtype (rev69f F2)."""
    if str(saved) not in _QUANTIZED:
        return False
    integers = stored_integers(saved)
    if integers is not None and integers == dest:
        return True
    how = (
        f"load it into a {integers} tensor of shape {shape} (the same bits) and quantize again with the scale and "
        "zero-point the model had (torch._make_per_tensor_quantized_tensor(ints, scale, zero_point))"
        if integers is not None
        else "it cannot be read back (packed sub-byte integers): re-create it from the model's source"
    )
    raise LayoutMismatch(
        f"{key}: the checkpoint holds a quantized tensor's integers ({saved}, saved by smpckpt before quantized "
        f"tensors were refused; its scale and zero-point were not saved), but the destination is {dest}: {how}"
    )


def no_data(key: str, value: torch.Tensor) -> SpecError:
    """The error for a meta tensor at ``key`` reaching a writer: it has a shape and no values to write."""
    return SpecError(
        f"{key}: a meta tensor (shape {tuple(value.shape)}, {value.dtype}) has no data to save: materialise it "
        "first (module.to_empty(device=...) and initialise it, or load it), or leave it out of the state"
    )


#: how a resume's error ends once its read began (it loads in place, as ``dcp.load`` does): a job that starts
#: afresh after it must not train a model half loaded, half initialised
LOADED_IN_PLACE = (
    "; the model's and optimizer's tensors it read hold the checkpoint's values, the one the failure cut short "
    "part of them (a resume loads in place): resume another checkpoint, or re-initialise them, before training"
)


def loaded_in_place(exc: E, loaded: bool) -> E:
    """``exc``, saying once (``loaded``) that the model holds the checkpoint's values: the package's errors and
    torch's end their message (one string) with :data:`LOADED_IN_PLACE`; another Exception (a user callback's,
    whose ``args`` callers may read) gets it as a note, and so does a Ctrl-C (``KeyboardInterrupt``, its type kept):
    without it a resume interrupted part-way left a half-loaded model silently, and the next save committed it."""
    note = LOADED_IN_PLACE[2:]
    if not loaded or LOADED_IN_PLACE in str(exc) or note in getattr(exc, "__notes__", ()):
        return exc
    if (
        isinstance(exc, (CheckpointError, RuntimeError, TypeError))
        and len(exc.args) == 1
        and isinstance(exc.args[0], str)
    ):
        exc.args = (exc.args[0] + LOADED_IN_PLACE,)
    elif hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(note)
    return exc

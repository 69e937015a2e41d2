"""Full (consolidated) mode, options: how a full artifact is laid out (:class:`FullOptions`), and the
byte sizes those options accept (``"5GB"``, ``"512MiB"``)."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from fractions import Fraction
from types import MappingProxyType
from typing import Any

import torch

from smpckpt.hf import TRANSLATIONS, check_config
from smpckpt.model.translation import Translation

__all__ = ["FullOptions", "FORMATS", "parse_size"]

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*$", re.IGNORECASE)
_UNITS = MappingProxyType(
    {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9, "T": 10**12}
    | {"TB": 10**12, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
)


def parse_size(size: int | str) -> int:
    """``5000000``, ``"5GB"`` (decimal, as Hugging Face counts) or ``"4GiB"`` -> bytes."""
    if isinstance(size, bool):
        raise ValueError(f"size must be bytes or a string like '5GB', got {size!r}")
    if isinstance(size, int):
        value = size
    else:
        m = _SIZE_RE.match(str(size))
        if not m or m.group(2).upper() not in _UNITS:
            raise ValueError(f"size must be bytes or a string like '5GB' or '512MiB', got {size!r}")
        value = int(Fraction(m.group(1)) * _UNITS[m.group(2).upper()])  # exact: "1.1GB" is 1,100,000,000
    if value <= 0:
        raise ValueError(f"size must be positive, got {size!r}")
    return value


FORMATS = ("safetensors", "torch_save")


@dataclasses.dataclass(frozen=True)
class FullOptions:
    """How a full (consolidated) artifact is laid out (README, "Full checkpoints"). Every field has a safe
    default.

    Args:
        max_shard_size: above this many bytes (or ``"5GB"``/``"512MiB"``) an artifact is split into
            ``{name}-0000i-of-0000N.safetensors`` files plus ``{name}.safetensors.index.json``, as Hugging
            Face does. ``None``: Hugging Face's 5 GB, lowered for a multi-rank save so that ranks can start
            on different files (up to ``2 x world`` files of at least 256 MiB, 64 at most).
        dtype: cast floating-point tensors to this dtype on export; integer and bool tensors and scalars
            (0-dim: optimizer counters a narrow float would round) are kept.
        artifacts: flattened-key prefix -> artifact name: a tensor goes to the artifact of the longest
            prefix its key starts with, under the key without it. Default: every tensor in
            ``model.safetensors`` under its own key (:func:`smpckpt.save_checkpoint` uses
            ``{"model.": "model", "optim.state.": "optimizer"}``).
        translation: maps our keys to another naming and layout (``smpckpt.hf.gpt2.TRANSLATION``);
            ``None`` stores our keys, each in its shape before any ShardSpec view.
        hf_config: a Hugging Face config (``PretrainedConfig`` or dict) written as ``config.json``, as
            ``save_pretrained`` writes it: ``architectures`` filled in when missing (:attr:`architecture`),
            ``dtype`` set to the floating-point weights' dtype as written.
        architecture: the class ``config.json``'s ``architectures`` names when the config has none
            (``"GPT2LMHeadModel"``); ``None``: the translation's, if any.
        check_block: bytes per checksum unit (a reader verifies only the units its boxes touch).
        row_swap_below: on POSIX in a multi-rank save, a tensor split on a trailing dim with rows shorter
            than this many bytes per rank is swapped into blocks of whole rows, each written in one run
            (``smpckpt.storage.full._exchange``). ``0`` disables the swap.
        format: ``"safetensors"`` (default) or ``"torch_save"``: each file is what ``torch.save`` writes for
            a flat ``{key: tensor}`` dict (``torch.load(path, weights_only=True)``, ``mmap=True`` too),
            named as Hugging Face names them (``pytorch_model.bin``, shards and index; ``optimizer.bin``).
        tied: head -> embedding keys (as written) that :attr:`hf_config` ties besides the translation's (or its
            ``model_type`` family's): a transformers model's ``_tied_weights_keys``. Held apart with different
            values (a pipeline's drifted head): written as they are, with a warning naming both."""

    max_shard_size: int | str | None = None
    dtype: torch.dtype | None = None
    artifacts: Mapping[str, str] = dataclasses.field(default_factory=lambda: {"": "model"})
    translation: Translation | None = None
    hf_config: Any = None
    architecture: str | None = None
    check_block: int = 1 << 20
    row_swap_below: int = 256 << 10
    format: str = "safetensors"
    tied: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_shard_size is not None:
            object.__setattr__(self, "max_shard_size", parse_size(self.max_shard_size))
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {self.dtype!r}")
        if self.dtype is not None and not self.dtype.is_floating_point:  # int8 truncated and wrapped weights (hunt73c)
            raise ValueError(
                f"dtype must be a floating-point torch.dtype (it casts floating tensors), got {self.dtype}"
            )
        if not self.artifacts:
            raise ValueError("artifacts must map at least one key prefix to an artifact name")
        for prefix, name in self.artifacts.items():
            if not isinstance(prefix, str) or not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
                raise ValueError(f"artifacts: {prefix!r} -> {name!r} must map a str prefix to a plain file stem")
        if self.translation is not None and not isinstance(self.translation, Translation):
            raise TypeError(
                "translation must be a smpckpt.model.translation.Translation (e.g. smpckpt.hf.gpt2.TRANSLATION): full "
                f"saves translate shard by shard, never a gathered state dict; got {type(self.translation).__name__}"
            )
        if self.translation is not None and self.hf_config is not None:
            check_config(self.translation, self.hf_config)  # config.json must describe the tensors written
        if isinstance(self.row_swap_below, bool) or not isinstance(self.row_swap_below, int) or self.row_swap_below < 0:
            raise ValueError(f"row_swap_below must be a byte count >= 0, got {self.row_swap_below!r}")
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {self.format!r}")
        if self.check_block < 4096:
            raise ValueError(f"check_block must be at least 4096 bytes, got {self.check_block}")

    def hf_config_json(self, dtype: torch.dtype | None = None) -> bytes | None:
        """``config.json``'s bytes (``None`` without ``hf_config``); ``dtype``: the artifact's weights'."""
        cfg = self.hf_config
        if cfg is None:
            return None
        if hasattr(cfg, "to_json_string"):  # transformers' own form: what differs from the class defaults
            data = json.loads(cfg.to_json_string())
        elif isinstance(cfg, Mapping):
            data = dict(cfg)
        else:
            raise TypeError(f"hf_config must be a transformers PretrainedConfig or a dict, got {type(cfg).__name__}")
        architecture = self.architecture or (self.translation.architecture if self.translation is not None else None)
        if not data.get("architectures") and architecture:
            data["architectures"] = [architecture]
        # The dtype of the tensors written, whatever the config says: a config saved with an fp32 model
        # says "float32", and from_pretrained of a bf16 artifact under it would build an fp32 model.
        # transformers >= 4.56 writes "dtype", older versions "torch_dtype": keep a config's own spelling
        # (both when it has both).
        if dtype is not None:
            keys = [k for k in ("dtype", "torch_dtype") if k in data] or ["dtype"]
            for key in keys:
                data[key] = str(dtype).removeprefix("torch.")
        return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode("utf-8")

    @property
    def leaves_tied_out(self) -> bool:
        """Whether a tensor tied to another (``lm_head.weight`` and the input embedding) is written once, under
        its first key, as ``save_pretrained`` does: unless :attr:`hf_config` says ``tie_word_embeddings: false``."""
        cfg = self.hf_config
        untied = (
            cfg.get("tie_word_embeddings") if isinstance(cfg, Mapping) else getattr(cfg, "tie_word_embeddings", None)
        )
        return untied is not False

    def config_ties(self) -> tuple[dict[str, str], bool, Mapping[str, str]]:
        """The head -> embedding keys (as written) ``config.json`` ties: the translation's or the ``model_type``
        family's, and :attr:`tied`; whether it says so (``tie_word_embeddings`` present, not only implied:
        transformers 5 takes a config without it as the model class's default, often untied); the family's."""
        cfg = self.hf_config
        if cfg is None or not self.leaves_tied_out:
            return {}, False, {}
        get = cfg.get if isinstance(cfg, Mapping) else lambda name: getattr(cfg, name, None)
        family = self.translation or TRANSLATIONS.get(str(get("model_type")))
        known = family.tied if family is not None else {}
        # the family's pairs win: a transformers 4.x list names heads without their partners (``self.tied``)
        return {**self.tied, **known}, get("tie_word_embeddings") is True, known

    def route(self, fqn: str) -> tuple[str, str] | None:
        """``(artifact name, key inside it)`` for a flattened key, or ``None`` when no prefix matches."""
        # the longest matching prefix (two matching prefixes of one length are the same prefix)
        matches = [(len(prefix), name) for prefix, name in self.artifacts.items() if fqn.startswith(prefix)]
        n, name = max(matches, default=(0, None))
        return None if name is None else (name, fqn[n:])

"""Shared pieces of the Hugging Face model modules: config access, TP checks, tied heads, the eager helpers."""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from types import ModuleType
from typing import Any, Protocol

import torch

from smpckpt.errors import SpecError
from smpckpt.model.specs import ShardSpec
from smpckpt.model.translation import Translation

_MISSING = object()


def cfg_get(config: Any, *names: str, default: Any = _MISSING) -> Any:
    """The first of ``names`` set in ``config`` (a transformers config object or a plain dict)."""
    if config is None:
        raise SpecError(f"tp_specs needs the model config (for {names[0]}); pass a transformers config or a dict")
    for name in names:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if value is not None:
            return value
    if default is _MISSING:
        raise SpecError(f"model config has none of {list(names)}")
    return default


def check_tp(tp: int) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise SpecError(f"tp must be a positive int, got {tp!r}")


def check_divides(model: str, what: str, value: int, tp: int) -> None:
    if value % tp:
        raise SpecError(f"{model}: {what}={value} does not divide by tp={tp}")


def vocab_spec(model: str, vocab: int, tp: int) -> ShardSpec:
    """Vocab-parallel rows; a vocabulary that does not divide by ``tp`` is split near-evenly (the first
    ``vocab % tp`` ranks hold one extra row), which the model's embedding must do the same way."""
    if vocab < tp:
        raise SpecError(f"{model}: vocab_size={vocab} is smaller than tp={tp}")
    if vocab % tp == 0:
        return ShardSpec(0)
    base, extra = divmod(vocab, tp)
    return ShardSpec(0, sizes=tuple(base + (r < extra) for r in range(tp)))


def gpt_dims(
    model: str, tp: int, config: Any, d: tuple[str, ...], heads: tuple[str, ...], inner: str
) -> tuple[int, ShardSpec]:
    """``(d, vocab rows' spec)`` of a GPT-style config (GPT-2, GPT-J, GPT-Neo), after checking ``tp`` and
    that the heads (the first of ``heads`` set), the MLP width (``inner``, default ``4d``) and the
    vocabulary split ``tp`` ways (SpecError otherwise)."""
    check_tp(tp)
    width = int(cfg_get(config, *d))
    check_divides(model, heads[0], int(cfg_get(config, *heads)), tp)
    check_divides(model, inner, int(cfg_get(config, inner, default=None) or 4 * width), tp)
    return width, vocab_spec(model, int(cfg_get(config, "vocab_size")), tp)


def prefixed(prefix: str, rules: Mapping[str, ShardSpec]) -> dict[str, ShardSpec]:
    return {prefix + pattern: spec for pattern, spec in rules.items()}


def _tied(head: torch.Tensor, embed: torch.Tensor) -> bool:
    """Whether the head is the embedding: the same memory (an in-memory tied model) or equal values
    (a tied model written out with both entries)."""
    if head.shape != embed.shape or head.dtype != embed.dtype:
        return False
    if head.is_meta or embed.is_meta:  # no values, and every meta tensor reports address 0
        return head is embed
    same_memory = (
        head.device == embed.device and head.data_ptr() == embed.data_ptr() and head.stride() == embed.stride()
    )  # a conjugate or negated view of the memory shows other values: the values tell
    same_memory = same_memory and (head.is_conj(), head.is_neg()) == (embed.is_conj(), embed.is_neg())
    return same_memory or bool(torch.equal(head, embed))


class ImportFn(Protocol):
    def __call__(
        self,
        state_dict: Mapping[str, torch.Tensor],
        *,
        tie_word_embeddings: bool | None = None,
        keep_view_shapes: bool = False,
    ) -> dict[str, torch.Tensor]: ...


class ExportFn(Protocol):
    def __call__(
        self, state_dict: Mapping[str, torch.Tensor], *, tie_word_embeddings: bool = False
    ) -> dict[str, torch.Tensor]: ...


_IMPORT_DOC = """HF ``{arch}`` state dict -> ours (bit-exact; tensors may share memory with the input).

    Args:
        state_dict: HF keys, no wrapper prefix.
        tie_word_embeddings: ``None`` drops each tied head ({heads}) when it is the tensor it is tied to
            (same memory or equal values), ``True`` drops it (raises if it differs), ``False`` keeps it.
        keep_view_shapes: give the fused tensors ({fused}) their global view shape, as the checkpoint
            stores them, instead of the unsharded model's (the view's first two dims as one).
    """

_EXPORT_DOC = """Our unsharded {arch} state dict -> HF keys and layouts (bit-exact; may share memory with
    the input). Fused tensors ({fused}) may come in the model's shape or the view shape.

    ``tie_word_embeddings=True`` adds each tied head ({heads}) as the tensor it is tied to, when ours
    lacks it (what ``load_state_dict`` of an HF model holding both names wants); by default a missing
    head stays missing, as in HF's own files.
    """


def _state_beside(translation: Translation, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` with a fused parameter's optimizer state held in its other shape (the view's ``[3, d,
    d]`` beside a live ``[3d, d]`` parameter, or the reverse) reshaped to its parameter's, so it translates
    with it (rev61f F1: it came back untranslated, under our own key)."""
    sd = dict(state_dict)
    for key, value in state_dict.items():
        name = key.rpartition(".")[0]
        param = sd.get(name)
        if param is None or abs(value.dim() - param.dim()) != 1:
            continue
        view, model = (value, param) if value.dim() > param.dim() else (param, value)
        if translation.merged_shapes({name: view.shape}).get(name) == tuple(model.shape):
            sd[key] = value.reshape(param.shape)
    return sd


def _fit_checks() -> ModuleType:
    """:mod:`smpckpt.hf`, whose fit checks (``check_translation``, ``check_config_tensors``) the eager
    helpers run; imported on call, as it imports the family modules that import this one."""
    return importlib.import_module("smpckpt.hf")


def _shapes(state_dict: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    for k, v in state_dict.items():
        if not isinstance(v, torch.Tensor):  # named, as the translation itself does (rev70b L1)
            raise TypeError(f"{k!r}: expected a tensor, got {type(v).__name__}")
    return {k: tuple(v.shape) for k, v in state_dict.items()}


def eager_helpers(module: str, translation: Translation) -> tuple[ImportFn, ExportFn]:
    """A family's eager ``translate_hf_state_dict_to_smpckpt`` and ``translate_state_dict_to_hf``, bound
    to its translation (whose ``tied`` heads they drop on import and may add on export; whose fused
    rules give the model's shape of a view, :meth:`~smpckpt.model.translation.Translation.merged_shapes`),
    documented as functions of ``module``."""

    def translate_hf_state_dict_to_smpckpt(
        state_dict: Mapping[str, torch.Tensor],
        *,
        tie_word_embeddings: bool | None = None,
        keep_view_shapes: bool = False,
    ) -> dict[str, torch.Tensor]:
        fit = _fit_checks()
        sd = dict(state_dict)
        if tie_word_embeddings is not False:
            for head, embed in translation.tied.items():
                if head in sd and embed in sd:
                    if _tied(sd[head], sd[embed]):
                        del sd[head]
                    elif tie_word_embeddings:
                        raise ValueError(f"tie_word_embeddings=True but {head!r} differs from {embed!r}")
        fit.check_translation(translation, _shapes(sd), "artifact")  # as loading a folder does
        ours = translation.translate_from_artifact(sd)
        if not keep_view_shapes:  # views of contiguous tensors
            merged = translation.merged_shapes({k: t.shape for k, t in ours.items()})
            ours.update({k: ours[k].reshape(shape) for k, shape in merged.items()})
        return ours

    def translate_state_dict_to_hf(
        state_dict: Mapping[str, torch.Tensor], *, tie_word_embeddings: bool = False
    ) -> dict[str, torch.Tensor]:
        fit = _fit_checks()
        sd = _state_beside(translation, state_dict)  # fused: either shape
        fit.check_translation(translation, _shapes(sd), "ours")  # as the online export and consolidate do
        out = translation.translate_to_artifact(sd)
        if tie_word_embeddings:
            for head, embed in translation.tied.items():
                if head not in out and embed in out:
                    out[head] = out[embed]
        fit.check_config_tensors(translation, None, out)  # no config here: what needs none (Qwen2's biases)
        return out

    facts = {
        "arch": translation.architecture,
        "heads": ", ".join(f"``{h}``" for h in translation.tied) or "none",
        "fused": ", ".join(f"``{r.ours}``" for r in translation.rules if r.fused),
    }
    for fn, doc in ((translate_hf_state_dict_to_smpckpt, _IMPORT_DOC), (translate_state_dict_to_hf, _EXPORT_DOC)):
        fn.__module__, fn.__qualname__, fn.__doc__ = module, fn.__name__, doc.format(**facts)
    return translate_hf_state_dict_to_smpckpt, translate_state_dict_to_hf


_LAYER = re.compile(r"^transformer\.h\.(\d+)\.")


def add_mask_buffers(
    out: dict[str, torch.Tensor], max_seq_len: int | None, attn: str, masked_bias: float
) -> dict[str, torch.Tensor]:
    """smp's ``max_seq_len`` (``None``: nothing added): the causal-mask buffers old transformers versions kept in GPT-2, GPT-J and
    GPT-Neo state dicts, per layer found in ``out``: ``transformer.h.{i}.<attn>bias`` =
    ``tril(ones(L, L, bool)).view(1, 1, L, L)`` (a tensor each, as the old models held them) and
    ``<attn>masked_bias`` = ``tensor(masked_bias)``."""
    if max_seq_len is None:
        return out
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
        raise ValueError(f"max_seq_len must be a positive int, got {max_seq_len!r}")
    mask = torch.tril(torch.ones(max_seq_len, max_seq_len, dtype=torch.bool)).view(1, 1, max_seq_len, max_seq_len)
    layers = sorted({int(m.group(1)) for key in out if (m := _LAYER.match(key))})
    for i in layers:
        out[f"transformer.h.{i}.{attn}bias"] = mask.clone()
        out[f"transformer.h.{i}.{attn}masked_bias"] = torch.tensor(masked_bias)
    return out

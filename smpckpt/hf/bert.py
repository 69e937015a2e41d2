"""BERT: Hugging Face ``BertForMaskedLM`` (and ``BertModel``) <-> our Megatron-style tensor-parallel BERT.

Keys are HF's (the README's "Hugging Face families"), except each layer's query, key and value, one fused
column-parallel ``attention.self.qkv`` (``[3, d, d]``, bias ``[3, d]``; the unsharded model's ``[3d, d]`` is
``cat([query, key, value])``), under ``bert.`` in head models and bare in ``BertModel`` (both get specs,
:func:`tp_specs`). The MLM bias and an untied decoder are split with the embedding's (near-even) rows.

Not translated: the tied heads ``cls.predictions.decoder.weight`` / ``.bias`` (see :mod:`smpckpt.hf`; untied,
``cls.predictions.bias`` is still kept), the ``embeddings.position_ids`` / ``token_type_ids`` buffers;
cross-attention keeps HF's separate query/key/value (its keys and values read the encoder) and is replicated."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from smpckpt.hf._common import cfg_get, check_divides, check_tp, eager_helpers, prefixed, vocab_spec
from smpckpt.model.specs import ShardSpec
from smpckpt.model.translation import Translation, stack

# every family's names, then smp v1's
__all__ = ["TRANSLATION", "translate_hf_state_dict_to_smpckpt", "translate_state_dict_to_hf", "tp_specs"]
__all__ += ["translate_state_dict_to_hf_bert", "translate_hf_state_dict_to_smdistributed_bert"]

_BASE = "bert."
_HEAD = "cls.predictions."
_SELF = "encoder.layer.{i}.attention.self."


def make_translation(name: str, architecture: str, base: str, head: str) -> Translation:
    """The BERT-family translation ``name`` (HF ``config.model_type``) of the transformers class
    ``architecture``: fused q/k/v under the head models' ``base`` (``"bert."``) and in the bare model; the
    MLM ``head`` (``"cls.predictions."``)'s decoder weight and bias tied to the word embeddings and to
    ``<head>bias``."""
    return Translation(
        name,
        rules=tuple(  # the fused q/k/v weight and bias of the layers under ``base`` and of the bare model
            stack(p + f"qkv.{w}", tuple(p + f"{n}.{w}" for n in ("query", "key", "value")))
            for p in (base + _SELF, _SELF)
            for w in ("weight", "bias")
        ),
        ignore=tuple(b + f"embeddings.{buf}" for b in (base, "") for buf in ("position_ids", "token_type_ids")),
        tied={
            head + "decoder.weight": base + "embeddings.word_embeddings.weight",
            head + "decoder.bias": head + "bias",
        },
        architecture=architecture,
    )


def family_specs(model: str, tp: int, config: Any, prefix: str, *, base: str, head: str) -> dict[str, ShardSpec]:
    """Spec rules of the BERT family, for the head models' ``base`` and the bare model; the MLM ``head``'s
    vocab-sized tensors (bias, untied decoder weight and bias) are split as the embedding is."""
    check_tp(tp)
    d = int(cfg_get(config, "hidden_size"))
    check_divides(model, "num_attention_heads", int(cfg_get(config, "num_attention_heads")), tp)
    check_divides(model, "intermediate_size", int(cfg_get(config, "intermediate_size")), tp)
    rows = vocab_spec(model, int(cfg_get(config, "vocab_size")), tp)
    rules: dict[str, ShardSpec] = {}
    for b in (base, ""):
        layer = b + "encoder.layer.*."
        rules[b + "embeddings.word_embeddings.weight"] = rows
        rules[layer + "attention.self.qkv.weight"] = ShardSpec(1, view=(3, -1, d))
        rules[layer + "attention.self.qkv.bias"] = ShardSpec(1, view=(3, -1))
        rules[layer + "attention.output.dense.weight"] = ShardSpec(1)
        rules[layer + "intermediate.dense.weight"] = ShardSpec(0)
        rules[layer + "intermediate.dense.bias"] = ShardSpec(0)
        # fnmatch's ``*`` crosses dots: ``*[0-9].output`` is the layer's own output (``layer.11.output``),
        # not ``attention.output`` nor a replicated ``crossattention.output``
        rules[b + "encoder.layer.*[0-9].output.dense.weight"] = ShardSpec(1)
    rules.update(dict.fromkeys((head + "bias", head + "decoder.weight", head + "decoder.bias"), rows))
    return prefixed(prefix, rules)


def position_ids_buffer(out: dict[str, torch.Tensor], max_seq_len: int | None) -> dict[str, torch.Tensor]:
    """Add ``<p>embeddings.position_ids`` (``arange(max_seq_len)``, ``[1, max_seq_len]`` int64) next to the
    other embedding keys of an exported HF state dict, as transformers versions of smp's time kept it."""
    if max_seq_len is None:
        return out
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
        raise ValueError(f"max_seq_len must be a positive int or None, got {max_seq_len!r}")
    found = {m.group(1) for k in out if (m := re.fullmatch(r"(.*)embeddings\.(?:word|position)_embeddings\.weight", k))}
    if len(found) != 1:
        raise ValueError(
            f"max_seq_len: cannot tell where embeddings.position_ids goes: the state dict has "
            f"{'no embeddings' if not found else 'embeddings under ' + str(sorted(found))}"
        )
    out[found.pop() + "embeddings.position_ids"] = torch.arange(max_seq_len, dtype=torch.int64).unsqueeze(0)
    return out


TRANSLATION = make_translation("bert", "BertForMaskedLM", _BASE, _HEAD)


translate_hf_state_dict_to_smpckpt, translate_state_dict_to_hf = eager_helpers(__name__, TRANSLATION)


def tp_specs(tp: int, config: Any = None, *, prefix: str = "") -> dict[str, ShardSpec]:
    """Glob -> ShardSpec rules of our BERT under TP degree ``tp``, for head models and the bare model, as
    :mod:`smpckpt.hf` says (``config``: ``hidden_size``, ``num_attention_heads``, ``intermediate_size``,
    ``vocab_size``)."""
    return family_specs("bert", tp, config, prefix, base=_BASE, head=_HEAD)


def translate_state_dict_to_hf_bert(
    state_dict: Mapping[str, torch.Tensor], max_seq_len: int | None = None
) -> dict[str, torch.Tensor]:
    """smp v1's name: our BERT -> an HF state dict that ``load_state_dict(strict=True)`` of the HF model
    accepts (tied decoder weight and bias included, as ``model.state_dict()`` holds them). ``max_seq_len``:
    the old ``embeddings.position_ids`` buffer (README "Coming from smp"; :func:`position_ids_buffer`)."""
    return position_ids_buffer(translate_state_dict_to_hf(state_dict, tie_word_embeddings=True), max_seq_len)


#: smp v1's name for :func:`translate_hf_state_dict_to_smpckpt`.
translate_hf_state_dict_to_smdistributed_bert = translate_hf_state_dict_to_smpckpt

"""RoBERTa: Hugging Face ``RobertaForMaskedLM`` (and ``RobertaModel``) <-> our tensor-parallel RoBERTa.

Laid out as :mod:`smpckpt.hf.bert` with ``roberta.`` for ``bert.``; the MLM head is ``lm_head``, whose
``bias`` and untied ``decoder`` are split with the embedding's rows, its ``dense`` and ``layer_norm``
replicated. Tied ``lm_head.decoder.weight`` / ``.bias`` and the embeddings' buffers are not translated."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from smpckpt.hf._common import eager_helpers
from smpckpt.hf.bert import family_specs, make_translation, position_ids_buffer
from smpckpt.model.specs import ShardSpec

# every family's names, then smp v1's
__all__ = ["TRANSLATION", "translate_hf_state_dict_to_smpckpt", "translate_state_dict_to_hf", "tp_specs"]
__all__ += ["translate_state_dict_to_hf_roberta", "translate_hf_state_dict_to_smdistributed_roberta"]
__all__ += ["translate_state_dict_to_smdistributed"]

_BASE = "roberta."
_HEAD = "lm_head."

TRANSLATION = make_translation("roberta", "RobertaForMaskedLM", _BASE, _HEAD)


translate_hf_state_dict_to_smpckpt, translate_state_dict_to_hf = eager_helpers(__name__, TRANSLATION)


def tp_specs(tp: int, config: Any = None, *, prefix: str = "") -> dict[str, ShardSpec]:
    """Glob -> ShardSpec rules of our RoBERTa under TP degree ``tp``; as :func:`smpckpt.hf.bert.tp_specs`
    (``RobertaConfig`` or a dict), with ``lm_head.bias`` and an untied decoder vocab-parallel."""
    return family_specs("roberta", tp, config, prefix, base=_BASE, head=_HEAD)


def translate_state_dict_to_hf_roberta(
    state_dict: Mapping[str, torch.Tensor], max_seq_len: int | None = None
) -> dict[str, torch.Tensor]:
    """smp v1's name: our RoBERTa -> an HF state dict that ``load_state_dict(strict=True)`` of the HF
    model accepts (tied ``lm_head.decoder`` weight and bias included). ``max_seq_len``: as
    :func:`smpckpt.hf.bert.translate_state_dict_to_hf_bert` (the old ``embeddings.position_ids`` buffer)."""
    return position_ids_buffer(translate_state_dict_to_hf(state_dict, tie_word_embeddings=True), max_seq_len)


#: smp v1's name for :func:`translate_hf_state_dict_to_smpckpt`.
translate_hf_state_dict_to_smdistributed_roberta = translate_hf_state_dict_to_smpckpt
#: The name smp's own documentation uses in its RoBERTa example.
translate_state_dict_to_smdistributed = translate_hf_state_dict_to_smdistributed_roberta

"""Mistral: Hugging Face ``MistralForCausalLM`` <-> our Megatron-style tensor-parallel Mistral.

Mistral's weights are laid out as Llama's, so ours is :mod:`smpckpt.hf.llama`'s (its table holds for
Mistral too): fused ``mlp.gate_up_proj``, everything else under HF's keys, k and v replicated when there
are fewer kv heads (Mistral-7B has 8) than TP ranks. The sliding window (``config.sliding_window``)
only masks attention scores; it does not touch the layout.

Not translated: a tied ``lm_head.weight`` (untied by default; see :mod:`smpckpt.hf`) and
``rotary_emb.inv_freq`` buffers. SageMaker model parallel v1 never supported Mistral: no smp-named aliases."""

from __future__ import annotations

from typing import Any

from smpckpt.hf._common import eager_helpers
from smpckpt.hf.llama import family_specs, make_translation
from smpckpt.model.specs import ShardSpec

__all__ = ["TRANSLATION", "translate_hf_state_dict_to_smpckpt", "translate_state_dict_to_hf", "tp_specs"]

TRANSLATION = make_translation("mistral", "MistralForCausalLM")


translate_hf_state_dict_to_smpckpt, translate_state_dict_to_hf = eager_helpers(__name__, TRANSLATION)


def tp_specs(tp: int, config: Any = None, *, prefix: str = "") -> dict[str, ShardSpec]:
    """Glob -> ShardSpec rules of our Mistral under TP degree ``tp``; as :func:`smpckpt.hf.llama.tp_specs`
    (``MistralConfig`` or a dict with the same fields)."""
    return family_specs("mistral", tp, config, prefix, biases=False)

"""Qwen2: Hugging Face ``Qwen2ForCausalLM`` <-> our Megatron-style tensor-parallel Qwen2.

Laid out as :mod:`smpckpt.hf.llama` (fused ``mlp.gate_up_proj``, everything else under HF's keys), plus
the q/k/v biases: ``q_proj.bias`` is split on dim 0 with its heads; ``k_proj.bias`` / ``v_proj.bias``
follow the k/v weights (split when ``nkv % tp == 0``, else replicated)."""

from __future__ import annotations

from typing import Any

from smpckpt.hf._common import eager_helpers
from smpckpt.hf.llama import family_specs, make_translation
from smpckpt.model.specs import ShardSpec

__all__ = ["TRANSLATION", "translate_hf_state_dict_to_smpckpt", "translate_state_dict_to_hf", "tp_specs", "BIASES"]

# Qwen2ForCausalLM's only biases are q/k/v's
TRANSLATION = make_translation("qwen2", "Qwen2ForCausalLM", no_bias=("o", "gate", "up", "down"))

#: the modules of each layer that have a bias in every Qwen2ForCausalLM, whatever its config (HF's names)
BIASES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


translate_hf_state_dict_to_smpckpt, translate_state_dict_to_hf = eager_helpers(__name__, TRANSLATION)


def tp_specs(tp: int, config: Any = None, *, prefix: str = "") -> dict[str, ShardSpec]:
    """Glob -> ShardSpec rules of our Qwen2 under TP degree ``tp``; as :func:`smpckpt.hf.llama.tp_specs`
    plus the q/k/v biases."""
    return family_specs("qwen2", tp, config, prefix)

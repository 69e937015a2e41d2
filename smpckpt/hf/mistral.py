"""Mistral: Hugging Face ``MistralForCausalLM`` <-> ours, laid out as :mod:`smpckpt.hf.llama` (the
sliding window only masks scores). smp v1 never supported Mistral: no smp-named aliases."""

from __future__ import annotations

from typing import Any

from smpckpt.hf._common import eager_helpers
from smpckpt.hf.llama import family_specs, make_translation
from smpckpt.model.specs import ShardSpec

__all__ = ["TRANSLATION", "translate_hf_state_dict_to_smpckpt", "translate_state_dict_to_hf", "tp_specs"]

# MistralForCausalLM has no biases, whatever its config
TRANSLATION = make_translation("mistral", "MistralForCausalLM", no_bias=("q", "k", "v", "o", "gate", "up", "down"))


translate_hf_state_dict_to_smpckpt, translate_state_dict_to_hf = eager_helpers(__name__, TRANSLATION)


def tp_specs(tp: int, config: Any = None, *, prefix: str = "") -> dict[str, ShardSpec]:
    """Glob -> ShardSpec rules of our Mistral under TP degree ``tp``; as :func:`smpckpt.hf.llama.tp_specs`
    (``MistralConfig`` or a dict with the same fields)."""
    return family_specs("mistral", tp, config, prefix)

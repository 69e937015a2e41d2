"""Qwen2: Hugging Face ``Qwen2ForCausalLM`` <-> our Megatron-style tensor-parallel Qwen2.

Laid out as :mod:`smpckpt.hf.llama` (fused ``mlp.gate_up_proj``, everything else under HF's keys), plus
the q/k/v biases: ``q_proj.bias`` is split on dim 0 with its heads; ``k_proj.bias`` / ``v_proj.bias``
follow the k/v weights (split when ``nkv % tp == 0``, else replicated).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from smpckpt.hf._common import export_hf, import_hf
from smpckpt.hf.llama import FUSED, family_specs, make_translation
from smpckpt.model.specs import ShardSpec

__all__ = ["TRANSLATION", "translate_hf_state_dict_to_smpckpt", "translate_state_dict_to_hf", "tp_specs"]

TRANSLATION = make_translation("qwen2", "Qwen2ForCausalLM")


def translate_hf_state_dict_to_smpckpt(
    state_dict: Mapping[str, torch.Tensor], *, tie_word_embeddings: bool | None = None, keep_view_shapes: bool = False
) -> dict[str, torch.Tensor]:
    """HF ``Qwen2ForCausalLM`` state dict -> ours; arguments as :func:`smpckpt.hf.llama.translate_hf_state_dict_to_smpckpt`."""
    return import_hf(
        TRANSLATION,
        state_dict,
        fused=FUSED,
        tie_word_embeddings=tie_word_embeddings,
        keep_view_shapes=keep_view_shapes,
    )


def translate_state_dict_to_hf(
    state_dict: Mapping[str, torch.Tensor], *, tie_word_embeddings: bool = False
) -> dict[str, torch.Tensor]:
    """Our unsharded Qwen2 state dict -> HF's; as :func:`smpckpt.hf.llama.translate_state_dict_to_hf`."""
    return export_hf(TRANSLATION, state_dict, fused=FUSED, tie_word_embeddings=tie_word_embeddings)


def tp_specs(tp: int, config: Any = None, *, prefix: str = "") -> dict[str, ShardSpec]:
    """Glob -> ShardSpec rules of our Qwen2 under TP degree ``tp``; as :func:`smpckpt.hf.llama.tp_specs`
    plus the q/k/v biases."""
    return family_specs("qwen2", tp, config, prefix, biases=True)

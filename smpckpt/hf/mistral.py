"""Mistral: Hugging Face ``MistralForCausalLM`` <-> our Megatron-style tensor-parallel Mistral.

Mistral's weights are laid out as Llama's, so ours is :mod:`smpckpt.hf.llama`'s (``...`` is
``model.layers.{i}.``):

============================================ ================================= ==============================
ours (global view shape)                     spec (``tp_specs``)               HF
============================================ ================================= ==============================
``model.embed_tokens.weight [V, d]``         dim 0 (vocab-parallel)            same key
``...self_attn.q_proj.weight``               dim 0 (whole heads)               same key
``...self_attn.k_proj/v_proj.weight``        dim 0 if ``nkv % tp == 0``, else  same keys
                                             replicated (``tp % nkv == 0``)
``...self_attn.o_proj.weight``               dim 1 (row-parallel)              same key
``...mlp.gate_up_proj.weight [2, I, d]``     view ``(2, -1, d)``, dim 1        ``stack([gate_proj, up_proj])``
``...mlp.down_proj.weight``                  dim 1                             same key
norms                                        replicated                        same keys
``lm_head.weight``                           dim 0 (when untied)               same key
============================================ ================================= ==============================

With fewer kv heads than TP ranks (grouped-query attention, ``nkv < tp``; Mistral-7B has 8), k and v are
replicated: every rank holds all kv heads and uses the one its query heads share. Mistral's sliding
window (``config.sliding_window``) only masks attention scores; it does not touch the layout.

Eager helpers: ``lm_head.weight`` (untied by default) tied to the embedding is dropped on import and
produced on export only with ``tie_word_embeddings=True``; ``rotary_emb.inv_freq`` buffers (written by old
transformers versions) are not weights and are dropped on import. SageMaker model parallel v1 never
supported Mistral, so there are no smp-named aliases here.
"""

from __future__ import annotations

from typing import Any

from smpckpt.hf._common import eager_helpers
from smpckpt.hf.llama import FUSED, family_specs, make_translation
from smpckpt.model.specs import ShardSpec

__all__ = ["TRANSLATION", "translate_hf_state_dict_to_smpckpt", "translate_state_dict_to_hf", "tp_specs"]

TRANSLATION = make_translation("mistral", "MistralForCausalLM")


translate_hf_state_dict_to_smpckpt, translate_state_dict_to_hf = eager_helpers(__name__, TRANSLATION, FUSED)


def tp_specs(tp: int, config: Any = None, *, prefix: str = "") -> dict[str, ShardSpec]:
    """Glob -> ShardSpec rules of our Mistral under TP degree ``tp``; as :func:`smpckpt.hf.llama.tp_specs`
    (``MistralConfig`` or a dict with the same fields)."""
    return family_specs("mistral", tp, config, prefix, biases=False)

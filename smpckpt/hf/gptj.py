"""GPT-J: Hugging Face ``GPTJForCausalLM`` <-> our Megatron-style tensor-parallel GPT-J.

Keys are HF's, except the attention's q, k and v (no biases), one fused ``attn.qkv_proj`` in a view that
reshards (README "Hugging Face families", :func:`tp_specs`). Its rotary embedding acts within each head, so
whole heads per rank is all TP needs; the head's bias is split with its rows (each rank adds its slice).

Not translated: a tied ``lm_head.weight`` (untied by default; see :mod:`smpckpt.hf`), the causal-mask
buffers ``attn.bias`` / ``attn.masked_bias`` (:func:`translate_state_dict_to_hf_gptj` can add them back) and
``attn.embed_positions`` (the rotary table)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from smpckpt.hf._common import add_mask_buffers, eager_helpers, gpt_dims, prefixed
from smpckpt.model.specs import ShardSpec
from smpckpt.model.translation import Translation, stack

# every family's names, then smp v1's
__all__ = ["TRANSLATION", "translate_hf_state_dict_to_smpckpt", "translate_state_dict_to_hf", "tp_specs"]
__all__ += ["translate_state_dict_to_hf_gptj", "translate_hf_state_dict_to_smdistributed_gptj"]
__all__ += ["translate_hf_gptj_state_dict_to_smdistributed_gptj"]

_H = "transformer.h.{i}."
_EMBED, _HEAD = "transformer.wte.weight", "lm_head.weight"
_QKV = _H + "attn.qkv_proj.weight"

TRANSLATION = Translation(
    "gptj",
    # modeling_gptj.py: q/k/v/out_proj are Linear(bias=False), a block has ln_1 only, positions are rotary
    absent=(
        *(_H + f"attn.{p}_proj.bias" for p in ("q", "k", "v", "out")),
        *(_H + f"ln_2.{w}" for w in ("weight", "bias")),
        "transformer.wpe.weight",
    ),
    rules=(stack(_QKV, tuple(_H + f"attn.{p}_proj.weight" for p in "qkv")),),
    ignore=(_H + "attn.bias", _H + "attn.masked_bias", _H + "attn.embed_positions"),
    tied={_HEAD: _EMBED},
    architecture="GPTJForCausalLM",
)


translate_hf_state_dict_to_smpckpt, translate_state_dict_to_hf = eager_helpers(__name__, TRANSLATION)


def tp_specs(tp: int, config: Any = None, *, prefix: str = "") -> dict[str, ShardSpec]:
    """Glob -> ShardSpec rules of our GPT-J under TP degree ``tp``, as :mod:`smpckpt.hf` says (``config``:
    ``n_embd`` / ``hidden_size``, ``n_head`` / ``num_attention_heads``, ``vocab_size``, optional ``n_inner``)."""
    d, rows = gpt_dims("gptj", tp, config, ("n_embd", "hidden_size"), ("n_head", "num_attention_heads"), "n_inner")
    return prefixed(
        prefix,
        {
            _EMBED: rows,
            _HEAD: rows,
            "lm_head.bias": rows,  # the head's bias follows its rows: each rank adds its slice
            "transformer.h.*.attn.qkv_proj.weight": ShardSpec(1, view=(3, -1, d)),
            "transformer.h.*.attn.out_proj.weight": ShardSpec(1),
            "transformer.h.*.mlp.fc_in.weight": ShardSpec(0),
            "transformer.h.*.mlp.fc_in.bias": ShardSpec(0),
            "transformer.h.*.mlp.fc_out.weight": ShardSpec(1),
        },
    )


# -- SageMaker model parallel (smp v1) names -----------------------------------------------------------


def translate_state_dict_to_hf_gptj(
    state_dict: Mapping[str, torch.Tensor], max_seq_len: int | None = None
) -> dict[str, torch.Tensor]:
    """smp v1's name: our unsharded GPT-J state dict -> one ``GPTJForCausalLM.load_state_dict`` accepts.

    A head ours lacks is produced as the embedding (no config says whether it is tied). ``max_seq_len``: as
    :func:`smpckpt.hf.gpt2.translate_state_dict_to_hf_gpt2` (``masked_bias`` is ``tensor(-1e9)`` here)."""
    out = translate_state_dict_to_hf(state_dict, tie_word_embeddings=True)
    return add_mask_buffers(out, max_seq_len, "attn.", -1e9)


#: smp v1's name for :func:`translate_hf_state_dict_to_smpckpt` (its defaults are smp's).
translate_hf_state_dict_to_smdistributed_gptj = translate_hf_state_dict_to_smpckpt


#: smp v1's exact (inconsistently ordered) name of :func:`translate_hf_state_dict_to_smdistributed_gptj`.
translate_hf_gptj_state_dict_to_smdistributed_gptj = translate_hf_state_dict_to_smdistributed_gptj

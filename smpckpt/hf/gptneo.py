"""GPT-Neo: Hugging Face ``GPTNeoForCausalLM`` <-> our Megatron-style tensor-parallel GPT-Neo.

Named ``gptneo`` as in smp's import path; the HF ``model_type`` is ``gpt_neo``. Keys are HF's, except the
attention's q, k and v (no biases), one fused ``attn.attention.qkv_proj`` in a view that reshards (README
"Hugging Face families", :func:`tp_specs`); its local layers only mask scores. Not translated:
``lm_head.weight``, tied by default (see :mod:`smpckpt.hf`), and the mask buffers ``attn.attention.bias`` /
``attn.attention.masked_bias`` (:func:`translate_state_dict_to_hf_gptneo` can add them back)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from smpckpt.hf._common import add_mask_buffers, eager_helpers, gpt_dims, prefixed
from smpckpt.model.specs import ShardSpec
from smpckpt.model.translation import Translation, stack

# every family's names, then smp v1's
__all__ = ["TRANSLATION", "translate_hf_state_dict_to_smpckpt", "translate_state_dict_to_hf", "tp_specs"]
__all__ += ["translate_state_dict_to_hf_gptneo", "translate_hf_state_dict_to_smdistributed_gptneo"]

_A = "transformer.h.{i}.attn.attention."
_EMBED, _HEAD = "transformer.wte.weight", "lm_head.weight"
_QKV = _A + "qkv_proj.weight"

TRANSLATION = Translation(
    "gpt_neo",
    # modeling_gpt_neo.py: q/k/v_proj are Linear(bias=False) (out_proj has one), lm_head is Linear(bias=False)
    absent=(*(_A + f"{p}_proj.bias" for p in "qkv"), "lm_head.bias"),
    rules=(stack(_QKV, tuple(_A + f"{p}_proj.weight" for p in "qkv")),),
    ignore=(_A + "bias", _A + "masked_bias"),
    tied={_HEAD: _EMBED},
    architecture="GPTNeoForCausalLM",
)


translate_hf_state_dict_to_smpckpt, translate_state_dict_to_hf = eager_helpers(__name__, TRANSLATION)


def tp_specs(tp: int, config: Any = None, *, prefix: str = "") -> dict[str, ShardSpec]:
    """Glob -> ShardSpec rules of our GPT-Neo under TP degree ``tp``, as :mod:`smpckpt.hf` says (``config``:
    ``hidden_size``, ``num_heads`` / ``num_attention_heads``, ``vocab_size``, optional ``intermediate_size``)."""
    d, rows = gpt_dims(
        "gpt_neo", tp, config, ("hidden_size",), ("num_heads", "num_attention_heads"), "intermediate_size"
    )
    return prefixed(
        prefix,
        {
            _EMBED: rows,
            _HEAD: rows,  # only an untied head
            "transformer.h.*.attn.attention.qkv_proj.weight": ShardSpec(1, view=(3, -1, d)),
            "transformer.h.*.attn.attention.out_proj.weight": ShardSpec(1),
            "transformer.h.*.mlp.c_fc.weight": ShardSpec(0),
            "transformer.h.*.mlp.c_fc.bias": ShardSpec(0),
            "transformer.h.*.mlp.c_proj.weight": ShardSpec(1),
        },
    )


# -- SageMaker model parallel (smp v1) names -----------------------------------------------------------


def translate_state_dict_to_hf_gptneo(
    state_dict: Mapping[str, torch.Tensor], max_seq_len: int | None = None
) -> dict[str, torch.Tensor]:
    """smp v1's name: our unsharded GPT-Neo state dict -> one ``GPTNeoForCausalLM.load_state_dict`` accepts.

    A head ours lacks is produced as the embedding (no config says whether it is tied). ``max_seq_len``: as
    :func:`smpckpt.hf.gpt2.translate_state_dict_to_hf_gpt2` (under ``attn.attention.``; ``masked_bias``
    ``tensor(-1e9)``); local layers held a banded mask (``bias ^ tril(bias, -window_size)``), which this
    cannot know without a config: where exactness matters, take the buffers from the model's ``state_dict()``."""
    out = translate_state_dict_to_hf(state_dict, tie_word_embeddings=True)
    return add_mask_buffers(out, max_seq_len, "attn.attention.", -1e9)


#: smp v1's name for :func:`translate_hf_state_dict_to_smpckpt` (its defaults are smp's).
translate_hf_state_dict_to_smdistributed_gptneo = translate_hf_state_dict_to_smpckpt

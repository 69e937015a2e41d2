"""GPT-2: Hugging Face ``GPT2LMHeadModel`` <-> our Megatron-style tensor-parallel GPT-2.

HF's ``Conv1D`` weights (``[in, out]``) are our ``nn.Linear``'s (``[out, in]``) transposed, and ``c_attn``
is our fused ``attn.qkv`` in a view that reshards (``ours[j, o, i] = c_attn[i, j*d + o]``); see the
README's "Hugging Face families" and :func:`tp_specs`. Not translated: ``lm_head.weight``, tied to
``transformer.wte.weight`` (see :mod:`smpckpt.hf`), and the causal-mask buffers ``attn.bias`` /
``attn.masked_bias``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from smpckpt.hf._common import add_mask_buffers, eager_helpers, gpt_dims, prefixed
from smpckpt.model.specs import ShardSpec
from smpckpt.model.translation import Leaf, Rule, Shape, Translation, rename, transpose

# every family's names, then smp v1's
__all__ = ["TRANSLATION", "translate_hf_state_dict_to_smpckpt", "translate_state_dict_to_hf", "tp_specs"]
__all__ += ["translate_state_dict_to_hf_gpt2", "translate_hf_state_dict_to_smdistributed_gpt2"]

_H = "transformer.h.{i}."
_EMBED, _HEAD = "transformer.wte.weight", "lm_head.weight"


def _qkv_weight(keys: tuple[str, ...], shapes: tuple[Shape, ...]) -> Leaf:
    (d_in, width) = shapes[0]
    if width % 3:
        raise ValueError(f"fused QKV width {width} does not divide by 3")
    # c_attn[i, j*d + o] -> ours[j, o, i]
    return Leaf(keys[0], view=(d_in, 3, width // 3), perm=(1, 2, 0))


def _qkv_weight_split(shape: Shape) -> tuple[Shape, ...]:
    if len(shape) != 3 or shape[0] != 3:
        raise ValueError(f"expected the QKV view [3, d_out, d_in], got {shape}")
    return ((shape[2], 3 * shape[1]),)


def _qkv_bias(keys: tuple[str, ...], shapes: tuple[Shape, ...]) -> Leaf:
    if len(shapes[0]) != 1 or shapes[0][0] % 3:
        raise ValueError(f"fused QKV bias of shape {shapes[0]} does not split into 3")
    return Leaf(keys[0], view=(3, shapes[0][0] // 3))


def _qkv_bias_split(shape: Shape) -> tuple[Shape, ...]:
    if len(shape) != 2 or shape[0] != 3:
        raise ValueError(f"expected the QKV bias view [3, d], got {shape}")
    return ((3 * shape[1],),)


TRANSLATION = Translation(
    "gpt2",
    rules=(
        Rule(_H + "attn.qkv.weight", (_H + "attn.c_attn.weight",), _qkv_weight, _qkv_weight_split, fused=3),
        Rule(_H + "attn.qkv.bias", (_H + "attn.c_attn.bias",), _qkv_bias, _qkv_bias_split, fused=3),
        transpose(_H + "attn.proj.weight", _H + "attn.c_proj.weight"),
        rename(_H + "attn.proj.bias", _H + "attn.c_proj.bias"),
        transpose(_H + "mlp.fc.weight", _H + "mlp.c_fc.weight"),
        rename(_H + "mlp.fc.bias", _H + "mlp.c_fc.bias"),
        transpose(_H + "mlp.proj.weight", _H + "mlp.c_proj.weight"),
        rename(_H + "mlp.proj.bias", _H + "mlp.c_proj.bias"),
    ),
    ignore=(_H + "attn.bias", _H + "attn.masked_bias"),
    tied={_HEAD: _EMBED},
    architecture="GPT2LMHeadModel",
)


translate_hf_state_dict_to_smpckpt, translate_state_dict_to_hf = eager_helpers(__name__, TRANSLATION)


def translate_state_dict_to_hf_gpt2(
    state_dict: Mapping[str, torch.Tensor], max_seq_len: int | None = None
) -> dict[str, torch.Tensor]:
    """smp v1's name: our unsharded GPT-2 state dict -> one ``GPT2LMHeadModel.load_state_dict`` accepts
    (strictly): as :func:`translate_state_dict_to_hf` with the tied ``lm_head.weight`` present.
    ``max_seq_len``: the old causal-mask buffers (README "Coming from smp"; :func:`._common.add_mask_buffers`,
    ``masked_bias`` ``tensor(-1e4)``); ``None`` adds nothing."""
    out = translate_state_dict_to_hf(state_dict, tie_word_embeddings=True)
    return add_mask_buffers(out, max_seq_len, "attn.", -1e4)


#: smp v1's name for :func:`translate_hf_state_dict_to_smpckpt` (its defaults are smp's).
translate_hf_state_dict_to_smdistributed_gpt2 = translate_hf_state_dict_to_smpckpt


def tp_specs(tp: int, config: Any = None, *, prefix: str = "") -> dict[str, ShardSpec]:
    """Glob -> ShardSpec rules of our GPT-2 under TP degree ``tp``, as :mod:`smpckpt.hf` says (``config``:
    ``n_embd``, ``n_head``, ``vocab_size``, optional ``n_inner``)."""
    d, rows = gpt_dims("gpt2", tp, config, ("n_embd", "hidden_size"), ("n_head", "num_attention_heads"), "n_inner")
    return prefixed(
        prefix,
        {
            _EMBED: rows,
            _HEAD: rows,  # only an untied head
            "transformer.h.*.attn.qkv.weight": ShardSpec(1, view=(3, -1, d)),
            "transformer.h.*.attn.qkv.bias": ShardSpec(1, view=(3, -1)),
            "transformer.h.*.attn.proj.weight": ShardSpec(1),
            "transformer.h.*.mlp.fc.weight": ShardSpec(0),
            "transformer.h.*.mlp.fc.bias": ShardSpec(0),
            "transformer.h.*.mlp.proj.weight": ShardSpec(1),
        },
    )

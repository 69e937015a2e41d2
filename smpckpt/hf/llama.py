"""Llama: Hugging Face ``LlamaForCausalLM`` <-> our Megatron-style tensor-parallel Llama.

Keys are HF's, except the MLP's gate and up projections, one fused ``mlp.gate_up_proj`` in a view that
reshards (TP rank ``r`` holds gate rows ``r*I/tp .. (r+1)*I/tp``, then the same up rows), its bias too
(``mlp_bias=True``: ``[2, I]``); with fewer kv heads than TP ranks k and v are replicated
(:func:`family_specs`). Not translated: a tied ``lm_head.weight`` (see :mod:`smpckpt.hf`) and
``rotary_emb.inv_freq`` buffers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from smpckpt.errors import SpecError
from smpckpt.hf._common import cfg_get, check_divides, check_tp, eager_helpers, prefixed, vocab_spec
from smpckpt.model.specs import ShardSpec
from smpckpt.model.translation import Translation, stack

__all__ = ["TRANSLATION", "translate_hf_state_dict_to_smpckpt", "translate_state_dict_to_hf", "tp_specs"]
__all__ += ["BIAS_FIELDS"]

_L = "model.layers.{i}."
_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"


def make_translation(
    name: str, architecture: str, *, mlp_bias: bool = False, no_bias: Sequence[str] = ()
) -> Translation:
    """The Llama-family translation (fused gate/up; everything else keeps its HF key). ``mlp_bias``: the
    family's HF models can hold gate/up biases (Llama's ``mlp_bias``), fused as the weights are; without
    it a fused ``gate_up_proj.bias`` is refused on export (it would land under a key the HF model
    ignores), by :func:`smpckpt.model.translation.check_translates`, as are the biases of the
    projections ``no_bias`` names (``"o"``, ``"gate"``: ones the family's model never has)."""
    parts = ("weight", "bias") if mlp_bias else ("weight",)
    place = {p: "self_attn" for p in "qkvo"} | {p: "mlp" for p in ("gate", "up", "down")}
    return Translation(
        name,
        absent=tuple(_L + f"{place[p]}.{p}_proj.bias" for p in no_bias),
        rules=tuple(
            stack(_L + f"mlp.gate_up_proj.{w}", (_L + f"mlp.gate_proj.{w}", _L + f"mlp.up_proj.{w}")) for w in parts
        ),
        ignore=(_L + "self_attn.rotary_emb.inv_freq", "model.rotary_emb.inv_freq"),
        tied={_HEAD: _EMBED},
        architecture=architecture,
    )


TRANSLATION = make_translation("llama", "LlamaForCausalLM", mlp_bias=True)

#: ``LlamaConfig`` field -> the modules of each layer that have a bias when it is set (HF's names)
BIAS_FIELDS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "attention_bias": tuple(f"self_attn.{p}_proj" for p in "qkvo"),
        "mlp_bias": ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    }
)


translate_hf_state_dict_to_smpckpt, translate_state_dict_to_hf = eager_helpers(__name__, TRANSLATION)


def family_specs(model: str, tp: int, config: Any, prefix: str) -> dict[str, ShardSpec]:
    """Spec rules of the Llama family. k/v projections are split over TP when ``nkv % tp == 0``, else
    replicated (``tp % nkv == 0``). Biases, where the model has them (Qwen2's q/k/v, Llama's
    ``attention_bias`` and ``mlp_bias``), follow their weights' rows: column-parallel q/k/v and gate/up
    biases split on dim 0 (gate/up in the fused view), row-parallel o/down biases replicated (added once,
    after the all-reduce). A rule for a bias the model lacks matches nothing."""
    check_tp(tp)
    d = int(cfg_get(config, "hidden_size"))
    check_divides(model, "intermediate_size", int(cfg_get(config, "intermediate_size")), tp)
    rows = vocab_spec(model, int(cfg_get(config, "vocab_size")), tp)
    heads = int(cfg_get(config, "num_attention_heads"))
    kv_heads = int(cfg_get(config, "num_key_value_heads", default=None) or heads)
    check_divides(model, "num_attention_heads", heads, tp)
    if heads % kv_heads:
        raise SpecError(f"{model}: num_attention_heads={heads} does not divide by num_key_value_heads={kv_heads}")
    if kv_heads % tp and tp % kv_heads:
        raise SpecError(
            f"{model}: num_key_value_heads={kv_heads} and tp={tp}: kv heads must split evenly over TP ranks "
            f"(nkv % tp == 0) or every rank must use exactly one shared kv head (tp % nkv == 0)"
        )
    attn = "model.layers.*.self_attn."
    rules = {_EMBED: rows, _HEAD: rows, attn + "q_proj.weight": ShardSpec(0), attn + "q_proj.bias": ShardSpec(0)}
    if kv_heads % tp == 0:  # otherwise k/v are replicated: no rule
        rules.update({attn + f"{p}_proj.{w}": ShardSpec(0) for p in "kv" for w in ("weight", "bias")})
    rules[attn + "o_proj.weight"] = ShardSpec(1)
    rules["model.layers.*.mlp.gate_up_proj.weight"] = ShardSpec(1, view=(2, -1, d))
    rules["model.layers.*.mlp.gate_up_proj.bias"] = ShardSpec(1, view=(2, -1))
    rules["model.layers.*.mlp.down_proj.weight"] = ShardSpec(1)
    return prefixed(prefix, rules)


def tp_specs(tp: int, config: Any = None, *, prefix: str = "") -> dict[str, ShardSpec]:
    """Glob -> ShardSpec rules of our Llama under TP degree ``tp``, as :mod:`smpckpt.hf` says (``config``:
    ``hidden_size``, ``intermediate_size``, ``vocab_size``, ``num_attention_heads``, ``num_key_value_heads``;
    SpecError also when the kv heads cannot take ``tp``). ``attention_bias`` / ``mlp_bias`` models' biases
    are split as their weights' rows (:func:`family_specs`)."""
    return family_specs("llama", tp, config, prefix)

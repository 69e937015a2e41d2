"""Helpers for the BERT / RoBERTa tests: tiny real transformers masked LMs, TP sharding exactly as our specs
say, and a pure-torch reference forward of our layout that simulates TP ranks in one process.

The reference forward reads only *our* translated, per-rank local tensors and shares no code with
transformers, so logits equal to HF's prove the translated weights mean the same thing.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from hf_reference import MODULES, _vocab_embed, global_view, shard_all

__all__ = ["AUTO_CLASS", "FORWARDS", "MODULES", "PREFIXES", "global_view", "shard_all", "tiny_config", "tiny_model"]

AUTO_CLASS = {"bert": "AutoModelForMaskedLM", "roberta": "AutoModelForMaskedLM"}
#: the head models' encoder prefix and MLM head prefix of each family
PREFIXES = {"bert": ("bert.", "cls.predictions."), "roberta": ("roberta.", "lm_head.")}


def tiny_config(name: str, **overrides: Any) -> Any:
    """A tiny transformers config (no hub access). The vocabulary is odd, like RoBERTa's 50265, so
    vocab-parallel splits are uneven."""
    from transformers import BertConfig, RobertaConfig

    kw: dict[str, Any] = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_hidden_layers=2,
        intermediate_size=64,
        vocab_size=97,
        max_position_embeddings=40,
        type_vocab_size=2,
    )
    return {"bert": BertConfig, "roberta": RobertaConfig}[name](**{**kw, **overrides})


def tiny_model(
    name: str, seed: int = 0, dtype: torch.dtype = torch.float64, auto_class: str | None = None, **overrides: Any
) -> Any:
    """A real HF model of ``auto_class`` (default :data:`AUTO_CLASS`; ``"AutoModel"`` for the bare
    BertModel / RobertaModel) from :func:`tiny_config`, randomly initialised under ``seed``, in eval mode.

    Every parameter is redrawn: matrices with std 0.2 (HF's 0.02 makes attention near-uniform, which would
    hide a q/k mix-up), biases and norms around 0 and 1 (HF initialises them to constants)."""
    import transformers

    transformers.logging.set_verbosity_error()
    cls = getattr(transformers, auto_class or AUTO_CLASS[name])
    torch.manual_seed(seed)
    model = cls.from_config(tiny_config(name, **overrides), attn_implementation="eager")
    with torch.no_grad():
        for pname, param in model.named_parameters():  # tied parameters come once and stay tied
            if param.ndim >= 2:
                param.copy_(torch.randn_like(param) * 0.2)
            else:
                param.copy_(torch.randn_like(param) * 0.1 + (1.0 if "norm" in pname.lower() else 0.0))
    return model.to(dtype).eval()


# -- the reference forward (simulated TP: per-rank partial sums are all-reduced by summing) ------------


def _gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact (erf) GELU, BERT's ``hidden_act="gelu"`` and RoBERTa's LM head activation."""
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Bidirectional attention, no mask: ``[B, H, T, hd]`` each -> ``[B, T, H*hd]``."""
    out = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1) @ v
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def positions(name: str, config: Any, ids: torch.Tensor) -> torch.Tensor:
    """BERT counts from 0; RoBERTa from ``pad_token_id + 1``, padding tokens keeping ``pad_token_id``."""
    if name == "bert":
        return torch.arange(ids.shape[1]).expand_as(ids)
    pad = config.pad_token_id
    real = (ids != pad).long()
    return real.cumsum(1) * real + pad


def forward(ranks: list[dict[str, torch.Tensor]], config: Any, ids: torch.Tensor) -> torch.Tensor:
    """MLM logits ``[B, T, V]`` of our TP BERT / RoBERTa (``len(ranks)`` ranks of a head model's keys) on
    ``ids`` ``[B, T]``: eval mode, attention mask all ones, token type 0.

    Each rank runs its heads (its q/k/v rows) and its MLP columns; row-parallel partial sums are added
    (the all-reduce), then the replicated bias. The MLM decoder is vocab-parallel: each rank's logits
    for its rows, concatenated."""
    name = config.model_type
    base, head = PREFIXES[name]
    if config.hidden_act != "gelu":
        raise ValueError(f"the reference forward implements exact GELU, not {config.hidden_act!r}")
    tp, d, nh, eps = len(ranks), config.hidden_size, config.num_attention_heads, config.layer_norm_eps
    hd, R0 = d // nh, ranks[0]

    def ln(x: torch.Tensor, key: str) -> torch.Tensor:
        return F.layer_norm(x, (d,), R0[key + ".weight"], R0[key + ".bias"], eps)

    def linear(x: torch.Tensor, L: dict[str, torch.Tensor], key: str) -> torch.Tensor:
        return x @ L[key + ".weight"].T + L[key + ".bias"]

    e = base + "embeddings."
    x = (
        _vocab_embed(ids, [r[e + "word_embeddings.weight"] for r in ranks])
        + R0[e + "position_embeddings.weight"][positions(name, config, ids)]
        + R0[e + "token_type_embeddings.weight"][0]
    )
    x = ln(x, e + "LayerNorm")
    for i in range(config.num_hidden_layers):
        p = f"{base}encoder.layer.{i}."
        partial: Any = 0
        for L in ranks:
            qkv = linear(x, L, p + "attention.self.qkv")  # [B, T, 3d/tp]: q, k, v of this rank's heads
            q, k, v = (t.unflatten(-1, (nh // tp, hd)).transpose(1, 2) for t in qkv.chunk(3, -1))
            partial = partial + _attention(q, k, v) @ L[p + "attention.output.dense.weight"].T  # row-parallel
        x = ln(x + partial + R0[p + "attention.output.dense.bias"], p + "attention.output.LayerNorm")
        partial = 0
        for L in ranks:
            partial = partial + _gelu(linear(x, L, p + "intermediate.dense")) @ L[p + "output.dense.weight"].T
        x = ln(x + partial + R0[p + "output.dense.bias"], p + "output.LayerNorm")
    if name == "bert":
        x = ln(_gelu(linear(x, R0, head + "transform.dense")), head + "transform.LayerNorm")
    else:
        x = ln(_gelu(linear(x, R0, head + "dense")), head + "layer_norm")
    # the decoder: the embedding and the head's bias when tied; an untied decoder's own weight and bias
    weight = head + "decoder.weight" if head + "decoder.weight" in R0 else e + "word_embeddings.weight"
    bias = head + "decoder.bias" if head + "decoder.bias" in R0 else head + "bias"
    return torch.cat([x @ L[weight].T + L[bias] for L in ranks], -1)


FORWARDS = {"bert": forward, "roberta": forward}

"""Helpers for the GPT-J / GPT-Neo / Mistral tests: tiny real transformers causal LMs, TP sharding exactly as
our specs say, and pure-torch reference forwards of our layouts that simulate TP ranks in one process.

The reference forwards read only *our* translated, per-rank local tensors and share no code with
transformers, so logits equal to HF's prove the translated weights mean the same thing.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from hf_reference import MODULES, _gelu_new, _vocab_embed, global_view, llama_forward, shard_all

__all__ = ["AUTO_CLASS", "FORWARDS", "MODULES", "NAMES", "global_view", "shard_all", "tiny_config", "tiny_model"]

NAMES = ["gptj", "gpt_neo", "mistral"]
AUTO_CLASS = {name: "AutoModelForCausalLM" for name in NAMES}


def tiny_config(name: str, **overrides: Any) -> Any:
    """A tiny transformers config (no hub access). GPT-J's and GPT-Neo's vocabularies are odd, like the
    real 50400 / 50257 are not divisible by every TP degree, so vocab-parallel splits are uneven; GPT-Neo's
    second layer is local with a window of 4, which masks at sequence length 7."""
    from transformers import GPTJConfig, GPTNeoConfig, MistralConfig

    kw: dict[str, Any]
    if name == "gptj":
        kw = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=64, rotary_dim=4)
        return GPTJConfig(**{**kw, **overrides})
    if name == "gpt_neo":
        kw = dict(
            num_layers=2,
            hidden_size=32,
            num_heads=4,
            vocab_size=97,
            max_position_embeddings=64,
            attention_types=[[["global", "local"], 1]],
            window_size=4,
        )
        return GPTNeoConfig(**{**kw, **overrides})
    if name == "mistral":
        kw = dict(
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=2,
            vocab_size=96,
            max_position_embeddings=64,
            sliding_window=None,
        )
        return MistralConfig(**{**kw, **overrides})
    raise KeyError(name)


def tiny_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float64, **overrides: Any) -> Any:
    """A real HF causal LM from :func:`tiny_config`, randomly initialised under ``seed``, in eval mode.
    Biases and norms are randomised too (HF initialises them to constants, which would hide mix-ups)."""
    import transformers

    transformers.logging.set_verbosity_error()  # tiny vocabularies trip a bos/eos-id warning
    auto = getattr(transformers, AUTO_CLASS[name])
    torch.manual_seed(seed)
    model = auto.from_config(tiny_config(name, **overrides), attn_implementation="eager")
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if param.ndim == 1:
                param.copy_(torch.randn_like(param) * 0.1 + (1.0 if "norm" in pname or "ln_" in pname else 0.0))
    return model.to(dtype).eval()


# -- reference forwards (simulated TP: per-rank partial sums are all-reduced by summing) ---------------


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: bool, window: int | None) -> torch.Tensor:
    """``[B, H, T, hd]`` each -> ``[B, T, H*hd]``; causal, scaled by ``1/sqrt(hd)`` when ``scale``, and
    with a ``window``, key ``j`` is visible to query ``i`` only when ``i - window < j <= i``."""
    scores = q @ k.transpose(-1, -2)
    if scale:
        scores = scores / math.sqrt(q.shape[-1])
    t = q.shape[-2]
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    hidden = (j > i) if window is None else (j > i) | (i - j >= window)
    out = scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v
    return out.transpose(1, 2).reshape(q.shape[0], t, -1)


def _rotary_every_two(x: torch.Tensor, rotary_dim: int | None) -> torch.Tensor:
    """GPT-J's rotary embedding on ``[B, H, T, hd]``: feature pairs ``(2j, 2j+1)`` of the first
    ``rotary_dim`` features (all when ``None``) rotate by angle ``t / 10000^(2j/rotary_dim)``."""
    rot = rotary_dim or x.shape[-1]
    t = x.shape[-2]
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    angles = torch.arange(t, dtype=torch.float64)[:, None] * inv_freq  # [T, rot/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    pairs = x[..., :rot].unflatten(-1, (rot // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)
    return torch.cat([rotated, x[..., rot:]], -1)


def _heads(qkv: torch.Tensor, hd: int) -> list[torch.Tensor]:
    """A local fused QKV output ``[B, T, 3*h*hd]`` (q, k, v rows of this rank's heads) -> q, k, v as
    ``[B, h, T, hd]``."""
    return [t.unflatten(-1, (-1, hd)).transpose(1, 2) for t in qkv.chunk(3, -1)]


def gptj_forward(ranks: list[dict[str, torch.Tensor]], config: Any, ids: torch.Tensor) -> torch.Tensor:
    """Logits of our TP GPT-J on ``ids`` ``[B, T]``: parallel residual (attention and MLP both read
    ``ln_1(x)``), interleaved rotary on each head's first ``rotary_dim`` features, a biased
    vocab-parallel head."""
    d, nh, eps = config.n_embd, config.n_head, config.layer_norm_epsilon
    hd, R0 = d // nh, ranks[0]

    def ln(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (d,), R0[name + ".weight"], R0[name + ".bias"], eps)

    x = _vocab_embed(ids, [r["transformer.wte.weight"] for r in ranks])
    for i in range(config.n_layer):
        p = f"transformer.h.{i}."
        h = ln(x, p + "ln_1")
        partial = 0
        for L in ranks:
            q, k, v = _heads(h @ L[p + "attn.qkv_proj.weight"].T, hd)
            q, k = _rotary_every_two(q, config.rotary_dim), _rotary_every_two(k, config.rotary_dim)
            partial = partial + _attention(q, k, v, True, None) @ L[p + "attn.out_proj.weight"].T  # row-parallel
            mlp = _gelu_new(h @ L[p + "mlp.fc_in.weight"].T + L[p + "mlp.fc_in.bias"]) @ L[p + "mlp.fc_out.weight"].T
            partial = partial + mlp
        x = x + partial + R0[p + "mlp.fc_out.bias"]
    x = ln(x, "transformer.ln_f")
    head = "lm_head.weight" if "lm_head.weight" in R0 else "transformer.wte.weight"
    return torch.cat([x @ L[head].T + L["lm_head.bias"] for L in ranks], -1)


def gptneo_forward(ranks: list[dict[str, torch.Tensor]], config: Any, ids: torch.Tensor) -> torch.Tensor:
    """Logits of our TP GPT-Neo on ``ids``: unscaled attention, local layers see ``window_size`` keys
    back, learned positions, sequential residual, a (normally tied) vocab-parallel head."""
    d, nh, eps = config.hidden_size, config.num_heads, config.layer_norm_epsilon
    hd, R0 = d // nh, ranks[0]

    def ln(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (d,), R0[name + ".weight"], R0[name + ".bias"], eps)

    x = _vocab_embed(ids, [r["transformer.wte.weight"] for r in ranks]) + R0["transformer.wpe.weight"][: ids.shape[1]]
    for i, kind in enumerate(config.attention_layers):
        p, a = f"transformer.h.{i}.", f"transformer.h.{i}.attn.attention."
        window = config.window_size if kind == "local" else None
        h = ln(x, p + "ln_1")
        partial = 0
        for L in ranks:
            q, k, v = _heads(h @ L[a + "qkv_proj.weight"].T, hd)
            partial = partial + _attention(q, k, v, False, window) @ L[a + "out_proj.weight"].T
        x = x + partial + R0[a + "out_proj.bias"]
        h = ln(x, p + "ln_2")
        partial = 0
        for L in ranks:
            fc = _gelu_new(h @ L[p + "mlp.c_fc.weight"].T + L[p + "mlp.c_fc.bias"])
            partial = partial + fc @ L[p + "mlp.c_proj.weight"].T
        x = x + partial + R0[p + "mlp.c_proj.bias"]
    x = ln(x, "transformer.ln_f")
    head = "lm_head.weight" if "lm_head.weight" in R0 else "transformer.wte.weight"
    return torch.cat([x @ L[head].T for L in ranks], -1)


FORWARDS = {"gptj": gptj_forward, "gpt_neo": gptneo_forward, "mistral": llama_forward}


def forward(ranks: list[dict[str, torch.Tensor]], config: Any, ids: torch.Tensor) -> torch.Tensor:
    """The reference forward of ``config.model_type``'s family."""
    return FORWARDS[config.model_type](ranks, config, ids)

"""Translated weights mean the same thing: TP shards compute HF's outputs, and a reference forward of
our layout (simulating TP ranks in one process) reproduces HF's logits."""

from __future__ import annotations

import pytest
import torch
from hf_reference import FORWARDS, MODULES, global_view, head_dim, shard, shard_all, tiny_model

from smpckpt.model.specs import SpecRules


def _spec(name: str, key: str, tp: int, config):
    matched = SpecRules(MODULES[name].tp_specs(tp, config)).match(key)
    return None if matched is None else matched[0][0]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gpt2_qkv_shard_is_q_k_v_of_its_heads(tp):
    """Rank r's local QKV Linear outputs exactly HF c_attn's q, k and v columns of heads r*nh/tp.."""
    model = tiny_model("gpt2")
    cfg, ours = model.config, global_view("gpt2", model)
    d, w = cfg.n_embd, cfg.n_embd // tp
    x = torch.randn(2, 5, d, dtype=torch.float64)
    for layer in range(cfg.n_layer):
        attn = model.transformer.h[layer].attn
        hf = attn.c_attn(x).unflatten(-1, (3, d))  # [B, T, 3, d]: q | k | v
        key = f"transformer.h.{layer}.attn.qkv."
        for rank in range(tp):
            weight = shard(key + "weight", ours[key + "weight"], _spec("gpt2", key + "weight", tp, cfg), tp, rank)
            bias = shard(key + "bias", ours[key + "bias"], _spec("gpt2", key + "bias", tp, cfg), tp, rank)
            assert weight.shape == (3 * w, d) and bias.shape == (3 * w,)
            local = torch.nn.functional.linear(x, weight, bias).unflatten(-1, (3, w))
            torch.testing.assert_close(local, hf[..., rank * w : (rank + 1) * w], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_llama_gate_up_and_kv_shards(name, tp):
    """gate_up shard = HF gate/up features r*I/tp..; k/v shards (or replicas, nkv=2 < tp=4) = HF's heads."""
    model = tiny_model(name)
    cfg, ours = model.config, global_view(name, model)
    inter, hd, nkv = cfg.intermediate_size // tp, head_dim(cfg), cfg.num_key_value_heads
    x = torch.randn(2, 5, cfg.hidden_size, dtype=torch.float64)
    for layer in range(cfg.num_hidden_layers):
        mlp, attn = model.model.layers[layer].mlp, model.model.layers[layer].self_attn
        key = f"model.layers.{layer}.mlp.gate_up_proj.weight"
        spec = _spec(name, key, tp, cfg)
        for rank in range(tp):
            local = shard(key, ours[key], spec, tp, rank)
            assert local.shape == (2 * inter, cfg.hidden_size)
            gate, up = (x @ local.T).chunk(2, -1)
            cols = slice(rank * inter, (rank + 1) * inter)
            torch.testing.assert_close(gate, mlp.gate_proj(x)[..., cols], rtol=0, atol=1e-12)
            torch.testing.assert_close(up, mlp.up_proj(x)[..., cols], rtol=0, atol=1e-12)
        for proj in ("k_proj", "v_proj"):
            key = f"model.layers.{layer}.self_attn.{proj}.weight"
            spec = _spec(name, key, tp, cfg)
            assert (spec is None) == (nkv < tp)  # grouped-query attention with fewer kv heads than ranks
            hf = getattr(attn, proj)(x)
            for rank in range(tp):
                local = shard(key, ours[key], spec, tp, rank)
                heads = range(nkv) if spec is None else range(rank * nkv // tp, (rank + 1) * nkv // tp)
                out = x @ local.T + (
                    0
                    if name == "llama"
                    else ours[key.replace("weight", "bias")][[h * hd + j for h in heads for j in range(hd)]]
                )
                expect = torch.cat([hf[..., h * hd : (h + 1) * hd] for h in heads], -1)
                torch.testing.assert_close(out, expect, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_reference_forward_matches_hf_logits(name, tp):
    """Our layout, sharded by tp_specs and run rank by rank (all-reduce by summing), gives HF's logits.

    tp=1 is the unsharded check; tp=4 takes GPT-2's odd vocabulary split unevenly and, for Llama and
    Qwen2, replicated k/v (nkv=2 < tp)."""
    model = tiny_model(name)
    ranks = shard_all(name, global_view(name, model), tp, model.config)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(tp))
    with torch.no_grad():
        expect = model(ids).logits
        got = FORWARDS[name](ranks, model.config, ids)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


def test_reference_forward_float32_unsharded():
    """The same in float32, the dtype checkpoints usually hold (atol 1e-5)."""
    model = tiny_model("gpt2", dtype=torch.float32)
    ranks = shard_all("gpt2", global_view("gpt2", model), 1, model.config)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(FORWARDS["gpt2"](ranks, model.config, ids), model(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_llama_head_tied_or_untied(tied):
    """Tied: the head is dropped and the embedding serves as head; untied: kept and vocab-parallel."""
    model = tiny_model("llama", tie_word_embeddings=tied)
    ours = global_view("llama", model)
    assert ("lm_head.weight" in ours) is not tied
    ranks = shard_all("llama", ours, 2, model.config)
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(FORWARDS["llama"](ranks, model.config, ids), model(ids).logits, rtol=1e-5, atol=1e-5)

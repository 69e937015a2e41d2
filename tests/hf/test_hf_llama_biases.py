"""Llama with ``attention_bias`` and ``mlp_bias`` on two and four real gloo ranks: our TP=2 / TP=4 model
(biases held as Megatron holds them: q/k/v and the fused gate/up bias cut with their weights' rows, k/v
whole on every rank at TP=4 over 2 kv heads, o/down biases whole) -> a full Hugging Face artifact ->
``from_pretrained`` gives the original model's every tensor bit-exact, and the artifact loads back into
that TP and TP=1 bit-exact. Before the fused bias was translated, the artifact held ``gate_up_proj.bias``
(which transformers ignores) and no gate/up biases: ``from_pretrained`` initialised them afresh, silently;
without spec rules for the biases the q/k/v pieces were refused by the replica check (or, with
``verify_replicas=False``, rank 0's piece was saved as the whole bias)."""

from __future__ import annotations

import pytest
from dist_harness import run_world
from hf_bias_workers import biases

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("world", [2, 4])  # TP=4 over 2 kv heads: k/v (and their biases) replicated
def test_llama_biases_export_from_tp_and_import_into_tp_and_tp1(tmp_path, world: int) -> None:
    results = run_world(biases, world, str(tmp_path / "ckpt"), timeout=300)
    got = results[0]
    modules = ("mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", *(f"self_attn.{p}_proj" for p in "qkvo"))
    want = sorted(f"model.layers.0.{m}.bias" for m in modules)
    assert got["bias keys"] == want, got["bias keys"]  # the model under test has every bias
    assert got["from_pretrained"] == [], "from_pretrained differs from the original model"
    for rank, per_rank in enumerate(results):
        assert per_rank[f"into tp={world}"] == [], f"rank {rank}: artifact landed wrong in TP={world}"
        assert per_rank["into tp=1"] == [], f"rank {rank}: artifact landed wrong in TP=1"

"""Rank functions of the Llama-biases test (two or four real gloo ranks): a Llama with ``attention_bias``
and ``mlp_bias`` held as Megatron holds it under TP=2 or TP=4 (2 kv heads: k/v whole on every rank), built
here from the HF model by hand (not by ``tp_specs``, whose rules are under test): column-parallel q/k/v
weights and biases cut into row blocks, gate and up fused into one ``gate_up_proj`` whose local rows are
this rank's gate rows then the same up rows (bias alike), row-parallel o/down weights cut into column
blocks with their biases whole on every rank, vocab-parallel embedding and head."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from hf_e2e_workers import Holder
from hf_reference import tiny_config, tiny_model

import smpckpt
from smpckpt.hf import llama
from smpckpt.model.layout import ParallelLayout

SEED = 5
BIASES = dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=False)

#: HF key suffix -> the dim a column-parallel (0) or row-parallel (1) layer splits; others whole
_SPLIT = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj.weight": 1, "down_proj.weight": 1}


def megatron_shard(hf: dict[str, torch.Tensor], tp: int, rank: int, kv_heads: int = 2) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s local state of our TP=``tp`` Llama (our names: ``mlp.gate_up_proj``; ``kv_heads``:
    :func:`tiny_config`'s ``num_key_value_heads``)."""

    def block(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(tp, dim)[rank].clone()

    out: dict[str, torch.Tensor] = {}
    for key, tensor in hf.items():
        if key in ("model.embed_tokens.weight", "lm_head.weight"):
            out[key] = block(tensor, 0)
        elif ".mlp.gate_proj." in key:
            up = hf[key.replace("gate_proj", "up_proj")]
            out[key.replace("gate_proj", "gate_up_proj")] = torch.cat([block(tensor, 0), block(up, 0)])
        elif ".mlp.up_proj." in key:
            continue
        else:
            dim = next((d for part, d in _SPLIT.items() if f".{part}" in key), None)
            if kv_heads % tp and (".k_proj." in key or ".v_proj." in key):
                dim = None  # fewer kv heads than ranks: k/v whole on every rank
            out[key] = tensor.clone() if dim is None else block(tensor, dim)
    return out


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose values differ or are missing on either side (empty when all are bit-exact)."""
    return sorted(k for k in set(got) | set(want) if k not in got or k not in want or not torch.equal(got[k], want[k]))


def biases(rank: int, world: int, root: str) -> dict[str, Any]:
    import transformers

    transformers.logging.set_verbosity_error()
    model = tiny_model("llama", seed=SEED, dtype=torch.float32, **BIASES)
    hf = model.state_dict()
    layout = ParallelLayout(tp=world)
    specs = llama.tp_specs(world, model.config)
    mine = megatron_shard(hf, world, rank)
    common: dict[str, Any] = dict(layout=layout, specs=specs, translate_function=llama.TRANSLATION)
    smpckpt.save_checkpoint(
        root, "full", partial=False, model=Holder(mine), hf_config=tiny_config("llama", **BIASES), **common
    )

    out: dict[str, Any] = {}
    for tp in (world, 1):  # the artifact back into our TP=2 layout, and into TP=1 (each rank the whole model)
        want = megatron_shard(hf, tp, rank % tp)
        back = Holder({k: torch.full_like(v, -3.0) for k, v in want.items()})
        kw = dict(common, layout=ParallelLayout(tp=tp, dp=world // tp), specs=llama.tp_specs(tp, model.config))
        smpckpt.resume_from_checkpoint(os.path.join(root, "full"), partial=False, model=back, **kw)
        out[f"into tp={tp}"] = _same(dict(back.named_parameters()), want)
    dist.barrier()
    if rank == 0:
        folder = os.path.join(root, "full")
        again = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
        out["from_pretrained"] = _same(again.state_dict(), hf)
        out["bias keys"] = sorted(k for k in hf if k.startswith("model.layers.0.") and k.endswith(".bias"))
    return out

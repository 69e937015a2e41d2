"""The benchmarks' GPT-like state: its tensors (:class:`TDef`), their TP specs, the global tensors
(seeded, so every rank and every check rebuilds them alike) and each TP rank's piece, plus a check of
a full artifact against those global tensors with the reference ``safetensors`` reader."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from smpckpt import ShardSpec

__all__ = [
    "TDef",
    "model_defs",
    "model_specs",
    "LLAMA7B",
    "llama7b_defs",
    "llama7b_specs",
    "global_tensor",
    "local_piece",
    "check_safetensors",
]


@dataclasses.dataclass(frozen=True)
class TDef:
    key: str  #: key inside state["model"]
    shape: tuple[int, ...]  #: global shape
    kind: str  #: repl | row (split dim 0) | col (split dim 1) | fused (qkv, view (3, -1, h), dim 1)
    dtype: torch.dtype = torch.float32


def model_defs(hidden: int, layers: int, vocab: int) -> list[TDef]:
    h = hidden
    defs = [TDef("embed.weight", (vocab, h), "row")]
    for i in range(layers):
        p = f"layers.{i}."
        defs += [
            TDef(p + "ln1.weight", (h,), "repl"),
            TDef(p + "ln1.bias", (h,), "repl"),
            TDef(p + "attn.qkv.weight", (3 * h, h), "fused"),
            TDef(p + "attn.proj.weight", (h, h), "col"),
            TDef(p + "ln2.weight", (h,), "repl"),
            TDef(p + "ln2.bias", (h,), "repl"),
            TDef(p + "mlp.up.weight", (4 * h, h), "row"),
            TDef(p + "mlp.down.weight", (h, 4 * h), "col"),
        ]
    defs += [TDef("final_ln.weight", (h,), "repl"), TDef("final_ln.bias", (h,), "repl")]
    return defs


#: Llama-2-7B's real tensor shapes (hidden 4096, MLP 11008, vocab 32000): every weight matrix is past
#: 2**24 elements, where float index arithmetic fails first; the GPT-like state above has none.
LLAMA7B = {"hidden": 4096, "inter": 11008, "vocab": 32000}


def llama7b_defs(layers: int, dtype: torch.dtype = torch.bfloat16) -> list[TDef]:
    """Llama-7B's tensors with ``layers`` decoder layers (the real model has 32), Megatron TP splits."""
    h, f, v = LLAMA7B["hidden"], LLAMA7B["inter"], LLAMA7B["vocab"]
    defs = [TDef("embed_tokens.weight", (v, h), "row", dtype)]
    for i in range(layers):
        p = f"layers.{i}."
        defs += [TDef(p + f"self_attn.{x}_proj.weight", (h, h), "row", dtype) for x in "qkv"]
        defs += [
            TDef(p + "self_attn.o_proj.weight", (h, h), "col", dtype),
            TDef(p + "mlp.gate_proj.weight", (f, h), "row", dtype),
            TDef(p + "mlp.up_proj.weight", (f, h), "row", dtype),
            TDef(p + "mlp.down_proj.weight", (h, f), "col", dtype),
            TDef(p + "input_layernorm.weight", (h,), "repl", dtype),
            TDef(p + "post_attention_layernorm.weight", (h,), "repl", dtype),
        ]
    return defs + [TDef("norm.weight", (h,), "repl", dtype), TDef("lm_head.weight", (v, h), "row", dtype)]


def llama7b_specs() -> dict[str, ShardSpec]:
    return {
        "model.embed_tokens.weight": ShardSpec(0),
        "model.lm_head.weight": ShardSpec(0),
        "model.layers.*.self_attn.[qkv]_proj.weight": ShardSpec(0),
        "model.layers.*.self_attn.o_proj.weight": ShardSpec(1),
        "model.layers.*.mlp.gate_proj.weight": ShardSpec(0),
        "model.layers.*.mlp.up_proj.weight": ShardSpec(0),
        "model.layers.*.mlp.down_proj.weight": ShardSpec(1),
    }


def model_specs(hidden: int) -> dict[str, ShardSpec]:
    return {
        "model.embed.weight": ShardSpec(0),
        "model.layers.*.attn.qkv.weight": ShardSpec(1, view=(3, -1, hidden)),
        "model.layers.*.attn.proj.weight": ShardSpec(1),
        "model.layers.*.mlp.up.weight": ShardSpec(0),
        "model.layers.*.mlp.down.weight": ShardSpec(1),
    }


def global_tensor(j: int, d: TDef) -> torch.Tensor:
    return torch.randn(d.shape, generator=torch.Generator().manual_seed(1000 + j)).to(d.dtype)


def local_piece(d: TDef, g: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's shard of global tensor ``g``, as the rank's state dict holds it."""
    if d.kind == "repl":
        return g.clone()
    if d.kind == "fused":  # [3h, h] -> view [3, h, h], split the middle dim, stored as [3h/tp, h]
        h = d.shape[1]
        v = g.view(3, -1, h)
        n = v.shape[1] // tp
        return v[:, tp_rank * n : (tp_rank + 1) * n].clone(memory_format=torch.contiguous_format).view(-1, h)
    dim = 0 if d.kind == "row" else 1
    n = d.shape[dim] // tp
    return g.narrow(dim, tp_rank * n, n).clone(memory_format=torch.contiguous_format)


def check_safetensors(path: str, defs: list[TDef]) -> str:
    """Warm-up only: open the full artifact with the reference safetensors reader, compare every tensor."""
    try:
        from safetensors import safe_open
    except ImportError:
        return "skipped (safetensors not installed)"
    found: dict[str, Any] = {}
    names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    for n in names:
        with safe_open(os.path.join(path, n), "pt") as f:
            for k in f.keys():
                found[k] = (n, f.get_slice(k).get_shape())
    for j, d in enumerate(defs):
        key = f"model.{d.key}"
        if key not in found:
            return f"FAILED: {key} missing (keys: {sorted(found)[:4]}...)"
        with safe_open(os.path.join(path, found[key][0]), "pt") as f:
            t = f.get_tensor(key)
        if not torch.equal(t.reshape(d.shape), global_tensor(j, d)):
            return f"FAILED: {key} differs"
    return f"ok: {len(defs)} tensors in {len(names)} file(s) equal the global tensors (safetensors {names[0]})"

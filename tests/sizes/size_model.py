"""A state at a real model's sizes: a Llama-7B embedding (32000 x 4096, fp32: 131 M elements, 500 MiB)
and an MLP weight (11008 x 4096, bf16: 45 M elements). Both are past 2**24 elements, where float32 can
no longer count every element (index arithmetic done in float goes wrong there first).

Values come from a seeded generator without the modules' own initialisation (it would double the
time), so every process builds the same global tensors and a TP rank keeps its rows."""

from __future__ import annotations

import torch
from torch import nn

from smpckpt import ShardSpec

VOCAB, HIDDEN, INTER = 32000, 4096, 11008
#: vocab-parallel embedding and a column-parallel MLP weight, as Megatron splits them
SPECS = {"emb.weight": ShardSpec(dim=0), "up.weight": ShardSpec(dim=0)}


class Big(nn.Module):
    """Both tensors, or (``embedding=False``) the MLP weight alone: 86 MiB for the paths whose cost is
    per byte and high (S3 through a CPU-bound loopback server, several ranks on a 2-core machine)."""

    def __init__(self, tp: int = 1, tp_rank: int = 0, seed: int = 0, embedding: bool = True) -> None:
        super().__init__()
        if embedding:
            self.emb = nn.utils.skip_init(nn.Embedding, VOCAB // tp, HIDDEN)
        self.up = nn.utils.skip_init(nn.Linear, HIDDEN, INTER // tp, bias=False, dtype=torch.bfloat16)
        full = global_tensors(seed, embedding)
        with torch.no_grad():
            for name, p in self.named_parameters():
                n = p.shape[0]
                p.copy_(full[name][tp_rank * n : (tp_rank + 1) * n])


def global_tensors(seed: int, embedding: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    emb = {"emb.weight": torch.randn(VOCAB, HIDDEN, generator=g)} if embedding else {}
    return {**emb, "up.weight": torch.randn(INTER, HIDDEN, generator=g).to(torch.bfloat16)}


def same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)

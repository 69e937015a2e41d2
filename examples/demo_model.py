"""A tiny GPT with Megatron-style plain local shards (TP x PP x DP on gloo/CPU), for tests and the demo.

Every rank builds the *full* weights from the seed and keeps its own slice, so the global model is the
same under any layout and a single-process run (``tp=pp=dp=1``, no process group) is the reference.

Sharding (global shapes; ``h`` = attention width, ``f`` = MLP width, ``V`` = vocabulary):

====================  ===============  ==========================================================
parameter             global shape     local piece on TP rank ``r``
====================  ===============  ==========================================================
embed.weight          ``[V, d]``       rows of the vocabulary (vocab-parallel, uneven splits)
attn.qkv.weight       ``[3h, d]``      fused ``[q_r; k_r; v_r]`` = ``[3h/tp, d]``, viewed ``[3, h/tp, d]``
attn.qkv.bias         ``[3h]``         ``[3h/tp]``, viewed ``[3, h/tp]``
attn.proj.weight      ``[d, h]``       columns (row-parallel linear); its bias is replicated
mlp.fc1.weight/bias   ``[f, d]``, [f]  rows (column-parallel linear)
mlp.fc2.weight        ``[d, f]``       columns (row-parallel linear); its bias is replicated
head.weight           ``[V, d]``       rows of the vocabulary; logits are all-gathered
layernorms            replicated
====================  ===============  ==========================================================

Pipeline stages hold consecutive layers (``layout.pp_layers``), stage-local names ``layers.<i>``; the
first stage also holds ``embed``, the last ``norm`` and ``head``. Activations and their gradients move
between stages with gloo send/recv, one micro-batch per step. Data parallel replicas average
gradients with an all-reduce over their DP group.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from tp_layers import (  # noqa: F401 - re-exported: tests import the TP ops and context from here
    ParallelContext,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    _copy_to_tp,
    _CopyToTP,
    _GatherFromTP,
    _param,
    _reduce_from_tp,
    _ReduceFromTP,
    build_context,
)

from smpckpt.errors import SpecError
from smpckpt.model.layout import ParallelLayout
from smpckpt.model.specs import ShardSpec

__all__ = [
    "GPTConfig",
    "ParallelContext",
    "GPTStage",
    "make_layout",
    "build_context",
    "build_model",
    "build_optimizer",
    "model_specs",
    "vocab_sizes",
    "full_weights",
    "global_shapes",
    "local_shard",
    "global_from_shards",
    "checkpoint_shape",
    "make_batch",
    "train_step",
    "pipeline_logits",
    "gather_global_state",
    "compare_states",
    "checkpoint_state",
    "save_checkpoint",
    "load_checkpoint",
    "storage_writer",
    "storage_reader",
    "OPTIM_OPTIONS",
]

#: FQN-keyed, flattened optimizer state (``optim.state.<param>.exp_avg``), so PP renaming and spec
#: inheritance work on optimizer keys.
OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


# -- storage: the one place to switch the demo and tests to another StorageWriter/Reader ------------
def storage_writer(path: str) -> dcp.StorageWriter:
    """The storage writer every demo/test save uses: smpckpt's raw, checksummed, committed format."""
    from smpckpt.storage import FsspecStorageWriter

    return FsspecStorageWriter(path, overwrite=True)


def storage_reader(path: str) -> dcp.StorageReader:
    """The storage reader every demo/test load uses (verifies every block it reads)."""
    from smpckpt.storage import FsspecStorageReader

    return FsspecStorageReader(path)


# -- configuration --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 62  #: not a multiple of 4: TP=4 splits it unevenly (16, 16, 15, 15)
    d_model: int = 32
    n_heads: int = 4
    attn_width: int = 32  #: ``h``, the fused QKV holds ``3h`` rows
    d_ff: int = 64
    n_layers: int = 4
    seq_len: int = 8
    batch: int = 8  #: global batch, split over DP replicas
    lr: float = 1e-2
    seed: int = 1234

    def check_tp(self, tp: int) -> None:
        for name, value in (("n_heads", self.n_heads), ("attn_width", self.attn_width), ("d_ff", self.d_ff)):
            if value % tp:
                raise SpecError(f"GPTConfig.{name}={value} does not divide by tp={tp}")
        if self.vocab < tp:
            raise SpecError(f"vocab {self.vocab} is smaller than tp={tp}")


def make_layout(cfg: GPTConfig, tp: int = 1, pp: int = 1, dp: int = 1) -> ParallelLayout:
    """A layout for ``cfg`` with an even PP partition recorded (earlier stages take the remainder)."""
    if pp > cfg.n_layers:
        raise SpecError(f"pp={pp} exceeds n_layers={cfg.n_layers}")
    base, extra = divmod(cfg.n_layers, pp)
    return ParallelLayout(tp=tp, pp=pp, dp=dp, pp_layers=tuple(base + (s < extra) for s in range(pp)))


def vocab_sizes(vocab: int, tp: int) -> tuple[int, ...]:
    """Near-even vocabulary split: the first ``vocab % tp`` TP ranks hold one extra row."""
    base, extra = divmod(vocab, tp)
    return tuple(base + (r < extra) for r in range(tp))


def model_specs(cfg: GPTConfig, layout: ParallelLayout) -> dict[str, ShardSpec]:
    """Glob -> ShardSpec rules for :class:`GPTStage` under ``layout`` (keys as ``{"model": ...}``)."""
    vocab = ShardSpec(dim=0, sizes=vocab_sizes(cfg.vocab, layout.tp))
    return {
        "model.embed.weight": vocab,
        "model.head.weight": vocab,
        "model.layers.*.attn.qkv.weight": ShardSpec(dim=1, view=(3, -1, cfg.d_model)),
        "model.layers.*.attn.qkv.bias": ShardSpec(dim=1, view=(3, -1)),
        "model.layers.*.attn.proj.weight": ShardSpec(dim=1),
        "model.layers.*.mlp.fc1.weight": ShardSpec(dim=0),
        "model.layers.*.mlp.fc1.bias": ShardSpec(dim=0),
        "model.layers.*.mlp.fc2.weight": ShardSpec(dim=1),
    }


# -- global weights and their slicing (the model's own ground truth, independent of the planners) ---
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")


def _kind(name: str) -> str:
    """``layers.3.attn.qkv.weight`` -> ``attn.qkv.weight``; other names unchanged."""
    match = _LAYER_KEY.match(name)
    return match.group(2) if match else name


def _split_rule(cfg: GPTConfig, name: str) -> tuple[int, tuple[int, ...] | None] | None:
    """``(dim, global view)`` of a TP-sharded parameter (by global name), ``None`` if replicated."""
    rules: dict[str, tuple[int, tuple[int, ...] | None]] = {
        "embed.weight": (0, None),
        "head.weight": (0, None),
        "attn.qkv.weight": (1, (3, cfg.attn_width, cfg.d_model)),
        "attn.qkv.bias": (1, (3, cfg.attn_width)),
        "attn.proj.weight": (1, None),
        "mlp.fc1.weight": (0, None),
        "mlp.fc1.bias": (0, None),
        "mlp.fc2.weight": (1, None),
    }
    return rules.get(_kind(name))


def _extents(cfg: GPTConfig, name: str, extent: int, tp: int) -> tuple[int, ...]:
    if _kind(name) in ("embed.weight", "head.weight"):
        return vocab_sizes(cfg.vocab, tp)
    if extent % tp:
        raise SpecError(f"{name}: extent {extent} does not divide by tp={tp}")
    return (extent // tp,) * tp


def _layer_names(prefix: str, d: int, h: int, f: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    yield f"{prefix}ln1.weight", (d,)
    yield f"{prefix}ln1.bias", (d,)
    yield f"{prefix}attn.qkv.weight", (3 * h, d)
    yield f"{prefix}attn.qkv.bias", (3 * h,)
    yield f"{prefix}attn.proj.weight", (d, h)
    yield f"{prefix}attn.proj.bias", (d,)
    yield f"{prefix}ln2.weight", (d,)
    yield f"{prefix}ln2.bias", (d,)
    yield f"{prefix}mlp.fc1.weight", (f, d)
    yield f"{prefix}mlp.fc1.bias", (f,)
    yield f"{prefix}mlp.fc2.weight", (d, f)
    yield f"{prefix}mlp.fc2.bias", (d,)


def global_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Global parameter names (single-process model) and shapes, in creation order."""
    d, h, f = cfg.d_model, cfg.attn_width, cfg.d_ff
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (cfg.vocab, d)}
    for i in range(cfg.n_layers):
        shapes.update(_layer_names(f"layers.{i}.", d, h, f))
    shapes["norm.weight"] = (d,)
    shapes["norm.bias"] = (d,)
    shapes["head.weight"] = (cfg.vocab, d)
    return shapes


def full_weights(cfg: GPTConfig, seed: int | None = None) -> dict[str, torch.Tensor]:
    """The global weights for ``seed`` (default ``cfg.seed``): identical on every rank and layout.

    Every value is random (biases and layernorms too), so a misplaced shard cannot go unnoticed.
    """
    gen = torch.Generator().manual_seed(cfg.seed if seed is None else seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in global_shapes(cfg).items():
        noise = torch.randn(shape, generator=gen)
        if name.endswith(("ln1.weight", "ln2.weight", "norm.weight")):
            weights[name] = 1.0 + 0.1 * noise
        elif len(shape) == 1:
            weights[name] = 0.05 * noise
        else:
            weights[name] = noise / math.sqrt(shape[-1])
    return weights


def checkpoint_shape(cfg: GPTConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (global, natural shape) viewed as the checkpoint stores it (fused QKV as ``[3, h, ...]``)."""
    rule = _split_rule(cfg, name)
    if rule is None or rule[1] is None:
        return tensor
    return tensor.reshape(rule[1])


def local_shard(cfg: GPTConfig, name: str, full: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s piece of the global tensor ``full`` of parameter ``name`` (global name)."""
    rule = _split_rule(cfg, name)
    if rule is None:
        return full.clone()
    dim, view = rule
    viewed = full.reshape(view) if view is not None else full
    sizes = _extents(cfg, name, viewed.shape[dim], tp)
    piece = viewed.narrow(dim, sum(sizes[:tp_rank]), sizes[tp_rank])
    if view is None:
        return piece.clone()
    return piece.reshape(-1, *full.shape[1:]).clone()


def global_from_shards(cfg: GPTConfig, name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`local_shard`: the global tensor from every TP rank's piece, in TP order."""
    rule = _split_rule(cfg, name)
    if rule is None:
        return shards[0].clone()
    dim, view = rule
    if view is None:
        return torch.cat(shards, dim=dim)
    pieces = [s.reshape(*view[:dim], -1, *view[dim + 1 :]) for s in shards]
    return torch.cat(pieces, dim=dim).reshape(-1, *view[2:])


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, tp: int, group: Any) -> None:
        super().__init__()
        self.group = group
        self.heads = cfg.n_heads // tp
        self.width = cfg.attn_width // tp
        self.qkv = nn.Linear(cfg.d_model, 3 * self.width)  # column-parallel: [q_r; k_r; v_r]
        self.proj = RowParallelLinear(self.width, cfg.d_model, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(_copy_to_tp(x, self.group)).split(self.width, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, t, self.width))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, tp: int, group: Any) -> None:
        super().__init__()
        self.group = group
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff // tp)  # column-parallel
        self.fc2 = RowParallelLinear(cfg.d_ff // tp, cfg.d_model, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(_copy_to_tp(x, self.group))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, tp: int, group: Any) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg, tp, group)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg, tp, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPTStage(nn.Module):
    """One pipeline stage on one TP rank: ``embed`` (first stage), its layers, ``norm``+``head`` (last)."""

    def __init__(self, cfg: GPTConfig, ctx: ParallelContext) -> None:
        super().__init__()
        layout, tp_rank = ctx.layout, ctx.coords.tp
        cfg.check_tp(layout.tp)
        sizes = vocab_sizes(cfg.vocab, layout.tp)
        self.embed = VocabParallelEmbedding(sizes, tp_rank, cfg.d_model, ctx.tp_group) if ctx.first_stage else None
        n_local = layout.pp_layers[ctx.coords.pp] if layout.pp_layers is not None else cfg.n_layers
        self.layers = nn.ModuleList(Block(cfg, layout.tp, ctx.tp_group) for _ in range(n_local))
        self.norm = nn.LayerNorm(cfg.d_model) if ctx.last_stage else None
        self.head = VocabParallelHead(sizes, tp_rank, cfg.d_model, ctx.tp_group) if ctx.last_stage else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or activations in; activations or full logits (last stage) out."""
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        if self.norm is not None and self.head is not None:
            x = self.head(self.norm(x))
        return x


def _global_name(ctx: ParallelContext, local: str) -> str:
    match = _LAYER_KEY.match(local)
    if match is None:
        return local
    return f"layers.{int(match.group(1)) + ctx.layout.layer_offset(ctx.coords.pp)}.{match.group(2)}"


def build_model(cfg: GPTConfig, ctx: ParallelContext, seed: int | None = None) -> GPTStage:
    """This rank's stage, initialised with its slice of :func:`full_weights` for ``seed``."""
    torch.manual_seed(0)  # module constructors draw from the global RNG; keep it out of the picture
    if ctx.layout.pp_layers is not None and sum(ctx.layout.pp_layers) != cfg.n_layers:
        raise SpecError(f"pp_layers {ctx.layout.pp_layers} does not add up to n_layers={cfg.n_layers}")
    stage = GPTStage(cfg, ctx)
    full = full_weights(cfg, seed)
    local = {
        name: local_shard(cfg, _global_name(ctx, name), full[_global_name(ctx, name)], ctx.coords.tp, ctx.layout.tp)
        for name, _ in stage.named_parameters()
    }
    stage.load_state_dict(local, strict=True)
    return stage


def build_optimizer(cfg: GPTConfig, stage: GPTStage, lr: float | None = None) -> torch.optim.Adam:
    return torch.optim.Adam(stage.parameters(), lr=cfg.lr if lr is None else lr)


# -- data, training, inference ---------------------------------------------------------------------
def make_batch(cfg: GPTConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ``(tokens, targets)``, each ``[batch, seq_len]``."""
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + step)
    data = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq_len + 1), generator=gen)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def _dp_slice(ctx: ParallelContext, batch: torch.Tensor) -> torch.Tensor:
    dp, dp_rank = ctx.layout.dp, ctx.coords.dp
    if batch.shape[0] % dp:
        raise SpecError(f"batch {batch.shape[0]} does not divide by dp={dp}")
    n = batch.shape[0] // dp
    return batch[dp_rank * n : (dp_rank + 1) * n]


def _recv(ctx: ParallelContext, shape: tuple[int, ...], peer: int) -> torch.Tensor:
    buf = torch.empty(shape)
    dist.recv(buf, src=peer)
    return buf


def _stage_forward(
    stage: GPTStage, ctx: ParallelContext, tokens: torch.Tensor, d_model: int, *, grad: bool
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Run this stage: ``(received input or None, output)``; non-last stages send their output on."""
    inp: torch.Tensor | None = None
    if ctx.first_stage:
        x = tokens
    else:
        inp = _recv(ctx, (*tokens.shape, d_model), ctx.stage_peer(-1)).requires_grad_(grad)
        x = inp
    out = stage(x)
    if not ctx.last_stage:
        dist.send(out.detach().contiguous(), dst=ctx.stage_peer(+1))
    return inp, out


def train_step(cfg: GPTConfig, stage: GPTStage, optim: torch.optim.Optimizer, ctx: ParallelContext, step: int) -> float:
    """One optimizer step on global batch ``step``; returns the global mean loss on every rank."""
    tokens, targets = (_dp_slice(ctx, t) for t in make_batch(cfg, step))
    optim.zero_grad(set_to_none=True)
    inp, out = _stage_forward(stage, ctx, tokens, cfg.d_model, grad=True)
    loss = torch.zeros(())
    if ctx.last_stage:
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))
        loss.backward()
    else:
        out.backward(_recv(ctx, tuple(out.shape), ctx.stage_peer(+1)))
    if inp is not None:
        if inp.grad is None:
            raise RuntimeError("pipeline stage input received no gradient")
        dist.send(inp.grad.contiguous(), dst=ctx.stage_peer(-1))
    if ctx.dp_group is not None:
        for p in stage.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=ctx.dp_group)
                p.grad.div_(ctx.layout.dp)
    optim.step()
    return _global_loss(ctx, loss.detach())


def _global_loss(ctx: ParallelContext, loss: torch.Tensor) -> float:
    if not ctx.distributed:
        return float(loss)
    owner = ctx.last_stage and ctx.coords.tp == 0
    total = loss.clone() if owner else torch.zeros(())
    dist.all_reduce(total)
    return float(total) / ctx.layout.dp


@torch.no_grad()
def pipeline_logits(cfg: GPTConfig, stage: GPTStage, ctx: ParallelContext, tokens: torch.Tensor) -> torch.Tensor:
    """Full logits for ``tokens`` (the same batch on every DP replica), returned on every rank."""
    _, out = _stage_forward(stage, ctx, tokens, cfg.d_model, grad=False)
    if not ctx.distributed:
        return out
    logits = out.contiguous() if ctx.last_stage else torch.empty(*tokens.shape, cfg.vocab)
    dist.broadcast(logits, src=ctx.layout.rank_of(pp=ctx.layout.pp - 1))
    return logits


# -- checkpointing ---------------------------------------------------------------------------------
def checkpoint_state(stage: GPTStage, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` with FQN-keyed, flattened optimizer state (initialised if empty)."""
    return {"model": stage.state_dict(), "optim": get_optimizer_state_dict(stage, optim, options=OPTIM_OPTIONS)}


def save_checkpoint(
    cfg: GPTConfig, stage: GPTStage, optim: torch.optim.Optimizer, ctx: ParallelContext, path: str
) -> None:
    """``dcp.save`` this rank's shards with :class:`~smpckpt.planners.ParallelSavePlanner`."""
    from smpckpt.planners import ParallelSavePlanner

    planner = ParallelSavePlanner(ctx.layout, model_specs(cfg, ctx.layout), rank=ctx.rank)
    dcp.save(checkpoint_state(stage, optim), storage_writer=storage_writer(path), planner=planner)


def load_checkpoint(
    cfg: GPTConfig, stage: GPTStage, optim: torch.optim.Optimizer, ctx: ParallelContext, path: str
) -> None:
    """``dcp.load`` into this rank's shards (resharding as needed), then into the optimizer."""
    from smpckpt.planners import ParallelLoadPlanner

    state = checkpoint_state(stage, optim)
    planner = ParallelLoadPlanner(ctx.layout, model_specs(cfg, ctx.layout), rank=ctx.rank)
    dcp.load(state, storage_reader=storage_reader(path), planner=planner)
    stage.load_state_dict(state["model"], strict=True)
    set_optimizer_state_dict(stage, optim, state["optim"], options=OPTIM_OPTIONS)


# at the end: demo_compare builds on the definitions above
from demo_compare import compare_states, gather_global_state  # noqa: E402, F401 - re-exported for the demo and tests

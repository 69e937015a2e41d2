"""Generate sharded worlds for reshard property tests: global tensors, layouts, per-rank state dicts.

A *model* is a list of :class:`TensorDef` (global shape, dtype, how it is split, which pipeline stages
hold it). For any :class:`~smpckpt.ParallelLayout` and uneven partition, :func:`rank_state` slices the
global tensors into one rank's state dict plus its spec rules -- the oracle every load is compared to.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from hypothesis import strategies as st

from smpckpt import ParallelLayout, ShardSpec

DTYPES = (torch.float32, torch.bfloat16, torch.int64)
KINDS = ("repl", "tp", "fused", "dp", "tpdp")
SENTINEL = -7


@dataclasses.dataclass(frozen=True)
class TensorDef:
    name: str  #: key suffix: "model.<name>" or, for layer tensors, "model.layers.<i>.<name>"
    shape: tuple[int, ...]  #: global shape (the view shape for fused)
    dtype: torch.dtype
    kind: str
    dim: int = 0  #: sharded dim (tp, or dp for kind dp)
    dp_dim: int = 1  #: dp dim for tpdp
    uneven: bool = False
    where: str = "layer"  #: layer | first | last | all


@dataclasses.dataclass(frozen=True)
class Model:
    defs: tuple[TensorDef, ...]
    layers: int
    seed: int


def global_keys(model: Model) -> list[tuple[str, TensorDef]]:
    out = []
    for d in model.defs:
        if d.where == "layer":
            out += [(f"model.layers.{g}.{d.name}", d) for g in range(model.layers)]
        else:
            out.append((f"model.{d.name}", d))
    return out


def global_values(model: Model) -> dict[str, torch.Tensor]:
    """Every global tensor (params, then exp_avg and step of each), from the model's seed."""
    gen = torch.Generator().manual_seed(model.seed)
    values: dict[str, torch.Tensor] = {}
    for key, d in global_keys(model):
        for suffix in ("", ".exp_avg"):
            if d.dtype == torch.int64:
                t = torch.randint(0, 1000, d.shape, generator=gen, dtype=torch.int64)
            else:
                t = torch.randn(d.shape, generator=gen).to(d.dtype)
            values[key + suffix] = t
        values[key + ".step"] = torch.tensor(float(len(values)))
    return values


@st.composite
def tensor_defs(draw: Any, index: int) -> TensorDef:
    kind = draw(st.sampled_from(KINDS))
    dtype = draw(st.sampled_from(DTYPES))
    where = draw(st.sampled_from(("layer", "layer", "first", "last", "all")))
    uneven = draw(st.booleans())
    if kind == "fused":
        shape = (3, draw(st.integers(1, 9)), draw(st.integers(1, 4)))
        return TensorDef(f"w{index}", shape, dtype, kind, dim=1, uneven=uneven, where=where)
    ndim = draw(st.integers(2 if kind == "tpdp" else 1, 3))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(ndim))
    dim = draw(st.integers(0, ndim - 1))
    dp_dim = (dim + 1) % ndim
    return TensorDef(f"w{index}", shape, dtype, kind, dim=dim, dp_dim=dp_dim, uneven=uneven, where=where)


@st.composite
def models(draw: Any) -> Model:
    n = draw(st.integers(1, 4))
    defs = tuple(draw(tensor_defs(i)) for i in range(n))
    return Model(defs, layers=draw(st.integers(4, 6)), seed=draw(st.integers(0, 2**16)))


@st.composite
def layouts(draw: Any, layers: int, max_world: int) -> ParallelLayout:
    while True:
        tp, pp, dp = draw(st.integers(1, 8)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
        if tp * pp * dp <= max_world:
            break
    cuts = sorted(draw(st.lists(st.integers(0, layers), min_size=pp - 1, max_size=pp - 1)))
    bounds = [0, *cuts, layers]
    return ParallelLayout(tp=tp, pp=pp, dp=dp, pp_layers=tuple(b - a for a, b in zip(bounds, bounds[1:])))


def split(extent: int, parts: int, draw: Any | None, uneven: bool) -> tuple[int, ...] | None:
    """Sizes of each rank's piece; None for an even split."""
    if not uneven and extent % parts == 0:
        return None
    if draw is None:
        base, extra = divmod(extent, parts)
        return tuple(base + (1 if i < extra else 0) for i in range(parts))
    cuts = sorted(draw(st.lists(st.integers(0, extent), min_size=parts - 1, max_size=parts - 1)))
    bounds = [0, *cuts, extent]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


Partition = Mapping[tuple[str, str], tuple[int, ...] | None]


def draw_partition(
    model: Model, layout: ParallelLayout, draw: Any | None
) -> dict[tuple[str, str], tuple[int, ...] | None]:
    parts: dict[tuple[str, str], tuple[int, ...] | None] = {}
    for d in model.defs:
        if d.kind in ("tp", "fused", "tpdp"):
            parts[(d.name, "tp")] = split(d.shape[d.dim], layout.tp, draw, d.uneven)
        if d.kind == "dp":
            parts[(d.name, "dp")] = split(d.shape[d.dim], layout.dp, draw, d.uneven)
        if d.kind == "tpdp":
            parts[(d.name, "dp")] = split(d.shape[d.dp_dim], layout.dp, draw, d.uneven)
    return parts


def _piece(sizes: tuple[int, ...] | None, extent: int, degree: int, r: int) -> tuple[int, int]:
    if sizes is None:
        step = extent // degree
        return r * step, step
    return sum(sizes[:r]), sizes[r]


def specs_for(model: Model, parts: Partition) -> dict[str, Any]:
    specs: dict[str, Any] = {}
    for d in model.defs:
        pattern = f"model.layers.*.{d.name}" if d.where == "layer" else f"model.{d.name}"
        if d.kind == "tp":
            specs[pattern] = ShardSpec(d.dim, "tp", sizes=parts[(d.name, "tp")])
        elif d.kind == "fused":
            specs[pattern] = ShardSpec(1, "tp", view=(3, -1, d.shape[2]), sizes=parts[(d.name, "tp")])
        elif d.kind == "dp":
            specs[pattern] = ShardSpec(d.dim, "dp", sizes=parts[(d.name, "dp")])
        elif d.kind == "tpdp":
            specs[pattern] = (
                ShardSpec(d.dim, "tp", sizes=parts[(d.name, "tp")]),
                ShardSpec(d.dp_dim, "dp", sizes=parts[(d.name, "dp")]),
            )
    return specs


def local_piece(d: TensorDef, value: torch.Tensor, layout: ParallelLayout, rank: int, parts: Partition) -> torch.Tensor:
    c = layout.coords(rank)
    piece = value
    cuts = []
    if d.kind in ("tp", "fused", "tpdp"):
        cuts.append((d.dim, _piece(parts[(d.name, "tp")], d.shape[d.dim], layout.tp, c.tp)))
    if d.kind == "dp":
        cuts.append((d.dim, _piece(parts[(d.name, "dp")], d.shape[d.dim], layout.dp, c.dp)))
    if d.kind == "tpdp":
        cuts.append((d.dp_dim, _piece(parts[(d.name, "dp")], d.shape[d.dp_dim], layout.dp, c.dp)))
    for dim, (start, length) in cuts:
        piece = piece.narrow(dim, start, length)
    piece = piece.contiguous().clone()
    if d.kind == "fused":
        piece = piece.reshape(-1, d.shape[2])
    return piece


def _holds(d: TensorDef, layout: ParallelLayout, stage: int) -> bool:
    return (
        d.where in ("layer", "all")
        or (d.where == "first" and stage == 0)
        or (d.where == "last" and stage == layout.pp - 1)
    )


def rank_state(
    model: Model,
    values: Mapping[str, torch.Tensor],
    layout: ParallelLayout,
    rank: int,
    parts: Partition,
    *,
    blank: bool = False,
    rank_local: bool = False,
) -> dict[str, Any]:
    """One rank's nested state dict (stage-local layer names); ``blank`` fills tensors with SENTINEL."""
    stage = layout.coords(rank).pp
    first = layout.layer_offset(stage)
    count = layout.pp_layers[stage] if layout.pp_layers else model.layers
    params: dict[str, torch.Tensor] = {}
    optim: dict[str, Any] = {}
    for d in model.defs:
        if not _holds(d, layout, stage):
            continue
        names = (
            [(f"layers.{i}.{d.name}", f"model.layers.{first + i}.{d.name}") for i in range(count)]
            if d.where == "layer"
            else [(d.name, f"model.{d.name}")]
        )
        for local, glob in names:
            p = local_piece(d, values[glob], layout, rank, parts)
            e = local_piece(d, values[glob + ".exp_avg"], layout, rank, parts)
            s = values[glob + ".step"].clone()
            if blank:
                p, e, s = (torch.full_like(x, SENTINEL) for x in (p, e, s))
            params[local] = p
            optim[f"state.{local}.exp_avg"] = e
            optim[f"state.{local}.step"] = s
    sd: dict[str, Any] = {
        "model": params,
        "optim": optim,
        "extra": {"lr": 0.0 if blank else 0.25, "name": "" if blank else "gpt"},
    }
    if rank_local:
        rng = torch.arange(4, dtype=torch.int64) + 100 * rank
        sd["rng"] = {f"rank{rank}": torch.full_like(rng, SENTINEL) if blank else rng}
    return sd


def flat_tensors(sd: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in sd.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flat_tensors(v, key + "."))
        else:
            out[key] = v
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` comparable by ``torch.equal``: a one-byte float (fp8, which ``torch.equal`` does not compare) as bytes."""
    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.dtype.itemsize == 1 else t


def assert_ranks_equal(
    model: Model, values: dict[str, torch.Tensor], layout: ParallelLayout, parts: Any, loaded: list[dict[str, Any]]
) -> None:
    """Every rank's ``loaded`` state is :func:`rank_state` of ``values`` under ``layout``: same keys, dtypes and
    shapes, tensors bit-exact, objects equal."""
    for rank, sd in enumerate(loaded):
        expected = flat_tensors(rank_state(model, values, layout, rank, parts))
        got = flat_tensors(sd)
        assert expected.keys() == got.keys(), rank
        for key, want in expected.items():
            have = got[key]
            if isinstance(want, torch.Tensor):
                assert have.dtype == want.dtype and have.shape == want.shape, (rank, key)
                assert torch.equal(bits(have), bits(want)), f"rank {rank} {key}: {have} != {want}"
            else:
                assert type(have) is type(want) and have == want, (rank, key, have)

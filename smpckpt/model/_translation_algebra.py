"""The region algebra under :mod:`smpckpt.model.translation`: each of our tensors as an :data:`Expr` over
artifact tensors, evaluated lazily by region (:func:`pieces`) or eagerly (:func:`evaluate`,
:func:`scatter`).

* :class:`Leaf` -- ``artifact[key].reshape(view).permute(perm)`` (rename, transpose, split a fused dim);
* :class:`Cat` -- ``torch.cat([part, ...], dim)`` (fuse several artifact tensors, e.g. gate and up).

Because an Expr is data, not code, a storage layer can ask which rectangular region of which artifact
tensor (in its viewed coordinates) lands where in any requested region of ours: it reads only one TP
rank's shard out of an HF tensor, or writes each rank's chunk straight into HF-shaped tensors. The eager
forms are exact (bit-for-bit) inverses of each other. The rules that build Exprs from key templates
live in :mod:`smpckpt.model.translation`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Union

import torch

__all__ = ["Leaf", "Cat", "Expr", "Piece", "Shape", "expr_shape", "expr_keys", "pieces", "evaluate", "scatter"]
__all__ += ["merge_leading", "split_leading", "reshaped"]

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One artifact tensor, seen as ``artifact[key].reshape(view).permute(perm)``.

    Args:
        key: the artifact key.
        view: row-major reshape of the artifact tensor (same number of elements); ``None`` keeps its
            shape.
        perm: permutation of the viewed dims; ``None`` is the identity."""

    key: str
    view: Shape | None = None
    perm: Shape | None = None

    def __post_init__(self) -> None:
        if self.view is not None:
            view = tuple(int(v) for v in self.view)
            if any(v < 0 for v in view):
                raise ValueError(f"Leaf({self.key!r}).view must be non-negative, got {view}")
            object.__setattr__(self, "view", view)
        if self.perm is not None:
            perm = tuple(int(p) for p in self.perm)
            if sorted(perm) != list(range(len(perm))):
                raise ValueError(f"Leaf({self.key!r}).perm {perm} is not a permutation of 0..{len(perm) - 1}")
            object.__setattr__(self, "perm", perm)


@dataclasses.dataclass(frozen=True)
class Cat:
    """``torch.cat([evaluate(p) for p in parts], dim)``: parts agree on every dim but ``dim``."""

    dim: int
    parts: tuple[Expr, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", tuple(self.parts))
        if not self.parts:
            raise ValueError("Cat needs at least one part")
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 0:
            raise ValueError(f"Cat.dim must be a non-negative int, got {self.dim!r}")


Expr = Union[Leaf, Cat]


@dataclasses.dataclass(frozen=True)
class Piece:
    """One rectangular region of an artifact tensor and where it lands in a requested region of ours:
    ``artifact[key].reshape(view)[offsets : offsets + sizes].permute(perm)`` placed at ``dest_offsets``
    (relative to the requested region's origin), spanning :attr:`dest_sizes`."""

    key: str
    view: Shape  #: the artifact tensor's shape as viewed (its own shape when the Leaf has no view)
    offsets: Shape  #: region start, in ``view`` coordinates
    sizes: Shape  #: region extent, in ``view`` coordinates
    perm: Shape  #: permutation taking the region (shape ``sizes``) to our sub-region
    dest_offsets: Shape  #: where the sub-region sits, relative to the requested region's origin

    @property
    def dest_sizes(self) -> Shape:
        """Extent of the sub-region of ours this piece fills."""
        return tuple(self.sizes[p] for p in self.perm)


# -- shapes -------------------------------------------------------------------------------------------


def _artifact_shape(key: str, artifact_shapes: Mapping[str, Sequence[int]]) -> Shape:
    if key not in artifact_shapes:
        raise ValueError(f"artifact key {key!r} is missing (have {len(artifact_shapes)} keys)")
    return tuple(int(s) for s in artifact_shapes[key])


def _leaf_view(leaf: Leaf, artifact_shapes: Mapping[str, Sequence[int]]) -> tuple[Shape, Shape, Shape]:
    """``(artifact shape, view, perm)`` of ``leaf``, defaults resolved and checked against the shape."""
    shape = _artifact_shape(leaf.key, artifact_shapes)
    view = shape if leaf.view is None else leaf.view
    if math.prod(view) != math.prod(shape):
        raise ValueError(
            f"artifact key {leaf.key!r} of shape {shape} ({math.prod(shape)} elements) cannot be viewed as "
            f"{view} ({math.prod(view)} elements)"
        )
    perm = tuple(range(len(view))) if leaf.perm is None else leaf.perm
    if len(perm) != len(view):
        raise ValueError(f"artifact key {leaf.key!r}: perm {perm} does not fit view {view}")
    return shape, view, perm


def expr_keys(expr: Expr) -> list[str]:
    """Artifact keys an expression reads, in order (duplicates kept)."""
    if isinstance(expr, Leaf):
        return [expr.key]
    return [k for part in expr.parts for k in expr_keys(part)]


def expr_shape(expr: Expr, artifact_shapes: Mapping[str, Sequence[int]]) -> Shape:
    """Shape of ``expr`` evaluated over artifact tensors of ``artifact_shapes``; raises ValueError if inconsistent."""
    if isinstance(expr, Leaf):
        _, view, perm = _leaf_view(expr, artifact_shapes)
        return tuple(view[p] for p in perm)
    shapes = [expr_shape(part, artifact_shapes) for part in expr.parts]
    first = shapes[0]
    if expr.dim >= len(first):
        raise ValueError(f"Cat dim {expr.dim} is out of range for parts of shape {first} ({expr_keys(expr)})")
    for part, shape in zip(expr.parts[1:], shapes[1:]):
        if len(shape) != len(first) or any(a != b for i, (a, b) in enumerate(zip(shape, first)) if i != expr.dim):
            raise ValueError(
                f"Cat along dim {expr.dim}: {expr_keys(part)} has shape {shape} but {expr_keys(expr.parts[0])} "
                f"has {first}; they must agree on every other dim"
            )
    return first[: expr.dim] + (sum(s[expr.dim] for s in shapes),) + first[expr.dim + 1 :]


# -- the model's shape of a fused view ----------------------------------------------------------------
# A fused tensor is stored in a view (``[3, d, d]``) whose first two dims the unsharded model holds as
# one (``nn.Linear``'s ``[3d, d]``): the same row-major elements. These rewrite an Expr of one shape into
# the Expr of the other, so that regions of either shape map to artifact boxes.


def _leaf(key: str, shape: Shape, view: Shape, perm: Shape) -> Leaf:
    """The simplest Leaf for ``artifact[key].reshape(view).permute(perm)`` (defaults where they are)."""
    identity = perm == tuple(range(len(perm)))
    return Leaf(key, view=None if view == shape else view, perm=None if identity else perm)


def merge_leading(expr: Expr, artifact_shapes: Mapping[str, Sequence[int]]) -> Expr:
    """``expr`` with its first two dims as one (``[a, b, *rest]`` -> ``[a*b, *rest]``, row-major);
    ValueError when no Expr says it (a Leaf whose two dims are not adjacent, a Cat along dim 1)."""
    if isinstance(expr, Leaf):
        shape, view, perm = _leaf_view(expr, artifact_shapes)
        if len(perm) < 2 or perm[1] != perm[0] + 1:
            raise ValueError(f"{expr.key!r}: dims 0 and 1 of {expr} are not adjacent in the artifact tensor")
        a = perm[0]
        merged = view[:a] + (view[a] * view[a + 1],) + view[a + 2 :]
        return _leaf(expr.key, shape, merged, (a, *(p if p < a else p - 1 for p in perm[2:])))
    if expr.dim == 1:
        raise ValueError(f"a Cat along dim 1 ({expr_keys(expr)}) cannot have its dims 0 and 1 merged")
    parts = tuple(merge_leading(p, artifact_shapes) for p in expr.parts)
    return Cat(0 if expr.dim == 0 else expr.dim - 1, parts)


def split_leading(expr: Expr, count: int, artifact_shapes: Mapping[str, Sequence[int]]) -> Expr:
    """``expr`` with its first dim split in ``count`` (``[n, *rest]`` -> ``[count, n/count, *rest]``,
    row-major): the inverse of :func:`merge_leading`; ValueError when ``count`` does not divide the dim,
    or a Cat's parts along it do not fall on the split's boundaries."""
    shape = expr_shape(expr, artifact_shapes)
    if not shape or count < 1 or shape[0] % count:
        raise ValueError(f"{expr_keys(expr)}: shape {shape} does not split into {count} on dim 0")
    rows = shape[0] // count
    if isinstance(expr, Leaf):
        stored, view, perm = _leaf_view(expr, artifact_shapes)
        a = perm[0]
        split = view[:a] + (count, rows) + view[a + 1 :]
        return _leaf(expr.key, stored, split, (a, a + 1, *(p if p < a else p + 1 for p in perm[1:])))
    if expr.dim != 0:
        return Cat(expr.dim + 1, tuple(split_leading(p, count, artifact_shapes) for p in expr.parts))
    parts = []
    for part in expr.parts:
        extent = expr_shape(part, artifact_shapes)[0]
        if extent % rows:
            raise ValueError(f"{expr_keys(part)}: {extent} rows do not fall on the split into {count} x {rows}")
        parts.append(split_leading(part, extent // rows, artifact_shapes))
    return Cat(0, tuple(parts))


def reshaped(expr: Expr, shape: Sequence[int], artifact_shapes: Mapping[str, Sequence[int]]) -> Expr | None:
    """``expr`` seen in ``shape`` when that is its shape with the first two dims merged or the first dim
    split (a fused tensor in the model's shape or in its view); ``None`` when it is neither."""
    want, have = tuple(int(s) for s in shape), expr_shape(expr, artifact_shapes)
    try:
        if want == have:
            return expr
        if len(have) >= 2 and want == (have[0] * have[1], *have[2:]):
            return merge_leading(expr, artifact_shapes)
        if len(want) >= 2 and have and have == (want[0] * want[1], *want[2:]):
            return split_leading(expr, want[0], artifact_shapes)
    except ValueError:
        return None
    return None


# -- lazy, by region -----------------------------------------------------------------------------------


def pieces(
    expr: Expr, offsets: Sequence[int], sizes: Sequence[int], artifact_shapes: Mapping[str, Sequence[int]]
) -> list[Piece]:
    """The artifact regions that make up region ``[offsets, offsets + sizes)`` of ``expr``, covering it
    exactly once, none of zero size; ValueError naming the keys when the region is out of bounds."""
    # a plain Leaf (every tensor of an untranslated artifact: thousands per save) is its own region
    plain = expr if isinstance(expr, Leaf) and expr.view is None and expr.perm is None else None
    shape = _artifact_shape(plain.key, artifact_shapes) if plain is not None else expr_shape(expr, artifact_shapes)
    offsets = tuple(int(o) for o in offsets)
    sizes = tuple(int(s) for s in sizes)
    if (
        len(offsets) != len(shape)
        or len(sizes) != len(shape)
        or any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape))
    ):
        raise ValueError(
            f"region offsets={offsets} sizes={sizes} is out of bounds for {expr_keys(expr)} of shape {shape}"
        )
    out: list[Piece] = []
    if 0 in sizes:
        return out
    if plain is not None:
        return [Piece(plain.key, shape, offsets, sizes, tuple(range(len(shape))), (0,) * len(shape))]
    _collect(expr, offsets, sizes, (0,) * len(shape), artifact_shapes, out)
    return out


def _collect(
    expr: Expr,
    offsets: Shape,
    sizes: Shape,
    dest: Shape,
    artifact_shapes: Mapping[str, Sequence[int]],
    out: list[Piece],
) -> None:
    if isinstance(expr, Leaf):
        _, view, perm = _leaf_view(expr, artifact_shapes)
        # our dim j is view dim perm[j]: move the region back into view coordinates
        v_off, v_size = [0] * len(view), [0] * len(view)
        for j, p in enumerate(perm):
            v_off[p], v_size[p] = offsets[j], sizes[j]
        out.append(Piece(expr.key, view, tuple(v_off), tuple(v_size), perm, dest))
        return
    d, lo, hi = expr.dim, offsets[expr.dim], offsets[expr.dim] + sizes[expr.dim]
    start = 0
    for part in expr.parts:
        extent = expr_shape(part, artifact_shapes)[d]
        a, b = max(lo, start), min(hi, start + extent)
        if a < b:  # this part intersects the region along the Cat dim
            sub_off = offsets[:d] + (a - start,) + offsets[d + 1 :]
            sub_size = sizes[:d] + (b - a,) + sizes[d + 1 :]
            sub_dest = dest[:d] + (dest[d] + a - lo,) + dest[d + 1 :]
            _collect(part, sub_off, sub_size, sub_dest, artifact_shapes, out)
        start += extent


# -- eager --------------------------------------------------------------------------------------------


def evaluate(expr: Expr, artifact: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Our tensor from whole artifact tensors (contiguous; may share memory with an artifact tensor)."""
    if isinstance(expr, Leaf):
        if expr.key not in artifact:
            raise ValueError(f"artifact key {expr.key!r} is missing")
        tensor = artifact[expr.key]
        _, view, perm = _leaf_view(expr, {expr.key: tensor.shape})
        return tensor.reshape(view).permute(perm).contiguous()
    expr_shape(expr, {k: artifact[k].shape for k in expr_keys(expr) if k in artifact})  # clear errors first
    return torch.cat([evaluate(part, artifact) for part in expr.parts], expr.dim).contiguous()


def scatter(expr: Expr, ours: torch.Tensor, artifact_shapes: Mapping[str, Sequence[int]]) -> dict[str, torch.Tensor]:
    """The artifact tensors ``ours`` is made of under ``expr`` (inverse of :func:`evaluate`; each of its
    keys once): contiguous, shaped as ``artifact_shapes`` says, possibly sharing memory with ``ours``."""
    shape = expr_shape(expr, artifact_shapes)
    if tuple(ours.shape) != shape:
        raise ValueError(f"tensor of shape {tuple(ours.shape)} does not fit {expr_keys(expr)} of shape {shape}")
    keys = expr_keys(expr)
    if len(set(keys)) != len(keys):
        raise ValueError(f"artifact keys {sorted({k for k in keys if keys.count(k) > 1})} appear more than once")
    out: dict[str, torch.Tensor] = {}
    _scatter(expr, ours, artifact_shapes, out)
    return out


def _scatter(
    expr: Expr, tensor: torch.Tensor, artifact_shapes: Mapping[str, Sequence[int]], out: dict[str, torch.Tensor]
) -> None:
    if isinstance(expr, Leaf):
        shape, _, perm = _leaf_view(expr, artifact_shapes)
        inverse = tuple(perm.index(i) for i in range(len(perm)))
        out[expr.key] = tensor.permute(inverse).reshape(shape).contiguous()
        return
    start = 0
    for part in expr.parts:
        extent = expr_shape(part, artifact_shapes)[expr.dim]
        _scatter(part, tensor.narrow(expr.dim, start, extent), artifact_shapes, out)
        start += extent

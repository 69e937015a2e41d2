"""smpckpt.model.translation: the Leaf/Cat algebra, region pieces, eager evaluate/scatter and Translation rules."""

from __future__ import annotations

import math

import pytest
import torch
from hf_reference import assemble, regions, slices
from hypothesis import given, settings
from hypothesis import strategies as st

from smpckpt.model.translation import (
    Cat,
    Leaf,
    Piece,
    Translation,
    evaluate,
    expr_shape,
    pieces,
    rename,
    reshaped,
    scatter,
    stack,
    transpose,
)


@st.composite
def expressions(draw, shape: tuple[int, ...], shapes: dict[str, tuple[int, ...]], depth: int = 2):
    """A random Expr of ``shape``: Leafs with random views/permutations, nested Cats along random dims."""
    ndim = len(shape)
    if depth == 0 or draw(st.booleans()):
        perm = tuple(draw(st.permutations(range(ndim))))
        view = [0] * ndim
        for j, p in enumerate(perm):
            view[p] = shape[j]
        candidates = [tuple(view), (math.prod(view),)]
        if ndim >= 2:
            candidates.append((view[0] * view[1], *view[2:]))
        artifact_shape = draw(st.sampled_from(candidates))
        key = f"a{len(shapes)}"
        shapes[key] = artifact_shape
        leaf_view = None if artifact_shape == tuple(view) else tuple(view)
        return Leaf(key, view=leaf_view, perm=None if perm == tuple(range(ndim)) else perm)
    dim = draw(st.integers(0, ndim - 1))
    n = shape[dim]
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=2))) if n > 1 else []
    bounds = [0, *cuts, n]
    parts = []
    for a, b in zip(bounds, bounds[1:]):
        sub = shape[:dim] + (b - a,) + shape[dim + 1 :]
        parts.append(draw(expressions(sub, shapes, depth - 1)))
    return Cat(dim, tuple(parts))


@st.composite
def cases(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    shapes: dict[str, tuple[int, ...]] = {}
    expr = draw(expressions(shape, shapes))
    return shape, expr, shapes, draw(regions(shape))


@settings(derandomize=True, max_examples=150, deadline=None)
@given(cases())
def test_random_expressions_pieces_evaluate_scatter(case):
    shape, expr, shapes, drawn = case
    base = 0
    artifact = {}
    for key, s in shapes.items():  # distinct values everywhere: a misplaced element cannot go unnoticed
        artifact[key] = torch.arange(base, base + math.prod(s), dtype=torch.float64).reshape(s)
        base += math.prod(s)
    assert expr_shape(expr, shapes) == shape
    ours = evaluate(expr, artifact)
    assert ours.shape == shape and ours.is_contiguous()
    assert sorted(ours.flatten().tolist()) == list(range(base))  # a bijection of the artifact elements
    # the drawn region, and two that cross every part boundary: the whole tensor and its interior
    interior = (tuple(min(1, n - 1) for n in shape), tuple(max(n - 2, 1) for n in shape))
    for offsets, sizes in (drawn, ((0,) * len(shape), shape), interior):
        found = pieces(expr, offsets, sizes, shapes)
        if 0 in sizes:
            assert found == []
        else:
            assert torch.equal(assemble(found, artifact, sizes), ours[slices(offsets, sizes)])
    back = scatter(expr, ours, shapes)
    assert back.keys() == artifact.keys()
    for key, tensor in artifact.items():
        assert torch.equal(back[key], tensor) and back[key].is_contiguous()


@settings(derandomize=True, max_examples=150, deadline=None)
@given(cases(), st.integers(1, 5))
def test_expressions_merge_and_split_their_leading_dims_row_major(case, count):
    """A fused tensor in the model's shape ([3d, d]) and in its view ([3, d, d]) are the same elements:
    ``reshaped`` rewrites an Expr into either shape exactly, or says it cannot (``None``)."""
    shape, expr, shapes, drawn = case
    artifact = {k: torch.randn(s, dtype=torch.float64) for k, s in shapes.items()}
    ours = evaluate(expr, artifact)
    targets = []
    if len(shape) >= 2:
        targets.append((shape[0] * shape[1], *shape[2:]))
    if shape[0] % count == 0:
        targets.append((count, shape[0] // count, *shape[1:]))
    for target in targets:
        other = reshaped(expr, target, shapes)
        if other is None:
            continue
        assert expr_shape(other, shapes) == target
        assert torch.equal(evaluate(other, artifact), ours.reshape(target))
        assert torch.equal(evaluate(reshaped(other, shape, shapes), artifact), ours)  # and back
        offsets, sizes = (0,) * len(target), target
        assert torch.equal(assemble(pieces(other, offsets, sizes, shapes), artifact, sizes), ours.reshape(target))


def test_fused_views_merge_as_the_model_holds_them():
    """The families' fused rules: GPT-2's transposed c_attn and a stacked gate/up merge to one Leaf each."""
    d = 4
    qkv = Leaf("c_attn", view=(d, 3, d), perm=(1, 2, 0))
    assert reshaped(qkv, (3 * d, d), {"c_attn": (d, 3 * d)}) == Leaf("c_attn", perm=(1, 0))
    gate_up = Cat(0, (Leaf("g", view=(1, 3, 2)), Leaf("u", view=(1, 3, 2))))
    assert reshaped(gate_up, (6, 2), {"g": (3, 2), "u": (3, 2)}) == Cat(0, (Leaf("g"), Leaf("u")))
    assert reshaped(Cat(1, (Leaf("g"), Leaf("u"))), (6,), {"g": (3, 1), "u": (3, 1)}) is None  # not expressible
    assert reshaped(Leaf("g"), (2, 3), {"g": (3, 2)}) is None  # not a leading merge or split


def test_gpt2_style_leaf_pieces_by_hand():
    """ours[j, o, i] = c_attn[i, j*d + o]: TP rank 1 of 2 reads columns d/2.. of each of q, k and v."""
    d = 4
    leaf = Leaf("c_attn", view=(d, 3, d), perm=(1, 2, 0))
    c_attn = torch.arange(d * 3 * d, dtype=torch.float64).reshape(d, 3 * d)
    ours = evaluate(leaf, {"c_attn": c_attn})
    for j in range(3):
        for o in range(d):
            for i in range(d):
                assert ours[j, o, i] == c_attn[i, j * d + o]
    (piece,) = pieces(leaf, (0, 2, 0), (3, 2, d), {"c_attn": (d, 3 * d)})
    assert piece == Piece("c_attn", (d, 3, d), (0, 0, 2), (d, 3, 2), (1, 2, 0), (0, 0, 0))


def test_cat_pieces_split_at_part_boundaries():
    expr = Cat(0, (Leaf("g", view=(1, 3, 2)), Leaf("u", view=(1, 3, 2))))
    shapes = {"g": (3, 2), "u": (3, 2)}
    found = pieces(expr, (0, 1, 0), (2, 2, 2), shapes)
    assert [(p.key, p.offsets, p.sizes, p.dest_offsets) for p in found] == [
        ("g", (0, 1, 0), (1, 2, 2), (0, 0, 0)),
        ("u", (0, 1, 0), (1, 2, 2), (1, 0, 0)),
    ]
    assert pieces(expr, (1, 0, 0), (1, 3, 2), shapes)[0].key == "u"  # only the part the region touches


def test_errors_name_keys_and_shapes():
    with pytest.raises(ValueError, match="permutation"):
        Leaf("a", perm=(0, 0))
    with pytest.raises(ValueError, match="at least one part"):
        Cat(0, ())
    with pytest.raises(ValueError, match=r"'a' of shape \(2, 3\) \(6 elements\) cannot be viewed as \(4, 2\)"):
        expr_shape(Leaf("a", view=(4, 2)), {"a": (2, 3)})
    with pytest.raises(ValueError, match="'missing' is missing"):
        expr_shape(Leaf("missing"), {})
    with pytest.raises(ValueError, match=r"\['b'\] has shape \(2, 4\).*\['a'\] has \(2, 3\)"):
        expr_shape(Cat(0, (Leaf("a"), Leaf("b"))), {"a": (2, 3), "b": (2, 4)})
    with pytest.raises(ValueError, match=r"out of bounds for \['a'\] of shape \(2, 3\)"):
        pieces(Leaf("a"), (1, 0), (2, 3), {"a": (2, 3)})
    with pytest.raises(ValueError, match="appear more than once"):
        scatter(Cat(0, (Leaf("a"), Leaf("a"))), torch.zeros(4, 3), {"a": (2, 3)})
    with pytest.raises(ValueError, match=r"shape \(3, 3\) does not fit"):
        scatter(Leaf("a"), torch.zeros(3, 3), {"a": (2, 3)})


def test_zero_size_region_is_empty():
    assert pieces(Leaf("a"), (2, 0), (0, 3), {"a": (2, 3)}) == []


# -- Translation ---------------------------------------------------------------------------------------

_T = Translation(
    "toy",
    rules=(
        stack("l.{i}.gate_up", ("l.{i}.gate", "l.{i}.up")),
        transpose("l.{i}.fc", "l.{i}.c_fc"),
        rename("head", "lm_head"),
    ),
    ignore=("l.{i}.buffer",),
)


def _toy_artifact() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(2):
        out |= {
            f"l.{i}.gate": torch.randn(3, 2, generator=g),
            f"l.{i}.up": torch.randn(3, 2, generator=g),
            f"l.{i}.c_fc": torch.randn(2, 5, generator=g),
            f"l.{i}.norm": torch.randn(2, generator=g),
        }
    return out | {"lm_head": torch.randn(4, 2, generator=g)}


def test_translation_round_trip_and_order():
    artifact = _toy_artifact()
    ours = _T.translate_from_artifact({**artifact, "l.0.buffer": torch.ones(1)})  # ignored
    assert list(ours) == ["l.0.gate_up", "l.0.fc", "l.0.norm", "l.1.gate_up", "l.1.fc", "l.1.norm", "head"]
    assert ours["l.0.gate_up"].shape == (2, 3, 2) and ours["l.1.fc"].shape == (5, 2)
    back = _T.translate_to_artifact(ours)
    assert back.keys() == artifact.keys()
    assert all(torch.equal(back[k], artifact[k]) for k in artifact)
    plan = _T.from_artifact({k: tuple(v.shape) for k, v in artifact.items()})
    assert plan["l.0.gate_up"][1] == (2, 3, 2) and plan["l.0.norm"] == (Leaf("l.0.norm"), (2,))


def test_optimizer_state_follows_its_parameter():
    artifact = _toy_artifact()
    ours = _T.translate_from_artifact(artifact)
    state = dict(ours)
    for key, t in ours.items():
        state[key + ".exp_avg"] = t * 2
    state["l.0.gate_up.step"] = torch.tensor(3.0)  # scalar: not the parameter's shape, maps to itself
    exprs, shapes = _T.to_artifact({k: tuple(v.shape) for k, v in state.items()})
    assert exprs["l.0.gate_up.exp_avg"] == Cat(
        0, (Leaf("l.0.gate.exp_avg", view=(1, 3, 2)), Leaf("l.0.up.exp_avg", view=(1, 3, 2)))
    )
    assert exprs["l.0.gate_up.step"] == Leaf("l.0.gate_up.step") and shapes["l.0.gate_up.step"] == ()
    exported = _T.translate_to_artifact(state)
    assert torch.equal(exported["l.1.c_fc.exp_avg"], artifact["l.1.c_fc"] * 2)
    assert torch.equal(exported["lm_head.exp_avg"], artifact["lm_head"] * 2)
    imported = _T.translate_from_artifact(exported)
    assert imported.keys() == state.keys()
    assert all(torch.equal(imported[k], state[k]) for k in state)


def test_translation_errors():
    artifact = {k: tuple(v.shape) for k, v in _toy_artifact().items()}
    with pytest.raises(ValueError, match=r"'l\.1\.up' is part of 'l\.\{i\}\.gate_up' but \['l\.1\.gate'\] is missing"):
        _T.from_artifact({k: v for k, v in artifact.items() if k != "l.1.gate"})
    with pytest.raises(ValueError, match=r"l\.0\.gate \(3, 2\), l\.0\.up \(4, 2\): stacked tensors must share a shape"):
        _T.from_artifact({**artifact, "l.0.up": (4, 2)})
    with pytest.raises(ValueError, match=r"our 'l\.0\.gate_up' of shape \(3, 3, 2\).*pass specs="):
        _T.to_artifact({"l.0.gate_up": (3, 3, 2)})
    # the model's merged shape of the fused view saves (a TP=1 model without specs); one that cannot be
    # the view's merged says what would have made it so
    exprs, shapes = _T.to_artifact({"l.0.gate_up": (6, 2)})
    assert exprs["l.0.gate_up"] == Cat(0, (Leaf("l.0.gate"), Leaf("l.0.up"))) and shapes["l.0.gate"] == (3, 2)
    with pytest.raises(ValueError, match=r"\(7, 2\).*specs the model was built with"):
        _T.to_artifact({"l.0.gate_up": (7, 2)})
    with pytest.raises(ValueError, match=r"'l\.0\.gate' would be written from both 'l\.0\.gate_up' and 'l\.0\.gate'"):
        _T.to_artifact({"l.0.gate_up": (2, 3, 2), "l.0.gate": (3, 2)})
    with pytest.raises(ValueError, match=r"our key 'head' would be read from both"):
        _T.from_artifact({"lm_head": (4, 2), "head": (4, 2)})
    with pytest.raises(TypeError, match="expected a tensor"):
        _T.translate_from_artifact({"x": 1.0})  # type: ignore[dict-item]


def test_identity():
    sd = {"a.weight": torch.randn(2, 3), "a.weight.exp_avg": torch.randn(2, 3), "step": torch.tensor(1)}
    identity = Translation("identity")  # no rules: every key maps to itself
    assert identity.from_artifact({k: v.shape for k, v in sd.items()})["a.weight"] == (Leaf("a.weight"), (2, 3))
    for out in (identity.translate_to_artifact(sd), identity.translate_from_artifact(sd)):
        assert out.keys() == sd.keys() and all(torch.equal(out[k], sd[k]) for k in sd)

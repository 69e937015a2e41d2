"""Lazy region rules of the HF translations, checked against eager evaluation on real tiny models.

Load direction: any region of any of our tensors, assembled from ``pieces`` by reading only those
regions of the HF tensors, equals the eager tensor's region. Save direction: writing every TP rank's
shard (as tp_specs cut it) through ``pieces`` into zeroed HF-shaped tensors rebuilds HF's state dict
exactly, each element written once."""

from __future__ import annotations

import functools

import pytest
import torch
from hf_reference import MODULES, assemble, regions, slices, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from smpckpt.model.specs import SpecRules
from smpckpt.model.translation import evaluate, pieces

NAMES = sorted(MODULES)


@functools.cache
def _artifact(name: str) -> dict[str, torch.Tensor]:
    """HF's tensors as a file would hold them (no tied head), float64 so equality is exact."""
    model = tiny_model(name)
    return MODULES[name].translate_state_dict_to_hf(
        MODULES[name].translate_hf_state_dict_to_smpckpt(model.state_dict())
    )


@st.composite
def _cases(draw):
    name = draw(st.sampled_from(NAMES))
    artifact = _artifact(name)
    plan = MODULES[name].TRANSLATION.from_artifact({k: tuple(v.shape) for k, v in artifact.items()})
    key = draw(st.sampled_from(sorted(plan)))
    expr, shape = plan[key]
    return name, key, expr, shape, draw(regions(shape))


@settings(derandomize=True, max_examples=200, deadline=None)
@given(_cases())
def test_pieces_of_random_regions_match_eager(case):
    name, key, expr, shape, (offsets, sizes) = case
    artifact = _artifact(name)
    shapes = {k: tuple(v.shape) for k, v in artifact.items()}
    found = pieces(expr, offsets, sizes, shapes)
    if 0 in sizes:
        assert found == []
        return
    assert torch.equal(assemble(found, artifact, sizes), evaluate(expr, artifact)[slices(offsets, sizes)])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_rank_shards_write_straight_into_hf_tensors(name, tp):
    artifact = _artifact(name)
    mod = MODULES[name]
    ours = mod.translate_hf_state_dict_to_smpckpt(artifact, keep_view_shapes=True)
    exprs, shapes = mod.TRANSLATION.to_artifact({k: tuple(v.shape) for k, v in ours.items()})
    assert shapes == {k: tuple(v.shape) for k, v in artifact.items()}
    rules = SpecRules(mod.tp_specs(tp, tiny_model(name).config))
    out = {k: torch.zeros(s, dtype=torch.float64) for k, s in shapes.items()}
    written = {k: torch.zeros(s, dtype=torch.int64) for k, s in shapes.items()}
    for key, tensor in ours.items():
        matched = rules.match(key)
        for rank in range(tp):
            offsets, sizes = [0] * tensor.ndim, list(tensor.shape)
            if matched is not None:
                spec = matched[0][0]
                split = spec.sizes or (tensor.shape[spec.dim] // tp,) * tp
                offsets[spec.dim], sizes[spec.dim] = sum(split[:rank]), split[rank]
            elif rank:  # a replica: one rank writes it
                continue
            chunk = tensor[slices(offsets, sizes)]  # what this rank holds, in view coordinates
            for p in pieces(exprs[key], offsets, sizes, shapes):
                inverse = tuple(p.perm.index(i) for i in range(len(p.perm)))
                src = chunk[slices(p.dest_offsets, p.dest_sizes)].permute(inverse)
                out[p.key].view(p.view)[slices(p.offsets, p.sizes)] = src
                written[p.key].view(p.view)[slices(p.offsets, p.sizes)] += 1
    for k in artifact:
        assert bool((written[k] == 1).all()), k
        assert torch.equal(out[k], artifact[k]), k

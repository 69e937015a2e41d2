"""Local planning (every rank, every save) rewritten for speed must give exactly what it gave before.

Each test holds a fast path against the plain definition it replaced: DCP's own ``flatten_state_dict``,
the replica digest's text as it was hashed line by line, the uneven-split offsets as sums.
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import _version as dcp_version
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from smpckpt import ParallelLayout, ShardSpec
from smpckpt.model.specs import shard_geometry
from smpckpt.planners import ParallelSavePlanner
from smpckpt.planners._entries import Entry, flatten

_TENSORS = [torch.zeros(2), torch.ones(3, 1), torch.empty(0)]
_LEAVES = st.one_of(
    st.sampled_from(_TENSORS),
    st.integers(-3, 3),
    st.text("ab.", max_size=3),
    st.none(),
    st.tuples(st.sampled_from(_TENSORS), st.integers()),  # tuples are leaves, even holding tensors
)
_KEYS = st.one_of(st.text("ab.1", max_size=3), st.integers(0, 3))  # dots and int keys can collide
_TREES = st.recursive(
    _LEAVES,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_KEYS, inner, max_size=3)),
    max_leaves=12,
)


def _dcp_flatten(sd):
    try:
        return flatten_state_dict(sd)
    except ValueError as exc:
        return exc


def _same_name_keys(tree: object) -> bool:
    """Whether a mapping in ``tree`` holds two keys of one name (``0`` and ``"0"``): DCP merges their
    subtrees (or says "duplicated flatten key" where two leaves meet); ours refuses them by name."""
    if isinstance(tree, dict):
        names = [str(k) for k in tree]
        return len(set(names)) != len(names) or any(_same_name_keys(v) for v in tree.values())
    return isinstance(tree, list) and any(_same_name_keys(v) for v in tree)


@settings(max_examples=500, deadline=None, derandomize=True)
@given(st.dictionaries(_KEYS, _TREES, max_size=4))
def test_flatten_is_dcps_flatten(sd):
    expected = _dcp_flatten(sd)
    if _same_name_keys(sd):
        with pytest.raises(ValueError, match="have one name in a checkpoint|duplicated flatten key"):
            flatten(sd)
        return
    if isinstance(expected, ValueError):
        with pytest.raises(ValueError, match="duplicated flatten key"):
            flatten(sd)
        return
    flat, paths = flatten(sd)
    ref_flat, ref_paths = expected
    assert list(flat) == list(ref_flat)  # same keys in the same order
    assert all(flat[k] is ref_flat[k] for k in flat)  # the very same objects
    assert list(paths.items()) == list(ref_paths.items())
    assert all(type(a) is type(b) for k in paths for a, b in zip(paths[k], ref_paths[k]))  # 0 is not "0"


def test_flatten_examples():
    t = torch.zeros(1)
    sd = {"m": {"w": t, "l": [t, {"x": 1}], "leaf": [1, 2], "tup": (t,), "e": {}}, 3: []}
    flat, paths = flatten(sd)
    assert list(flat) == ["m.w", "m.l.0", "m.l.1.x", "m.leaf", "m.tup", "3"]
    assert paths["m.l.1.x"] == ("m", "l", 1, "x") and paths["3"] == ("3",)
    with pytest.raises(ValueError, match="duplicated flatten key a.b"):
        flatten({"a.b": t, "a": {"b": t}})


def test_flatten_follows_dcps_pre_2_4_scheme_when_dcp_asks_for_it():
    sd = {"a": [{"b": torch.zeros(1)}]}
    dcp_version._derived_version = "2_3"
    try:
        assert flatten(sd) == flatten_state_dict(sd)
    finally:
        dcp_version._derived_version = None


def _digest_line_by_line(planner):
    """The replica digest as first written: one formatted line per tensor, in key order."""
    h = hashlib.sha1()
    count = 0
    for e in sorted(planner.entries.values(), key=lambda e: e.key):
        if e.kind != "tensor" or e.rank_local:
            continue
        count += 1
        h.update(f"{e.key}|{e.value.dtype}|{tuple(e.global_shape or ())}|{sorted(e.sharded_axes)}\n".encode())
    return count, h.hexdigest()


@pytest.mark.parametrize("rank", [0, 3, 5])
def test_replica_digest_is_the_line_by_line_digest(rank):
    layout = ParallelLayout(tp=2, dp=3)
    specs = {"model.*.w": ShardSpec(0), "optim.z": [ShardSpec(0, "tp"), ShardSpec(1, "dp")]}
    sd = {
        "model": {f"l{i}": {"w": torch.zeros(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16)} for i in range(5)},
        "optim": {"z": torch.zeros(4, 2), "step": torch.tensor(3)},
        "rng.rank": torch.zeros(2),
        "note": "text",
    }
    # insertion order differs by rank: the digest must not
    sd["model"] = dict(sorted(sd["model"].items(), reverse=bool(rank % 2)))
    planner = ParallelSavePlanner(layout, specs, rank=rank, rank_local=("rng.*",))
    planner.set_up_planner(sd)
    digest = planner.create_local_plan().planner_data["digest"]
    assert digest == _digest_line_by_line(planner)
    assert digest[0] == 12  # 10 model tensors, z, step (rng.rank is rank-local)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=12), st.data())
def test_uneven_split_offsets_are_the_sums_of_the_sizes_before(sizes, data):
    rank = data.draw(st.integers(0, len(sizes) - 1))
    spec = ShardSpec(0, "dp", sizes=tuple(sizes))
    layout = ParallelLayout(tp=1, dp=len(sizes))
    for _ in range(2):  # the second call reads the offsets the spec computed once
        g = shard_geometry("w", (sizes[rank], 3), [spec], layout.coords(rank), {"tp": 1, "dp": len(sizes), "pp": 1})
        assert g.offsets == torch.Size([sum(sizes[:rank]), 0])
        assert g.global_shape == torch.Size([sum(sizes), 3])


def test_optimizer_state_inherits_its_parameters_spec_only_with_its_shape():
    layout = ParallelLayout(tp=2)
    planner = ParallelSavePlanner(layout, {"model.*.w": ShardSpec(0)}, rank=1)
    planner.set_up_planner(
        {
            "model": {"a": {"w": torch.zeros(2, 3)}},
            "optim": {
                "state": {
                    "a.w": {"exp_avg": torch.zeros(2, 3), "row": torch.zeros(2), "step": torch.tensor(1.0)},
                    "gone.w": {"exp_avg": torch.zeros(5, 3)},  # its parameter is not in this state dict
                }
            },
        }
    )
    split = {k: (e.sharded_axes, tuple(e.global_shape)) for k, e in planner.entries.items()}
    assert split == {
        "model.a.w": (frozenset({"tp"}), (4, 3)),
        "optim.state.a.w.exp_avg": (frozenset({"tp"}), (4, 3)),  # the parameter's shape: inherits
        "optim.state.a.w.row": (frozenset(), (2,)),  # another shape: replicated
        "optim.state.a.w.step": (frozenset(), ()),  # a scalar: replicated
        "optim.state.gone.w.exp_avg": (frozenset({"tp"}), (10, 3)),  # no parameter to compare: inherits
    }


def test_entry_fields_keep_the_order_positional_construction_relies_on():
    """``_EntryMaker.entry`` builds entries by position (keywords cost ~0.2 us per key): a reordered or
    inserted field would fill the wrong one silently."""
    assert [f.name for f in dataclasses.fields(Entry)] == [
        "local_key",
        "key",
        "path",
        "kind",
        "value",
        "chunk",
        "global_shape",
        "sharded_axes",
        "specs",
        "rank_local",
        "dtensor",
        "original_global_shape",
    ]

"""How spec rules meet keys in the API: a rule written against the model's own parameter names (what
``smpckpt.hf.<family>.tp_specs`` returns) matches the stored ``model.<name>`` key, and rules that match
nothing at all are refused instead of saving every shard as a replica."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from sim import sim_save
from torch import nn

from smpckpt import ParallelLayout, ShardSpec, SpecError, resume_from_checkpoint, save_checkpoint
from smpckpt.model.specs import SpecRules, spec_rules
from smpckpt.planners import ParallelSavePlanner
from smpckpt.storage import FsspecStorageWriter


def test_rules_match_the_stored_key_or_the_models_own_name() -> None:
    rules = spec_rules({"transformer.h.*.qkv.weight": ShardSpec(1, view=(3, -1, 4)), "model.layers.*.w": ShardSpec(0)})
    qkv = ShardSpec(1, view=(3, -1, 4))
    assert rules.match("model.transformer.h.0.qkv.weight") == ((qkv,), None)  # the model's own name
    assert rules.match("transformer.h.0.qkv.weight") == ((qkv,), None)
    assert rules.match("model.model.layers.1.w") == ((ShardSpec(0),), None)  # Llama: HF keys start with model.
    assert rules.match("model.layers.1.w") == ((ShardSpec(0),), None)  # a rule over stored keys still matches
    assert rules.match("optim.state.transformer.h.0.qkv.weight.exp_avg", ("model",)) == (
        (qkv,),
        "transformer.h.0.qkv.weight",
    )
    assert rules.match("other.transformer.h.0.qkv.weight") is None and rules.match("rng.model.layers.1.w") is None
    # first match wins over both readings of a key: the earlier rule, in either reading, wins
    ordered = spec_rules({"fc.weight": ShardSpec(0), "model.fc.weight": ShardSpec(1)})
    assert ordered.match("model.fc.weight") == ((ShardSpec(0),), None)
    assert ordered.to_records()[0]["also_under"] == ["model"]
    assert SpecRules.of(ordered, also_under=("model",)) is ordered


class _Col(nn.Module):
    def __init__(self, piece: torch.Tensor) -> None:
        super().__init__()
        self.fc = nn.Linear(piece.shape[1], piece.shape[0], bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(piece)


def test_rules_that_match_no_key_are_refused_naming_them(tmp_path: Any) -> None:
    model = _Col(torch.randn(4, 3))
    with pytest.raises(
        SpecError, match=r"none of the 1 spec rules matches a tensor of any rank: 'decoder\.\*\.weight'"
    ):
        save_checkpoint(str(tmp_path), "t", model=model, specs={"decoder.*.weight": ShardSpec(0)})
    assert not os.path.exists(tmp_path / "t_partial" / "smpckpt.manifest.json")
    save_checkpoint(str(tmp_path), "ok", model=model, specs={"fc.weight": ShardSpec(0)})  # the model's own name
    with open(tmp_path / "ok_partial" / "smpckpt.manifest.json") as f:
        assert json.load(f)["extra"]["layout_record"]["specs"][0]["pattern"] == "fc.weight"
    back = _Col(torch.zeros(4, 3))
    resume_from_checkpoint(str(tmp_path), "ok", model=back, specs={"fc.weight": ShardSpec(0)})
    assert torch.equal(back.fc.weight, model.fc.weight)


def test_tp_shards_under_model_relative_rules_are_saved_whole(tmp_path: Any) -> None:
    """Two TP ranks, rules without the ``model.`` prefix: each rank's piece lands at its offset."""
    full = torch.randn(6, 3)
    layout, specs = ParallelLayout(tp=2), spec_rules({"fc.weight": ShardSpec(0)})
    sds = [{"model": {"fc.weight": full.chunk(2)[r].clone()}} for r in range(2)]
    metadata = sim_save(
        sds,
        [ParallelSavePlanner(layout, specs, rank=r) for r in range(2)],
        [FsspecStorageWriter(str(tmp_path)) for _ in range(2)],
    )
    md = metadata.state_dict_metadata["model.fc.weight"]
    assert tuple(md.size) == (6, 3) and sorted(tuple(c.offsets) for c in md.chunks) == [(0, 0), (3, 0)]

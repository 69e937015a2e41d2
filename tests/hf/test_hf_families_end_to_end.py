"""Every Hugging Face family end to end on two real gloo ranks: HF model -> our TP=2 shards -> partial
checkpoint -> full HF artifact (online and offline) -> ``from_pretrained`` gives the original model's
logits exactly; a sharded ``save_pretrained`` folder loads into TP=2 bit-exact; and GPT-2 over two
pipeline stages, whose last holds its own copy of the tied head, loads from a folder that leaves it out.
One world for all eight families (spawning ranks costs more than a family's work)."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_world
from hf_family_workers import SEED, families
from hf_reference import MODULES, tiny_model

pytestmark = pytest.mark.dist

NAMES = sorted(MODULES)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    hf_root = tmp_path_factory.mktemp("pretrained")
    for name in NAMES:  # sharded folders, as large models come
        tiny_model(name, seed=SEED, dtype=torch.float32).save_pretrained(hf_root / name, max_shard_size="20KB")
        assert (hf_root / name / "model.safetensors.index.json").exists()
    root = tmp_path_factory.mktemp("ckpt")
    return run_world(families, 2, str(root), str(hf_root), NAMES, timeout=480)


@pytest.mark.parametrize("name", NAMES)
def test_family_end_to_end(results: list[dict], name: str) -> None:
    mod = MODULES[name]
    for rank, per_rank in enumerate(results):
        got = per_rank[name]
        assert got["partial_round_trip"] == [], f"rank {rank}: partial checkpoint round trip differs"
        assert got["hf_folder_into_tp2"] == [], f"rank {rank}: HF folder landed wrong in TP=2"
    got = results[0][name]
    for artifact in (f"{name}-full", f"{name}-offline"):
        assert got[f"{artifact}:class"] == mod.TRANSLATION.architecture  # config.json's architectures
        assert got[f"{artifact}:weights"] == [], f"{artifact}: weights differ after from_pretrained"
        assert got[f"{artifact}:logits_equal"], f"{artifact}: logits differ from the original model's"


def test_pipeline_stage_holding_its_own_head(results: list[dict]) -> None:
    for rank, per_rank in enumerate(results):
        got = per_rank["gpt2 pp=2"]
        assert got["hf_folder_into_pp2"] == [], f"rank {rank}: HF folder landed wrong in PP=2"
        assert got["partial_round_trip"] == [], f"rank {rank}"
    assert results[0]["gpt2 pp=2"]["pp-full:logits_equal"]

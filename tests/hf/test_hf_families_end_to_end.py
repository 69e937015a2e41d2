"""Every Hugging Face family end to end on two real gloo ranks: HF model -> our TP=2 shards -> partial
checkpoint -> full HF artifact (online and offline) -> ``from_pretrained`` gives the original model's
logits exactly, and a bf16 export's ``config.json`` says bfloat16 whatever the config given said; a
sharded ``save_pretrained`` folder loads into TP=2 bit-exact; a folder whose heads differ from their
embeddings is refused by a model tying them, naming both keys, until ``keep_tied`` picks the head;
another family's translation is refused on export and import; GPT-2 over two pipeline stages, whose
last holds its own copy of the tied head, loads from a folder that leaves it out; and a GPT-2 whose head
is tied to its DTensor embedding after ``parallelize_module`` writes what the plain model writes. One
world for all eight families (spawning ranks costs more than a family's work)."""

from __future__ import annotations

import os

import pytest
import torch
from dist_harness import run_world
from hf_family_workers import SEED, families, untied_model
from hf_reference import MODULES, tiny_model
from safetensors.torch import load_file

pytestmark = pytest.mark.dist

NAMES = sorted(MODULES)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    hf_root = tmp_path_factory.mktemp("pretrained")
    for name in NAMES:  # sharded folders, as large models come
        tiny_model(name, seed=SEED, dtype=torch.float32).save_pretrained(hf_root / name, max_shard_size="20KB")
        assert (hf_root / name / "model.safetensors.index.json").exists()
        untied_model(name).save_pretrained(hf_root / f"{name}-untied")  # heads of their own, not the embeddings
    root = tmp_path_factory.mktemp("ckpt")
    out = run_world(families, 2, str(root), str(hf_root), NAMES, timeout=480)
    out[0]["gpt2 dtensor:root"] = os.path.join(str(root), "dtensor")
    return out


@pytest.mark.parametrize("name", NAMES)
def test_family_end_to_end(results: list[dict], name: str) -> None:
    mod = MODULES[name]
    for rank, per_rank in enumerate(results):
        got = per_rank[name]
        assert got["partial_round_trip"] == [], f"rank {rank}: partial checkpoint round trip differs"
        assert got["hf_folder_into_tp2"] == [], f"rank {rank}: HF folder landed wrong in TP=2"
        assert got["hf_names_artifact_into_tp2"] == [], f"rank {rank}: our HF-names artifact landed wrong in TP=2"
    got = results[0][name]
    for artifact in (f"{name}-full", f"{name}-offline"):
        assert got[f"{artifact}:class"] == mod.TRANSLATION.architecture  # config.json's architectures
        assert got[f"{artifact}:weights"] == [], f"{artifact}: weights differ after from_pretrained"
        assert got[f"{artifact}:logits_equal"], f"{artifact}: logits differ from the original model's"


@pytest.mark.parametrize("name", NAMES)
def test_family_bf16_export_says_bfloat16_in_config_json(results: list[dict], name: str) -> None:
    got = results[0][name]
    assert got["bf16:config_dtype"] == "bfloat16"  # the config given said float32
    assert got["bf16:model_dtype"] == torch.bfloat16
    assert got["bf16:weights"] == []


@pytest.mark.parametrize("name", NAMES)
def test_family_head_differing_from_its_embedding_is_refused_by_a_tied_model(results: list[dict], name: str) -> None:
    for rank, per_rank in enumerate(results):
        got = per_rank[name]["tie_mismatch"]
        assert got["heads"], "every family ties a head"
        assert got["refused"].startswith("LayoutMismatch"), (rank, got["refused"])
        named = [(h, e) for h, e in got["heads"].items() if f"'model.{h}'" in got["refused"]]
        assert named and f"'model.{named[0][1]}'" in got["refused"], got["refused"]  # a head and its tensor
        assert got["kept_heads"] == [], f"rank {rank}: keep_tied did not load the heads"
        assert got["still_tied"]


@pytest.mark.parametrize("name", NAMES)
def test_family_refuses_another_familys_translation(results: list[dict], name: str) -> None:
    for per_rank in results:
        got = per_rank[name]["wrong_translation"]
        other = got["other"]
        assert got["export"].startswith("SpecError") and f"translation '{other}'" in got["export"], got["export"]
        assert f"{name}'s" in got["export"], got["export"]  # names the family the tensors are
        assert got["import"].startswith("LayoutMismatch") and f"translation '{other}'" in got["import"], got["import"]
        assert got["written"] == [], got["written"]


def test_pipeline_stage_holding_its_own_head(results: list[dict]) -> None:
    for rank, per_rank in enumerate(results):
        got = per_rank["gpt2 pp=2"]
        assert got["hf_folder_into_pp2"] == [], f"rank {rank}: HF folder landed wrong in PP=2"
        assert got["partial_round_trip"] == [], f"rank {rank}"
    assert results[0]["gpt2 pp=2"]["pp-full:logits_equal"]


def _artifact(folder: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def test_dtensor_model_with_a_tied_head_writes_what_the_plain_model_writes(results: list[dict]) -> None:
    for rank, per_rank in enumerate(results):
        got = per_rank["gpt2 dtensor"]
        assert got["resumed"] == [] and got["still_tied"], rank
    root = results[0]["gpt2 dtensor:root"]
    plain, dtensor = _artifact(os.path.join(root, "plain")), _artifact(os.path.join(root, "dtensor"))
    assert "lm_head.weight" not in plain  # as save_pretrained writes a tied GPT-2
    assert sorted(dtensor) == sorted(plain) == sorted(results[0]["gpt2 dtensor"]["want"])
    for key, want in results[0]["gpt2 dtensor"]["want"].items():
        assert torch.equal(plain[key], want) and torch.equal(dtensor[key], want), key

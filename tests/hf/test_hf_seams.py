"""Every Hugging Face family where our exports meet transformers (tier 1, one process): a TP=1 model in
our names exports with a translation and no specs (the model's fused shapes are the view's merged), and
loads back into TP=1 and TP=2. A translation that does not fit: ``test_hf_misfit.py``; an untranslated artifact
read through a translation and the wrong-family judgement: ``test_hf_as_is.py`` (both split from this file), over
stages and PP jobs: ``test_hf_stages.py``."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_e2e_workers import Holder
from hf_reference import AUTO_CLASS, MODULES, global_view, shard_all, tiny_config, tiny_model
from hf_reference import differing_keys as _equal
from safetensors.torch import load_file
from sim import load_shards_and_check

import smpckpt
from smpckpt.tools.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

NAMES = sorted(MODULES)


def _artifact(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(str(folder / name)))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_tp1_model_in_our_names_exports_without_specs(tmp_path: Path, name: str) -> None:
    import transformers

    mod = MODULES[name]
    hf = tiny_model(name, seed=3, dtype=torch.float32)
    ours = mod.translate_hf_state_dict_to_smpckpt(hf.state_dict())  # TP=1: fused tensors in nn.Linear shape
    assert any(v.shape != global_view(name, hf)[k].shape for k, v in ours.items())  # some are fused views
    model = Holder({k: v.clone() for k, v in ours.items()})
    root = str(tmp_path / "run")
    kw: dict[str, Any] = dict(translate_function=mod.TRANSLATION, hf_config=tiny_config(name))
    smpckpt.save_checkpoint(root, "full", partial=False, model=model, **kw)
    want = {k: v for k, v in hf.state_dict().items() if k in _artifact(tmp_path / "run" / "full")}
    assert _equal(_artifact(tmp_path / "run" / "full"), want) == []
    back = getattr(transformers, AUTO_CLASS[name]).from_pretrained(tmp_path / "run" / "full")
    assert _equal(back.state_dict(), hf.state_dict()) == []
    # offline, from the command line, which cannot take specs: the same artifact
    smpckpt.save_checkpoint(root, "p", model=model, save_rng=False)
    out = tmp_path / "off"
    rc = main(
        ["consolidate", os.path.join(root, "p"), str(out), "--translation", name, "--no-progress"], stdout=io.StringIO()
    )
    assert rc == 0
    assert _equal(_artifact(out), _artifact(tmp_path / "run" / "full")) == []
    # and back: into the TP=1 model without specs, and into TP=2 under the family's specs
    again = Holder({k: torch.zeros_like(v) for k, v in ours.items()})
    smpckpt.resume_from_checkpoint(root, "full", partial=False, model=again)
    assert _equal({k: p.detach() for k, p in again.named_parameters()}, ours) == []
    shards = shard_all(name, global_view(name, hf), 2, hf.config)
    load_shards_and_check(str(out), shards, mod.tp_specs(2, hf.config, prefix="model."), optional=["user_content"])


@pytest.mark.parametrize("name", NAMES)
def test_hf_folder_loads_into_a_tp1_model_in_our_names_without_specs(tmp_path: Path, name: str) -> None:
    mod = MODULES[name]
    hf = tiny_model(name, seed=4, dtype=torch.float32)
    hf.save_pretrained(tmp_path / "hf")
    ours = mod.translate_hf_state_dict_to_smpckpt(hf.state_dict())
    model = Holder({k: torch.zeros_like(v) for k, v in ours.items()})
    smpckpt.resume_from_checkpoint(str(tmp_path / "hf"), partial=False, model=model, translate_function=mod.TRANSLATION)
    assert _equal({k: p.detach() for k, p in model.named_parameters()}, ours) == []


def _tied_in_memory(name: str, hf: Any) -> Holder:
    """Our TP=1 model of ``hf`` holding each tied head as its embedding's very tensor, as HF ties them."""
    mod = MODULES[name]
    model = Holder(
        {
            k: v.clone()
            for k, v in mod.translate_hf_state_dict_to_smpckpt(hf.state_dict(), tie_word_embeddings=False).items()
        }
    )
    for head, embed in mod.TRANSLATION.tied.items():
        *path, leaf = head.split(".")
        owner = model.get_submodule(".".join(path))
        setattr(owner, leaf, model.get_parameter(embed))
    return model


@pytest.mark.parametrize("name", NAMES)
def test_online_and_offline_full_saves_leave_tied_heads_out_as_save_pretrained(tmp_path: Path, name: str) -> None:
    mod = MODULES[name]
    hf = tiny_model(name, seed=5, dtype=torch.float32, tie_word_embeddings=True)
    hf.save_pretrained(tmp_path / "sp")
    pretrained = _artifact(tmp_path / "sp")
    assert set(mod.TRANSLATION.tied) & set(hf.state_dict()) and not set(mod.TRANSLATION.tied) & set(pretrained)
    ours = _tied_in_memory(name, hf)
    cfg = hf.config.to_dict()
    root = str(tmp_path / "run")
    for tag, model, translation in (("hf", hf, None), ("ours", ours, mod.TRANSLATION)):
        for untied in (False, True):
            config = {**cfg, "tie_word_embeddings": False} if untied else cfg
            full, off = f"{tag}-{untied}", tmp_path / f"{tag}-{untied}-off"
            smpckpt.save_checkpoint(
                root, full, partial=False, model=model, translate_function=translation, hf_config=config
            )
            smpckpt.save_checkpoint(root, tag, model=model, save_rng=False, overwrite=True)
            smpckpt.consolidate_checkpoint(
                os.path.join(root, tag), off, translation=translation, hf_config=config, progress=False
            )
            online, offline = _artifact(tmp_path / "run" / full), _artifact(off)
            assert _equal(online, offline) == [], (tag, untied)
            want = hf.state_dict() if untied else pretrained  # an untied config gets every key
            assert _equal(online, {k: v for k, v in want.items() if k in online}) == [] and set(online) == set(want), (
                tag,
                untied,
            )

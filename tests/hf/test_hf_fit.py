"""What a Hugging Face export must not write silently (one process, real transformers models): an adapter's
state or PEFT's wrapping anywhere in the tensors (transformers drops it on load, the model loading without
the adapter), tensors GPT-J's and GPT-Neo's models never have, and the eager helpers held to the same fit
checks as the online export and ``consolidate``."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_e2e_workers import Holder
from hf_reference import AUTO_CLASS, MODULES, tiny_model

import smpckpt
from smpckpt.hf import check_translation
from smpckpt.model.translation import Translation
from smpckpt.tools.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

_Q = "model.layers.0.self_attn.q_proj."  # a module no Llama rule touches


def _no_safetensors(folder: str) -> bool:
    return not os.path.isdir(folder) or not [n for n in os.listdir(folder) if n.endswith(".safetensors")]


def _peft(state: dict[str, torch.Tensor], how: str) -> dict[str, torch.Tensor]:
    """``state`` as PEFT's LoRA/DoRA would hold it around ``q_proj`` (and the embedding), as ``how`` says."""
    out = dict(state)
    w = out[_Q + "weight"]
    if how == "lora":  # PEFT's saved names, the adapter name stripped
        out[_Q + "lora_A.weight"] = torch.randn(4, w.shape[1])
        out[_Q + "lora_B.weight"] = torch.randn(w.shape[0], 4)
    elif how == "lora_default":  # a PeftModel's own state dict: the adapter name kept
        out[_Q + "lora_A.default.weight"] = torch.randn(4, w.shape[1])
    elif how == "dora":
        out[_Q + "lora_magnitude_vector"] = torch.randn(w.shape[0])
    elif how == "embedding":
        out["model.embed_tokens.lora_embedding_A.default"] = torch.randn(4, 96)
    elif how == "base_layer":  # the wrapped module's own weight, which from_pretrained reads nowhere
        out[_Q + "base_layer.weight"] = out.pop(_Q + "weight")
    elif how == "ia3":  # PEFT's other tuners (rev70b M2): IA3's and LoKr's saved names
        out[_Q + "ia3_l"] = torch.ones(w.shape[0], 1)
    elif how == "lokr":
        out[_Q + "lokr_w1"] = torch.randn(2, 2)
    return out


HOWS = ["lora", "lora_default", "dora", "embedding", "base_layer", "ia3", "lokr"]


@pytest.mark.parametrize("how", HOWS)
def test_adapter_state_under_an_untouched_module_is_refused_on_hf_export(tmp_path: Path, how: str) -> None:
    """An adapter's state (or PEFT's ``base_layer`` wrapping) under a module no rule touches was written
    as it was, and ``from_pretrained`` dropped it: the model loaded without the adapter. Refused by key, with
    the count, online with a translation, online in HF names under a config, and by ``consolidate``."""
    hf = tiny_model("llama", seed=1, dtype=torch.float32)
    ours = MODULES["llama"].translate_hf_state_dict_to_smpckpt(hf.state_dict())
    adapted = {name: _peft(sd, how) for name, sd in (("ours", ours), ("hf", hf.state_dict()))}
    keys = [k for k in adapted["ours"] if k not in ours]
    match = rf"{re.escape(repr(keys[0]))}.*\({len(keys)} tensors?\).*merge_and_unload\(\)"
    root = str(tmp_path / "run")
    translation = MODULES["llama"].TRANSLATION
    with pytest.raises(smpckpt.SpecError, match=match):
        smpckpt.save_checkpoint(root, "a", partial=False, model=Holder(adapted["ours"]), translate_function=translation)
    with pytest.raises(smpckpt.SpecError, match=match):  # in HF names, without a translation
        smpckpt.save_checkpoint(root, "b", partial=False, model=Holder(adapted["hf"]), hf_config=hf.config)
    assert _no_safetensors(os.path.join(root, "a")) and _no_safetensors(os.path.join(root, "b"))
    smpckpt.save_checkpoint(root, "p", model=Holder(adapted["ours"]), save_rng=False)
    err = io.StringIO()
    argv = ["consolidate", os.path.join(root, "p"), str(tmp_path / "off"), "--translation", "llama", "--no-progress"]
    assert main(argv, stdout=io.StringIO(), stderr=err) == 1
    assert re.search(match, err.getvalue()), err.getvalue()
    with pytest.raises(smpckpt.SpecError, match=match):  # the eager helper too
        MODULES["llama"].translate_state_dict_to_hf(adapted["ours"])


def test_a_full_save_in_our_own_names_keeps_adapter_state(tmp_path: Path) -> None:
    """Without a translation or a config the artifact is no Hugging Face folder but our own full checkpoint
    (a LoRA run resumes from it): its adapter state is written and read back bit-exact."""
    ours = _peft(MODULES["llama"].translate_hf_state_dict_to_smpckpt(tiny_model("llama", seed=1).state_dict()), "lora")
    smpckpt.save_checkpoint(str(tmp_path), "f", partial=False, model=Holder({k: v.clone() for k, v in ours.items()}))
    back = Holder({k: torch.zeros_like(v) for k, v in ours.items()})
    smpckpt.resume_from_checkpoint(str(tmp_path), "f", partial=False, model=back)
    got = {k: p.detach() for k, p in back.named_parameters()}
    assert set(got) == set(ours) and all(torch.equal(got[k], ours[k]) for k in ours)


def test_adapter_names_are_peft_module_names_not_substrings() -> None:
    """Only a dotted component that is one of PEFT's names counts: a real parameter whose name merely
    contains ``lora`` (``flora_A``, ``lora_Ab``, ``exploration``) is not refused."""
    from smpckpt.model.translation import adapter_keys

    keys = [
        "model.layers.0.self_attn.flora_A.weight",
        "model.layers.0.self_attn.q_proj.lora_Ab",
        "model.exploration.lora.weight",
        "model.layers.0.base_layers.weight",
        "model.layers.0.self_attn.q_proj.lora_A_scale",
    ]
    assert adapter_keys(keys) == []
    peft = [_Q + "lora_A.weight", _Q + "lora_B.default.weight", _Q + "lora_E.default", _Q + "base_layer.bias"]
    peft += ["model.embed_tokens.lora_embedding_B.default", _Q + "lora_magnitude_vector.default.weight"]
    peft += ["lm_head.modules_to_save.default.weight", "lm_head.original_module.weight"]
    assert adapter_keys(keys + peft) == peft
    ours = MODULES["llama"].translate_hf_state_dict_to_smpckpt(tiny_model("llama", seed=1).state_dict())
    shapes = {k: tuple(v.shape) for k, v in ours.items()} | {k: (4,) for k in keys}
    check_translation(MODULES["llama"].TRANSLATION, shapes, "ours")


def test_a_model_of_ones_own_may_hold_pefts_modules(tmp_path: Path) -> None:
    """A model whose own ``__init__`` builds PEFT's modules (Phi-4-multimodal's remote code calls
    ``get_peft_model``) reads ``base_layer``/``lora_A`` back in ``from_pretrained``: under a config of a family
    smpckpt does not know it is written as it is (rev70b M1: refused), read back bit-exact; under a family it
    knows, with a translation that has no rules of its own, it is refused (rev70b L2)."""
    state = {
        "model.q_proj.base_layer.weight": torch.randn(8, 8),
        "model.q_proj.lora_A.vision.weight": torch.randn(2, 8),
    }
    smpckpt.save_checkpoint(
        str(tmp_path),
        "own",
        partial=False,
        model=Holder({k: v.clone() for k, v in state.items()}),
        hf_config={"model_type": "mymm"},
    )
    back = Holder({k: torch.zeros_like(v) for k, v in state.items()})
    smpckpt.resume_from_checkpoint(str(tmp_path), "own", partial=False, model=back)
    got = {k: p.detach() for k, p in back.named_parameters()}
    assert set(got) == set(state) and all(torch.equal(got[k], state[k]) for k in state)
    hf = tiny_model("llama", seed=1, dtype=torch.float32)
    ruleless = Translation("mine", tied=dict(MODULES["llama"].TRANSLATION.tied))
    with pytest.raises(smpckpt.SpecError, match=r"lora_A\.weight.*merge_and_unload"):
        smpckpt.save_checkpoint(
            str(tmp_path),
            "r",
            partial=False,
            model=Holder(_peft(hf.state_dict(), "lora")),
            translate_function=ruleless,
            hf_config=hf.config,
        )


def test_eager_helpers_name_a_value_that_is_no_tensor() -> None:
    """A non-tensor value (an ``_extra_state``) is named by key, not an ``AttributeError`` (rev70b L1)."""
    ours = MODULES["llama"].translate_hf_state_dict_to_smpckpt(tiny_model("llama", seed=1).state_dict())
    with pytest.raises(TypeError, match=r"'model\.layers\.0\.mlp\._extra_state': expected a tensor, got NoneType"):
        MODULES["llama"].translate_state_dict_to_hf(ours | {"model.layers.0.mlp._extra_state": None})


# -- the eager helpers run the export's fit checks -------------------------------------------------------


def test_eager_export_refuses_what_the_online_export_refuses() -> None:
    """``translate_state_dict_to_hf`` returned a dict silently where the online export refuses: another
    family's tensors, a fused gate/up bias the family cannot hold, biases the family's model never has,
    and a Qwen2 without its q/k/v biases (no config needed for these)."""
    llama_hf = tiny_model("llama", seed=1, dtype=torch.float32, attention_bias=True, mlp_bias=True).state_dict()
    llama = MODULES["llama"].translate_hf_state_dict_to_smpckpt(llama_hf)
    cases: list[tuple[str, dict[str, torch.Tensor], str]] = [
        ("gpt2", llama, r"translation 'gpt2' takes none of the"),
        ("mistral", llama, r"leaves 'model\.layers\.0\.mlp\.gate_up_proj\.bias'"),
        ("mistral", {k: v for k, v in llama.items() if "gate_up_proj.bias" not in k}, r"has no such tensors"),
    ]
    qwen2 = MODULES["qwen2"].translate_hf_state_dict_to_smpckpt(tiny_model("qwen2", seed=1).state_dict())
    bare = {k: v for k, v in qwen2.items() if not k.endswith("k_proj.bias")}
    cases.append(("qwen2", bare, r"always has q/k/v biases, but the tensors written lack"))
    for name, state, match in cases:
        with pytest.raises(smpckpt.SpecError, match=match):
            MODULES[name].translate_state_dict_to_hf(state)
    # the family's own state translates, bit-exact (the checks refuse nothing it holds)
    back = MODULES["llama"].translate_state_dict_to_hf(llama)
    assert set(back) == set(llama_hf) and all(torch.equal(back[k], llama_hf[k]) for k in back)


def test_eager_import_refuses_what_loading_a_folder_refuses() -> None:
    """``translate_hf_state_dict_to_smpckpt`` ran none of the checks loading a folder runs: a Llama with
    biases read as Mistral would keep biases a Mistral never has; another family's tensors went through
    unchanged."""
    llama_hf = tiny_model("llama", seed=1, dtype=torch.float32, attention_bias=True).state_dict()
    with pytest.raises(smpckpt.SpecError, match=r"'model\.layers\.0\.self_attn\.q_proj\.bias'.* never holds"):
        MODULES["mistral"].translate_hf_state_dict_to_smpckpt(llama_hf)
    with pytest.raises(smpckpt.SpecError, match=r"translation 'gptj' takes none of the"):
        MODULES["gptj"].translate_hf_state_dict_to_smpckpt(tiny_model("llama", seed=1).state_dict())


# -- GPT-J and GPT-Neo: tensors their models never have --------------------------------------------------

ABSENT = {
    "gptj": [f"transformer.h.1.attn.{p}_proj.bias" for p in ("q", "k", "v", "out")]
    + ["transformer.wpe.weight", "transformer.h.0.ln_2.weight", "transformer.h.0.ln_2.bias"],
    "gpt_neo": [f"transformer.h.1.attn.attention.{p}_proj.bias" for p in "qkv"] + ["lm_head.bias"],
}


@pytest.mark.parametrize("name", sorted(ABSENT))
def test_tensors_gptj_and_gptneo_never_have_are_refused(tmp_path: Path, name: str) -> None:
    """GPT-J's attention has no biases, no ``ln_2`` and no position embedding; GPT-Neo's q/k/v and its
    head have no bias (modeling_gptj.py, modeling_gpt_neo.py): such a tensor would be dropped on load.
    Refused by name on export and import, with the translation or by the config's ``model_type``."""
    hf = tiny_model(name, seed=1, dtype=torch.float32)
    ours = MODULES[name].translate_hf_state_dict_to_smpckpt(hf.state_dict())
    for key in ABSENT[name]:
        extra = {key: torch.randn(32)}
        for side, state in (("ours", ours), ("artifact", hf.state_dict())):
            shapes = {k: tuple(v.shape) for k, v in {**state, **extra}.items()}
            with pytest.raises(
                smpckpt.SpecError, match=rf"{re.escape(repr(key))}.*(no such tensors|never holds|as they are)"
            ):
                check_translation(MODULES[name].TRANSLATION, shapes, side)
        with pytest.raises(smpckpt.SpecError, match=rf"has no tensors {re.escape(repr(key))}"):
            smpckpt.save_checkpoint(
                str(tmp_path), "x", partial=False, model=Holder({**hf.state_dict(), **extra}), hf_config=hf.config
            )
        assert _no_safetensors(str(tmp_path / "x"))


@pytest.mark.parametrize("name", sorted(ABSENT))
def test_a_real_gptj_or_gptneo_round_trips_under_its_absent_list(tmp_path: Path, name: str) -> None:
    """A real model's every tensor (tiny config, random init) exports with the translation and without one,
    and ``from_pretrained`` reads each back bit-exact: the absent list refuses nothing the model holds."""
    import transformers

    hf = tiny_model(name, seed=2, dtype=torch.float32)
    want = hf.state_dict()
    ours = MODULES[name].translate_hf_state_dict_to_smpckpt(want)
    kw: dict[str, Any] = dict(partial=False, hf_config=hf.config)
    smpckpt.save_checkpoint(str(tmp_path), "t", model=Holder(ours), translate_function=MODULES[name].TRANSLATION, **kw)
    smpckpt.save_checkpoint(str(tmp_path), "h", model=hf, **kw)
    for tag in ("t", "h"):
        back = getattr(transformers, AUTO_CLASS[name]).from_pretrained(str(tmp_path / tag)).state_dict()
        assert set(back) == set(want), sorted(set(back) ^ set(want))
        assert [k for k in want if not torch.equal(back[k], want[k])] == []

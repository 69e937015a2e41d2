"""Every Hugging Face family where our exports meet transformers (tier 1, one process): a TP=1 model in
our names exports with a translation and no specs (the model's fused shapes are the view's merged), and
loads back into TP=1 and TP=2."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_e2e_workers import Holder
from hf_reference import AUTO_CLASS, MODULES, global_view, shard_all, tiny_config, tiny_model
from safetensors.torch import load_file
from sim import load_shards_and_check

import smpckpt
from smpckpt.api.options import ExportOptions
from smpckpt.hf.llama import make_translation
from smpckpt.tools.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

NAMES = sorted(MODULES)


def _artifact(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(str(folder / name)))
    return out


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys missing from either side or whose tensors differ (bit-exact, dtype included)."""
    return sorted(
        k
        for k in set(a) | set(b)
        if k not in a or k not in b or a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])
    )


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


# -- a translation that does not fit ------------------------------------------------------------------


@pytest.fixture(scope="module")
def states() -> dict[str, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    """Each family's (HF state dict, ours at TP=1)."""
    out = {}
    for name in NAMES:
        hf = tiny_model(name, seed=1, dtype=torch.float32).state_dict()
        out[name] = (hf, MODULES[name].translate_hf_state_dict_to_smpckpt(hf))
    return out


def _same_rules(a: str, b: str) -> bool:
    """Families of one layout: one's rules hold the other's (Llama's add the gate/up bias Mistral's lack)."""

    def templates(name: str) -> set[tuple[str, tuple[str, ...]]]:
        return {(r.ours, r.artifact) for r in MODULES[name].TRANSLATION.rules}

    return templates(a) <= templates(b) or templates(b) <= templates(a)


@pytest.mark.parametrize("model", NAMES)
def test_each_familys_translation_fits_its_tensors_and_no_other_familys(states: Any, model: str) -> None:
    """Every family's keys (HF's, and ours) pass its own translation and are refused by every other whose
    rules differ (Llama, Qwen2 and Mistral share theirs: the same layout), and by Mistral's for Qwen2's
    q/k/v biases, which a MistralForCausalLM does not have."""
    hf, ours = states[model]
    shapes_hf = {k: tuple(v.shape) for k, v in hf.items()}
    shapes_ours = {k: tuple(v.shape) for k, v in ours.items()}
    for name in NAMES:
        translation = MODULES[name].TRANSLATION
        if (name, model) == ("mistral", "qwen2"):
            for side, shapes in (("ours", shapes_ours), ("artifact", shapes_hf)):
                with pytest.raises(smpckpt.SpecError, match=r"translation 'mistral': 'model\.layers\.0\.self_attn\.q_"):
                    smpckpt.hf.check_translation(translation, shapes, side)
            continue
        if name == model or _same_rules(name, model):
            smpckpt.hf.check_translation(translation, shapes_ours, "ours")
            smpckpt.hf.check_translation(translation, shapes_hf, "artifact")
            continue
        with pytest.raises(smpckpt.SpecError, match=rf"translation '{name}' (takes none|leaves)"):
            smpckpt.hf.check_translation(translation, shapes_ours, "ours")
        with pytest.raises(smpckpt.SpecError, match=rf"translation '{name}' (takes none|leaves)"):
            smpckpt.hf.check_translation(translation, shapes_hf, "artifact")


def test_consolidate_with_another_familys_translation_fails_and_writes_nothing(tmp_path: Path, states: Any) -> None:
    _, ours = states["gptj"]
    root = str(tmp_path / "run")
    smpckpt.save_checkpoint(root, "j", model=Holder({k: v.clone() for k, v in ours.items()}), save_rng=False)
    err = io.StringIO()
    rc = main(
        ["consolidate", os.path.join(root, "j"), str(tmp_path / "out"), "--translation", "gpt_neo", "--no-progress"],
        stdout=io.StringIO(),
        stderr=err,
    )
    assert rc == 1
    assert "translation 'gpt_neo' takes none" in err.getvalue() and "attn.qkv_proj.weight" in err.getvalue()
    assert "gptj's" in err.getvalue()
    assert not (tmp_path / "out").exists() or not [
        n for n in os.listdir(tmp_path / "out") if n.endswith(".safetensors")
    ]


def test_full_save_refuses_a_translation_the_model_does_not_fit(tmp_path: Path, states: Any) -> None:
    root = str(tmp_path)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with pytest.raises(smpckpt.SpecError, match=r"translation 'gpt2' takes none of the 4 tensors"):
        smpckpt.save_checkpoint(root, "a", partial=False, model=model, translate_function=MODULES["gpt2"].TRANSLATION)
    _, llama = states["llama"]
    with pytest.raises(smpckpt.SpecError, match=r"takes none.*they are llama's"):
        smpckpt.save_checkpoint(
            root, "b", partial=False, model=Holder(llama), translate_function=MODULES["gpt2"].TRANSLATION
        )
    hf = tiny_model("gpt2", seed=1, dtype=torch.float32)  # HF names already
    with pytest.raises(smpckpt.SpecError, match=r"already have the artifact's \(Hugging Face\) names"):
        smpckpt.save_checkpoint(root, "c", partial=False, model=hf, translate_function=MODULES["gpt2"].TRANSLATION)
    _, gpt2 = states["gpt2"]
    wrapped = Holder({("module." + k if ".h.0." in k else k): v for k, v in gpt2.items()})  # half under a wrapper
    with pytest.raises(smpckpt.SpecError, match=r"without the prefix 'model\.module\.'|without the prefix 'module\.'"):
        smpckpt.save_checkpoint(root, "d", partial=False, model=wrapped, translate_function=MODULES["gpt2"].TRANSLATION)
    assert not [n for n in os.listdir(root) if n in "abcd"] or all(
        not os.listdir(os.path.join(root, n)) for n in "abcd" if os.path.isdir(os.path.join(root, n))
    )


def test_config_of_another_family_is_refused(tmp_path: Path, states: Any) -> None:
    _, gptj = states["gptj"]
    model = Holder({k: v.clone() for k, v in gptj.items()})
    with pytest.raises(ValueError, match=r"'gpt_neo' config but the translation is for 'gptj'"):
        smpckpt.save_checkpoint(
            str(tmp_path),
            "x",
            partial=False,
            model=model,
            translate_function=MODULES["gptj"].TRANSLATION,
            hf_config=tiny_config("gpt_neo"),
        )
    with pytest.raises(ValueError, match=r"architectures \['GPTNeoForCausalLM'\], which are not 'gptj' models"):
        smpckpt.consolidate_checkpoint(
            str(tmp_path / "none"),
            str(tmp_path / "out"),
            translation=MODULES["gptj"].TRANSLATION,
            hf_config={"architectures": ["GPTNeoForCausalLM"]},
        )


def test_hf_folder_of_another_family_is_refused(tmp_path: Path, states: Any) -> None:
    hf = tiny_model("gpt_neo", seed=1, dtype=torch.float32)
    hf.save_pretrained(tmp_path / "neo")
    _, gptj = states["gptj"]
    model = Holder({k: torch.zeros_like(v) for k, v in gptj.items()})
    with pytest.raises(smpckpt.LayoutMismatch, match=r"translation 'gptj' takes none.*gpt_neo's"):
        smpckpt.resume_from_checkpoint(
            str(tmp_path / "neo"),
            partial=False,
            model=model,
            translate_function=MODULES["gptj"].TRANSLATION,
            strict=False,
        )


def test_optimizer_state_is_translated_with_its_parameter(tmp_path: Path, states: Any) -> None:
    """optimizer.safetensors keys follow the translated parameters (``<HF key>.exp_avg`` in HF's
    layout), and the artifact resumes both back bit-exact."""
    mod = MODULES["gpt2"]
    _, ours = states["gpt2"]

    def trained() -> tuple[Holder, torch.optim.Optimizer]:
        model = Holder({k: v.clone() for k, v in ours.items()})
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for p in model.parameters():
            p.grad = torch.sin(p.detach() * 3)
        opt.step()
        return model, opt

    model, opt = trained()
    smpckpt.save_checkpoint(
        str(tmp_path),
        "f",
        partial=False,
        model=model,
        optimizer=opt,
        include_optimizer=True,
        translate_function=mod.TRANSLATION,
    )
    saved = load_file(str(tmp_path / "f" / "optimizer.safetensors"))
    exp_avg = {k: opt.state[p]["exp_avg"] for k, p in model.named_parameters()}
    want = mod.translate_state_dict_to_hf(exp_avg)
    assert _equal({k.removesuffix(".exp_avg"): v for k, v in saved.items() if k.endswith(".exp_avg")}, want) == []
    fresh, fresh_opt = trained()
    for p in fresh.parameters():
        p.data.zero_()
        fresh_opt.state[p]["exp_avg"].zero_()
    smpckpt.resume_from_checkpoint(str(tmp_path), "f", partial=False, model=fresh, optimizer=fresh_opt)
    assert (
        _equal(
            {k: p.detach() for k, p in fresh.named_parameters()}, {k: p.detach() for k, p in model.named_parameters()}
        )
        == []
    )
    assert _equal({k: fresh_opt.state[p]["exp_avg"] for k, p in fresh.named_parameters()}, exp_avg) == []


class _CountedShapes(dict):  # type: ignore[type-arg]
    """Shapes that count the walks over all of them."""

    walks = 0

    def items(self) -> Any:
        type(self).walks += 1
        return super().items()


@pytest.mark.parametrize("side", ["ours", "artifact"])
def test_checking_a_translation_walks_the_shapes_a_few_times_not_once_per_key(side: str) -> None:
    # each key's rule lookup copied every shape: an export of 1,000 Llama layers (8,003 keys) spent 32 CPU-s
    # there (250 layers: 2.4 s), the check being quadratic in the keys
    from smpckpt.hf import TRANSLATIONS
    from smpckpt.model.translation import check_translates

    ours = {f"model.layers.{i}.mlp.gate_up_proj.weight": (8, 4) for i in range(200)}
    ours.update({f"model.layers.{i}.self_attn.q_proj.weight": [4, 4] for i in range(200)})
    theirs = {f"model.layers.{i}.mlp.{p}_proj.weight": (4, 4) for i in range(200) for p in ("gate", "up")}
    _CountedShapes.walks = 0
    shapes = _CountedShapes(ours if side == "ours" else theirs)
    check_translates(smpckpt.hf.llama.TRANSLATION, shapes, side, TRANSLATIONS.values())
    assert _CountedShapes.walks <= 2, f"{_CountedShapes.walks} walks over the {len(shapes)} shapes"


def _one_sided_module(name: str, side: str) -> str:
    """Layer 0's module that ``name``'s rules name on ``side`` only (``"ours"``: a fused one such as
    Llama's ``mlp.gate_up_proj``; ``"artifact"``: one it fuses away, such as ``mlp.gate_proj``)."""
    rules = MODULES[name].TRANSLATION.rules
    ours = {r.ours.rpartition(".")[0] for r in rules}
    theirs = {t.rpartition(".")[0] for r in rules for t in r.artifact}
    return sorted((ours - theirs) if side == "ours" else (theirs - ours))[0].format(i=0)


@pytest.mark.parametrize("model", NAMES)
def test_a_tensor_left_under_a_module_the_target_lacks_is_refused(states: Any, model: str) -> None:
    """F6 in general: a tensor no rule takes, under a module the translation rewrites away (our fused
    ``gate_up_proj.bias`` before Llama's rule fused it), would be written where the other side's model never
    reads it. Every family refuses it by name, on export and on import; its optimizer state beside it
    too (scalar ``step`` counters of translated parameters keep their keys, as before)."""
    hf, ours = states[model]
    translation = MODULES[model].TRANSLATION
    for side, state in (("ours", ours), ("artifact", hf)):
        shapes = {k: tuple(v.shape) for k, v in state.items()}
        stray = _one_sided_module(model, side) + ".stray_bias"
        # (a name that is no weight or bias is refused as an adapter's state: test_adapter_state_...)
        with pytest.raises(smpckpt.SpecError, match=rf"translation '{model}'(: | leaves )'{re.escape(stray)}'"):
            smpckpt.hf.check_translation(translation, {**shapes, stray: (4,)}, side)
    shapes = {k: tuple(v.shape) for k, v in ours.items()}
    steps = {f"{k}.step": () for k in shapes}  # a translated parameter's scalar state keeps its key: fine
    smpckpt.hf.check_translation(translation, {**shapes, **steps}, "ours")


def test_a_gate_up_bias_is_refused_by_families_that_cannot_hold_it(states: Any) -> None:
    """Mistral and Qwen2 have no MLP biases (Llama's ``mlp_bias``): a fused ``gate_up_proj.bias`` exported
    with their translations would be written as gate/up biases their models ignore. And a Llama
    translation without the bias rule (the F6 gap) is refused too, not written under our fused key."""
    _, ours = states["llama"]
    shapes = {k: tuple(v.shape) for k, v in ours.items()}
    shapes["model.layers.1.mlp.gate_up_proj.bias"] = (2, 64)
    for name in ("mistral", "qwen2"):
        with pytest.raises(smpckpt.SpecError, match=r"leaves 'model\.layers\.1\.mlp\.gate_up_proj\.bias'"):
            smpckpt.hf.check_translation(MODULES[name].TRANSLATION, shapes, "ours")
    smpckpt.hf.check_translation(MODULES["llama"].TRANSLATION, shapes, "ours")
    weights_only = make_translation("llama", "LlamaForCausalLM")
    with pytest.raises(smpckpt.SpecError, match=r"leaves 'model\.layers\.1\.mlp\.gate_up_proj\.bias' as they are"):
        smpckpt.hf.check_translation(weights_only, shapes, "ours")
    hf = {k: tuple(v.shape) for k, v in states["llama"][0].items()}
    hf.update({f"model.layers.1.mlp.{p}_proj.bias": (64,) for p in ("gate", "up")})
    with pytest.raises(smpckpt.SpecError, match=r"leaves 'model\.layers\.1\.mlp\.gate_proj\.bias'"):
        smpckpt.hf.check_translation(weights_only, hf, "artifact")


def test_biases_the_familys_model_never_has_are_refused(states: Any) -> None:
    """A Llama with ``attention_bias`` / ``mlp_bias`` exported as Mistral (no biases) or Qwen2 (q/k/v
    biases only): ``from_pretrained`` would ignore the biases those models lack, so they are refused by
    name, on export and on import, and Llama's own translation takes them."""
    hf = tiny_model("llama", seed=1, dtype=torch.float32, attention_bias=True, mlp_bias=True).state_dict()
    hf = {k: v for k, v in hf.items() if not k.endswith(("gate_proj.bias", "up_proj.bias"))}  # no fused bias
    ours = MODULES["llama"].translate_hf_state_dict_to_smpckpt(hf)
    shapes = {side: {k: tuple(v.shape) for k, v in sd.items()} for side, sd in (("ours", ours), ("artifact", hf))}
    for side in ("ours", "artifact"):
        smpckpt.hf.check_translation(MODULES["llama"].TRANSLATION, shapes[side], side)
        with pytest.raises(
            smpckpt.SpecError, match=r"translation 'mistral': 'model\.layers\.0\.self_attn\.q_proj\.bias'"
        ):
            smpckpt.hf.check_translation(MODULES["mistral"].TRANSLATION, shapes[side], side)
        with pytest.raises(
            smpckpt.SpecError, match=r"translation 'qwen2': 'model\.layers\.0\.self_attn\.o_proj\.bias'"
        ):
            smpckpt.hf.check_translation(MODULES["qwen2"].TRANSLATION, shapes[side], side)
    no_o = {k: v for k, v in shapes["ours"].items() if "o_proj.bias" not in k}
    with pytest.raises(smpckpt.SpecError, match=r"'model\.layers\.0\.mlp\.down_proj\.bias'.* has no such tensors"):
        smpckpt.hf.check_translation(MODULES["qwen2"].TRANSLATION, no_o, "ours")


def test_llama_export_refuses_an_hf_config_whose_biases_differ_from_the_tensors(tmp_path: Path) -> None:
    """``hf_config`` builds the model ``from_pretrained`` fills: a Llama with ``attention_bias`` and
    ``mlp_bias`` tensors under a config without them would lose the biases (dropped as unexpected), and a
    config with them over a model without would get them freshly initialised. Refused before anything is
    written, online and by ``consolidate``; the model's own config exports, and loads back bit-exact."""
    import transformers

    hf = tiny_model("llama", seed=1, dtype=torch.float32, attention_bias=True, mlp_bias=True)
    ours = MODULES["llama"].translate_hf_state_dict_to_smpckpt(hf.state_dict())
    kw: dict[str, Any] = dict(partial=False, model=Holder(ours), translate_function=MODULES["llama"].TRANSLATION)
    root = str(tmp_path / "run")
    for tag, config, field in (
        ("a", tiny_config("llama"), "attention_bias=False"),  # neither bias
        ("b", {**tiny_config("llama").to_dict(), "attention_bias": True}, "mlp_bias=False"),  # a dict, mlp unset
    ):
        with pytest.raises(smpckpt.SpecError, match=rf"hf_config has {field}, but the tensors written hold 'model"):
            smpckpt.save_checkpoint(root, tag, hf_config=config, **kw)
        assert not os.path.isdir(os.path.join(root, tag)) or not [
            n for n in os.listdir(os.path.join(root, tag)) if n.endswith(".safetensors")
        ]
    plain = MODULES["llama"].translate_hf_state_dict_to_smpckpt(tiny_model("llama", seed=1).state_dict())
    with pytest.raises(smpckpt.SpecError, match=r"hf_config has mlp_bias=True, but the tensors written lack"):
        smpckpt.save_checkpoint(
            root,
            "c",
            partial=False,
            model=Holder(plain),
            translate_function=MODULES["llama"].TRANSLATION,
            hf_config=tiny_config("llama", mlp_bias=True),
        )
    smpckpt.save_checkpoint(root, "p", model=Holder(ours), save_rng=False)
    err = io.StringIO()
    config = tmp_path / "config.json"
    tiny_config("llama").to_json_file(str(config))
    argv = ["consolidate", os.path.join(root, "p"), str(tmp_path / "off"), "--translation", "llama"]
    assert main([*argv, "--hf-config", str(config), "--no-progress"], stdout=io.StringIO(), stderr=err) == 1
    assert "hf_config has attention_bias=False" in err.getvalue(), err.getvalue()
    smpckpt.save_checkpoint(root, "ok", hf_config=hf.config, **kw)
    back = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(root, "ok"))
    assert _equal(back.state_dict(), hf.state_dict()) == []


def test_an_export_without_translation_is_held_to_its_configs_biases_too(tmp_path: Path) -> None:
    """A ``LlamaForCausalLM`` already in Hugging Face's names exports without a translation (the README's
    path): its config's family (``model_type``) says which biases ``from_pretrained`` builds, as a
    translation's does. Bias tensors under a config without the flags would be dropped, and a Mistral
    config holds none: both refused, nothing written; the model's own config exports, bit-exact."""
    import transformers

    hf = tiny_model("llama", seed=1, dtype=torch.float32, attention_bias=True, mlp_bias=True)
    root = str(tmp_path / "run")
    mistral = {**tiny_config("llama").to_dict(), "model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    for tag, config, match in (
        ("a", tiny_config("llama"), r"hf_config has attention_bias=False, but the tensors written hold 'model"),
        ("b", {**tiny_config("llama").to_dict(), "attention_bias": True}, r"hf_config has mlp_bias=False.*hold"),
        ("c", mistral, r"a MistralForCausalLM has no tensors 'model\.layers\.0\.self_attn\.q_proj\.bias'"),
    ):
        with pytest.raises(smpckpt.SpecError, match=match):
            smpckpt.save_checkpoint(root, tag, partial=False, model=hf, hf_config=config)
        assert not os.path.isdir(os.path.join(root, tag)) or not [
            n for n in os.listdir(os.path.join(root, tag)) if n.endswith(".safetensors")
        ]
    smpckpt.save_checkpoint(root, "ok", partial=False, model=hf, hf_config=hf.config)
    back = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(root, "ok"))
    assert _equal(back.state_dict(), hf.state_dict()) == []


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_our_fused_names_exported_without_translation_are_refused(family: str) -> None:
    """rev69h M1: a model in smpckpt's fused layout exported without its translation under its family's config
    was written (``from_pretrained`` then initialised gate/up afresh), or, with ``mlp_bias``, refused with advice
    that went round in circles; now refused naming the fused keys and the translation to pass."""
    from smpckpt.hf import check_config_tensors

    layer = "model.layers.0."
    keys = [layer + f"self_attn.{p}_proj.weight" for p in "qkvo"] + [layer + "mlp.down_proj.weight"]
    for extra in ([], [layer + "mlp.gate_up_proj.bias"]):
        with pytest.raises(smpckpt.SpecError, match=rf"mlp\.gate_up_proj\.weight.*translation=smpckpt\.hf\.{family}"):
            check_config_tensors(None, {"model_type": family}, [*keys, layer + "mlp.gate_up_proj.weight", *extra])


def test_a_qwen2_export_lacking_its_qkv_biases_is_refused(tmp_path: Path) -> None:
    """Every ``Qwen2ForCausalLM`` has q/k/v biases: an export without them (a Llama exported as Qwen2)
    would load with freshly initialised ones. Refused, with or without ``hf_config``, by name."""
    hf = tiny_model("qwen2", seed=1, dtype=torch.float32)
    ours = MODULES["qwen2"].translate_hf_state_dict_to_smpckpt(hf.state_dict())
    bare = {k: v for k, v in ours.items() if not k.endswith("k_proj.bias")}
    kw: dict[str, Any] = dict(partial=False, model=Holder(bare), translate_function=MODULES["qwen2"].TRANSLATION)
    match = r"Qwen2ForCausalLM always has q/k/v biases, but the tensors written lack 'model\.layers\.0\.self_attn\.k_"
    for tag, config in (("a", tiny_config("qwen2")), ("b", None)):
        with pytest.raises(smpckpt.SpecError, match=match):
            smpckpt.save_checkpoint(str(tmp_path / "run"), tag, hf_config=config, **kw)
    hf_bare = {k: v for k, v in hf.state_dict().items() if not k.endswith("k_proj.bias")}
    with pytest.raises(smpckpt.SpecError, match=match):  # without a translation, by the config's model_type
        smpckpt.save_checkpoint(str(tmp_path / "run"), "c", partial=False, model=Holder(hf_bare), hf_config=hf.config)


@pytest.mark.parametrize(
    ("name", "side", "key"),
    [
        ("llama", "ours", "model.layers.0.mlp.gate_up_proj.lora_A.default.weight"),
        ("llama", "artifact", "model.layers.0.mlp.gate_proj.lora_B.weight"),
        ("gptj", "artifact", "transformer.h.0.attn.q_proj.lora_A.weight"),
        ("gpt2", "artifact", "transformer.h.0.attn.c_attn.lora_A.weight"),
    ],
)
def test_adapter_state_under_a_module_the_target_lacks_is_refused_as_adapter_state(
    name: str, side: str, key: str
) -> None:
    """LoRA's ``lora_A``/``lora_B`` (or a quantiser's state) under a module the translation fuses or splits
    has nowhere to go on the other side: refused, saying to merge or strip it, not that it is a bias."""
    from smpckpt.hf import check_translation

    hf = tiny_model(name, seed=1, dtype=torch.float32).state_dict()
    state = MODULES[name].translate_hf_state_dict_to_smpckpt(hf) if side == "ours" else hf
    shapes = {k: tuple(v.shape) for k, v in state.items()} | {key: (4, 8)}
    where = "export" if side == "ours" else "import"
    with pytest.raises(
        smpckpt.SpecError,
        match=rf"{re.escape(repr(key))} are no weight or bias of their module.*"
        rf"merge or strip adapters/quantisation state before {where}",
    ):
        check_translation(MODULES[name].TRANSLATION, shapes, side)


# -- an artifact of ours in Hugging Face names imports as a save_pretrained folder does --------------------
@pytest.mark.parametrize("name", NAMES)
def test_untranslated_hf_names_artifact_resumes_into_our_names_as_save_pretrained(tmp_path: Path, name: str) -> None:
    """A model already in HF names saved full without a translation (online, and consolidated offline) and
    resumed with the family's translate_function loads what its save_pretrained folder loads, bit-exact (the
    translation went unused on a committed artifact: our fused keys were "not in the checkpoint")."""
    mod = MODULES[name]
    hf = tiny_model(name, seed=7, dtype=torch.float32)
    hf.save_pretrained(tmp_path / "sp")
    root = str(tmp_path / "run")
    smpckpt.save_checkpoint(root, "full", partial=False, model=hf, hf_config=hf.config)
    smpckpt.save_checkpoint(root, "part", model=hf, save_rng=False)
    smpckpt.consolidate_checkpoint(os.path.join(root, "part"), tmp_path / "off", hf_config=hf.config, progress=False)
    want = mod.translate_hf_state_dict_to_smpckpt(hf.state_dict())
    for folder in (tmp_path / "sp", os.path.join(root, "full"), tmp_path / "off"):
        dst = Holder({k: torch.zeros_like(v) for k, v in want.items()})
        smpckpt.resume_from_checkpoint(str(folder), None, partial=False, model=dst, translate_function=mod.TRANSLATION)
        got = dst.state_dict()
        assert set(got) == set(want), folder
        assert all(torch.equal(got[k], want[k]) for k in want), (
            folder,
            [k for k in want if not torch.equal(got[k], want[k])],
        )


_WITH_OPTIMIZER = ExportOptions(include_optimizer=True)


def _hf_with_optimizer(name: str, root: Path) -> tuple[Any, str]:
    """A tiny HF model after one Adam step, saved full in its own names (no translation) with its optimizer."""
    hf = tiny_model(name, seed=7, dtype=torch.float32)
    opt = torch.optim.Adam(hf.parameters())
    sum(p.sum() for p in hf.parameters()).backward()
    opt.step()
    smpckpt.save_checkpoint(str(root), "full", partial=False, model=hf, optimizer=opt, options=_WITH_OPTIMIZER)
    return hf, str(root / "full")


_OPTIM_REFUSED = (
    r"written without a translate_function, its optimizer state is keyed by the Hugging Face parameter names it "
    r"was saved under, which translate_function \({}\) does not rename \(a fused parameter's state is several "
    r"tensors, each with its own step\): resume the model alone \(no optimizer=\) with translate_function, or "
    r"model and optimizer without translate_function into a model in the artifact's names \(asked for \d+ such "
    r"keys: optim\.state\."
)


@pytest.mark.parametrize("name", NAMES)
def test_untranslated_artifact_with_optimizer_state_loads_the_model_alone_with_a_translation(
    tmp_path: Path, name: str
) -> None:
    """Optimizer state beside the HF-names model (keyed by the HF parameters) does not stop a model-only load
    through the translation (it was refused outright), bit-exact; asking for the optimizer through it is
    refused by name, strict or not (skipped as optional, the optimizer would resume without it), untouched."""
    mod = MODULES[name]
    hf, url = _hf_with_optimizer(name, tmp_path)
    want = mod.translate_hf_state_dict_to_smpckpt(hf.state_dict())
    dst = Holder({k: torch.zeros_like(v) for k, v in want.items()})
    smpckpt.resume_from_checkpoint(url, None, partial=False, model=dst, translate_function=mod.TRANSLATION)
    got = dst.state_dict()
    assert set(got) == set(want) and [k for k in want if not torch.equal(got[k], want[k])] == []
    for strict in (True, False):
        dst = Holder({k: torch.zeros_like(v) for k, v in want.items()})
        opt = torch.optim.Adam(dst.parameters())
        sum(p.sum() for p in dst.parameters()).backward()
        opt.step()  # state of its own, which a refused load leaves as it was
        before = {k: v.clone() for k, v in dst.state_dict().items()}
        held = {n: {k: torch.as_tensor(v).clone() for k, v in opt.state[p].items()} for n, p in dst.named_parameters()}
        with pytest.raises(smpckpt.errors.LayoutMismatch, match=_OPTIM_REFUSED.format(mod.TRANSLATION.name)):
            smpckpt.resume_from_checkpoint(
                url, None, partial=False, model=dst, optimizer=opt, strict=strict, translate_function=mod.TRANSLATION
            )
        assert all(torch.equal(v, before[k]) for k, v in dst.state_dict().items())
        assert all(_same_state(opt.state[p], held[n]) for n, p in dst.named_parameters())


def test_untranslated_artifact_of_other_state_names_it_as_what_it_is(tmp_path: Path) -> None:
    """An artifact of another kind (an EMA copy, ``ema.``) beside the HF-names model: the model reads through
    the translation; asking for the EMA tensors is refused naming that artifact, not the optimizer."""
    from sim import sim_load, sim_save

    from smpckpt.model.layout import ParallelLayout
    from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner
    from smpckpt.storage import FsspecStorageReader, FullArtifactWriter, FullOptions

    mod = MODULES["llama"]
    sd = tiny_model("llama", seed=7, dtype=torch.float32).state_dict()
    full = FullOptions(artifacts={"model.": "model", "ema.": "ema"})
    saved = {"model": sd, "ema": {k: v + 1 for k, v in sd.items()}}
    sim_save(
        [saved],
        [ParallelSavePlanner(ParallelLayout(), rank=0)],
        [FullArtifactWriter(tmp_path, full=full, sync_files=False)],
    )
    want = mod.translate_hf_state_dict_to_smpckpt(sd)

    def load(asked: dict[str, Any]) -> None:
        reader = FsspecStorageReader(tmp_path, translation=mod.TRANSLATION, hf_prefix="model.")
        sim_load([asked], [ParallelLoadPlanner(ParallelLayout(), rank=0, allow_partial_load=True)], [reader])

    out = {"model": {k: torch.zeros_like(v) for k, v in want.items()}}
    load(out)
    assert [k for k in want if not torch.equal(out["model"][k], want[k])] == []
    ema = {k: torch.zeros_like(v) for k, v in sd.items()}
    with pytest.raises(
        smpckpt.errors.LayoutMismatch,
        match=r"written without a translate_function, its 'ema' artifact holds tensors under 'ema\.' \(not model "
        r"weights, nor optimizer state\), which translate_function \(llama\) does not rename: read them without "
        r"translate_function \(asked for 21 such keys: ema\.model\.",
    ):
        load({"ema": ema})
    assert all(not v.any() for v in ema.values())


#: a family whose translation is not the artifact's (Llama, Mistral and Qwen2 share names)
_WRONG = {"bert": "gpt2", "gpt2": "llama", "gpt_neo": "bert", "gptj": "roberta", "llama": "gpt2"}
_WRONG |= {"mistral": "gptj", "qwen2": "gpt_neo", "roberta": "qwen2"}
#: the key that names the artifact's family (one its rules fuse), and the family named
_NAMED = {"bert": "bert.encoder.layer.0.attention.self.query.weight", "gptj": "transformer.h.0.attn.k_proj.weight"}
_NAMED |= {"gpt2": "transformer.h.0.attn.c_attn.weight", "gpt_neo": "transformer.h.0.attn.attention.k_proj.weight"}
_NAMED |= {"roberta": "roberta.encoder.layer.0.attention.self.query.weight"}
_LLAMA = "llama or qwen2 or mistral", "model.layers.0.mlp.gate_proj.weight"


@pytest.mark.parametrize("name", NAMES)
def test_untranslated_artifact_read_with_another_familys_translation_names_the_family(
    tmp_path: Path, name: str
) -> None:
    """Another family's translation, whose rules take none of the artifact's HF names, is refused naming one
    key and the family whose names they are (it was "N keys are not in the checkpoint"), optimizer state or
    not; nothing loaded."""
    hf, url = _hf_with_optimizer(name, tmp_path)
    families, key = _LLAMA if name in ("llama", "mistral", "qwen2") else (name, _NAMED[name])
    wrong = MODULES[_WRONG[name]]
    want = wrong.translate_hf_state_dict_to_smpckpt(tiny_model(_WRONG[name], seed=7, dtype=torch.float32).state_dict())
    for strict in (True, False):
        dst = Holder({k: torch.zeros_like(v) for k, v in want.items()})
        with pytest.raises(
            smpckpt.errors.LayoutMismatch,
            match=rf"the artifact's names do not match translation '{wrong.TRANSLATION.name}' \(it takes none of "
            rf"its {len(hf.state_dict()) - len(_tied(hf))} model keys\): they are {families}'s Hugging Face names "
            rf"\('{re.escape(key)}'\): resume with that family's, smpckpt\.hf\.translation_for",
        ):
            smpckpt.resume_from_checkpoint(
                url, None, partial=False, model=dst, strict=strict, translate_function=wrong.TRANSLATION
            )
        assert all(not v.any() for v in dst.state_dict().values())


def _save_as_is(sd: dict[str, torch.Tensor], root: Path) -> tuple[Any, Any, str]:
    """``sd`` in a model after one Adam step, saved full as it is (no translation) with its optimizer."""
    model = Holder({k: v.clone() for k, v in sd.items()})
    opt = torch.optim.Adam(model.parameters())
    sum(p.sum() for p in model.parameters()).backward()
    opt.step()
    smpckpt.save_checkpoint(str(root), "full", partial=False, model=model, optimizer=opt, options=_WITH_OPTIMIZER)
    return model, opt, str(root / "full")


def _same_state(got: Any, want: Any) -> bool:
    return set(got) == set(want) and all(torch.equal(torch.as_tensor(got[k]), torch.as_tensor(want[k])) for k in want)


def _neo_ours() -> dict[str, torch.Tensor]:
    """A tiny GPT-Neo's tensors in our names (its head tied to the embedding: left out)."""
    mod = MODULES["gpt_neo"]
    ours = mod.translate_hf_state_dict_to_smpckpt(tiny_model("gpt_neo", seed=7, dtype=torch.float32).state_dict())
    ours.pop("lm_head.weight", None)
    return ours


#: untranslated artifacts that need no renaming, read through a translation (taking none of their names) as
#: they are: names no family takes; a GPT-Neo in our names without its attention (mlp.c_fc is GPT-2's Hugging
#: Face name); a nanoGPT-style model in GPT-2's Hugging Face names with a translation of one's own
_AS_IS = ("no_family", "gpt_neo_ours_no_attention", "gpt2_names_own_translation")


@pytest.mark.parametrize("case", _AS_IS)
def test_untranslated_artifact_no_translation_rule_takes_loads_as_it_is(tmp_path: Path, case: str) -> None:
    """Names no rule of the translation takes load as they are, model and optimizer, bit-exact, whichever
    family's rules take them on the other side (they were refused as another family's names)."""
    from smpckpt.model.translation import Translation, rename

    translation = MODULES["llama"].TRANSLATION
    if case == "no_family":
        sd = {"encoder.w": torch.randn(2, 3), "encoder.b": torch.randn(3)}
    elif case == "gpt_neo_ours_no_attention":
        sd, translation = {k: v for k, v in _neo_ours().items() if ".attn." not in k}, MODULES["gpt_neo"].TRANSLATION
    else:
        hf = tiny_model("gpt2", seed=7, dtype=torch.float32).state_dict()
        sd = {
            k: v for k, v in hf.items() if not k.endswith((".attn.bias", ".attn.masked_bias")) and k != "lm_head.weight"
        }
        translation = Translation("mine", rules=(rename("head.w", "head.weight"),))
    model, opt, url = _save_as_is(sd, tmp_path)
    dst = Holder({k: torch.zeros_like(v) for k, v in sd.items()})
    dopt = torch.optim.Adam(dst.parameters())
    smpckpt.resume_from_checkpoint(url, None, partial=False, model=dst, optimizer=dopt, translate_function=translation)
    assert [k for k, v in model.state_dict().items() if not torch.equal(dst.state_dict()[k], v)] == []
    saved = {n: opt.state[p] for n, p in model.named_parameters()}
    assert [n for n, p in dst.named_parameters() if not _same_state(dopt.state.get(p, {}), saved[n])] == []


def test_untranslated_artifact_of_another_family_in_our_names_names_it(tmp_path: Path) -> None:
    """A GPT-Neo in our names read with BERT's translation into a BERT: refused naming GPT-Neo (its fused
    qkv_proj), not GPT-2 (whose Hugging Face mlp.c_fc it holds), strict or not, nothing loaded; following the
    advice loads it bit-exact."""
    ours = _neo_ours()
    smpckpt.save_checkpoint(str(tmp_path), "full", partial=False, model=Holder({k: v.clone() for k, v in ours.items()}))
    url = str(tmp_path / "full")
    bert = MODULES["bert"]
    want = bert.translate_hf_state_dict_to_smpckpt(tiny_model("bert", seed=7, dtype=torch.float32).state_dict())
    for strict in (True, False):
        dst = Holder({k: torch.zeros_like(v) for k, v in want.items()})
        with pytest.raises(
            smpckpt.errors.LayoutMismatch,
            match=r"the artifact's names do not match translation 'bert' \(it takes none of its 26 model keys\): "
            r"they are gpt_neo's names in ours \(as its translation presents them\) "
            r"\('transformer\.h\.0\.attn\.attention\.qkv_proj\.weight'\): resume with that family's, "
            r"smpckpt\.hf\.translation_for\('gpt_neo'\), into a model of that family; 34 of our model keys are not "
            r"in it: model\.bert\.",
        ) as raised:
            smpckpt.resume_from_checkpoint(
                url, None, partial=False, model=dst, strict=strict, translate_function=bert.TRANSLATION
            )
        assert all(not v.any() for v in dst.state_dict().values())
    named = re.search(r"translation_for\('(\w+)'\)", str(raised.value))
    assert named is not None
    dst = Holder({k: torch.zeros_like(v) for k, v in ours.items()})
    advice = smpckpt.hf.translation_for(named.group(1))
    smpckpt.resume_from_checkpoint(url, None, partial=False, model=dst, translate_function=advice)
    assert [k for k, v in ours.items() if not torch.equal(dst.state_dict()[k], v)] == []


def test_untranslated_artifact_no_family_takes_says_so_when_our_keys_are_missing(tmp_path: Path) -> None:
    """Names no family here translates, read with Llama's translation into Llama in our names: strict, the
    missing keys' refusal says the names match no translation (they load as they are otherwise)."""
    mod = MODULES["llama"]
    want = mod.translate_hf_state_dict_to_smpckpt(tiny_model("llama", seed=7).state_dict())
    smpckpt.save_checkpoint(str(tmp_path), "own", partial=False, model=Holder({"encoder.w": torch.ones(2, 3)}))
    dst = Holder({k: torch.zeros_like(v) for k, v in want.items()})
    with pytest.raises(
        smpckpt.errors.LayoutMismatch,
        match=r"keys are not in the checkpoint: .*the artifact's names do not match translation 'llama' \(it takes "
        r"none of its 1 model keys, 'encoder\.w', \.\.\., as Hugging Face names or ours\); nor are they any "
        r"family's of smpckpt\.hf: resume without translate_function into a model in its names",
    ):
        smpckpt.resume_from_checkpoint(
            str(tmp_path / "own"), None, partial=False, model=dst, translate_function=mod.TRANSLATION
        )


def _tied(hf: Any) -> list[str]:
    """The keys of ``hf``'s state dict that are another's tensor (saved once)."""
    seen: dict[int, str] = {}
    return [k for k, v in hf.state_dict(keep_vars=True).items() if seen.setdefault(id(v), k) != k]


@pytest.mark.parametrize("name", NAMES)
def test_untranslated_artifact_in_our_names_reads_as_it_is_with_a_translation(tmp_path: Path, name: str) -> None:
    """A model in our names saved without a translation holds our keys already: a translate_function taking none
    of them leaves them as they are (GPT-Neo's our-names MLP keys are GPT-2's HF names: not refused as GPT-2's)."""
    mod = MODULES[name]
    want = mod.translate_hf_state_dict_to_smpckpt(tiny_model(name, seed=7, dtype=torch.float32).state_dict())
    smpckpt.save_checkpoint(str(tmp_path), "ours", partial=False, model=Holder({k: v.clone() for k, v in want.items()}))
    dst = Holder({k: torch.zeros_like(v) for k, v in want.items()})
    smpckpt.resume_from_checkpoint(
        str(tmp_path / "ours"), None, partial=False, model=dst, translate_function=mod.TRANSLATION
    )
    got = dst.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def _stage_of(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sd`` less its second layer and final norm (a pipeline stage's keys), plus a new head it lacks."""
    stage = {k: torch.zeros_like(v) for k, v in sd.items() if not re.search(r"(layers|h|layer)\.1\.|ln_f\.", k)}
    return {**stage, "score.weight": torch.zeros(3)}


#: a stage (a cut-down model) with a new head, strict=False, of an untranslated artifact whose keys it does not
#: all ask for: nanoGPT in GPT-2's Hugging Face names with a translation of one's own; each family in our names
#: with a translation of no rules
_STAGES = ("gpt2_names_own_translation", *(f"{n}_ours_no_rules" for n in ("bert", "gpt2", "gpt_neo", "llama", "qwen2")))


@pytest.mark.parametrize("case", _STAGES)
def test_untranslated_artifact_loads_into_a_stage_with_a_new_key_under_strict_false(tmp_path: Path, case: str) -> None:
    """The keys the stage asks for load bit-exact and its new key is skipped: a missing key no rule of the
    translation makes is no family mismatch (it was refused as another family's names, the stage's unasked keys
    being taken by that family's rules)."""
    from smpckpt.model.translation import Translation, rename

    if case == "gpt2_names_own_translation":
        hf = tiny_model("gpt2", seed=7, dtype=torch.float32).state_dict()
        sd = {
            k: v for k, v in hf.items() if not k.endswith((".attn.bias", ".attn.masked_bias")) and k != "lm_head.weight"
        }
        translation = Translation("mine", rules=(rename("head.w", "head.weight"),))
    else:
        name = case.removesuffix("_ours_no_rules")
        sd = MODULES[name].translate_hf_state_dict_to_smpckpt(
            tiny_model(name, seed=7, dtype=torch.float32).state_dict()
        )
        translation = Translation("mine", rules=())
    smpckpt.save_checkpoint(str(tmp_path), "full", partial=False, model=Holder({k: v.clone() for k, v in sd.items()}))
    dst = Holder(_stage_of(sd))
    smpckpt.resume_from_checkpoint(
        str(tmp_path / "full"), None, partial=False, model=dst, strict=False, translate_function=translation
    )
    got = dst.state_dict()
    assert [k for k in got if k != "score.weight" and not torch.equal(got[k], sd[k])] == []
    assert torch.equal(got["score.weight"], torch.zeros(3))


def test_a_stage_holding_a_head_its_own_translation_renames_loads_from_an_artifact_saved_without_it(
    tmp_path: Path,
) -> None:
    """rev71c3 L1: nanoGPT in GPT-2's Hugging Face names saved without its head, read by a last stage whose head
    its own translation renames (head.w <- head.weight): the head's source is simply absent (nothing of the
    artifact under head., the stage's other keys found as they are), so strict=False loads the rest bit-exact and
    keeps the head's values, and strict refuses it plainly (it was refused as GPT-2's names). The waiver is no
    loophole: GPT-2's names read with GPT-Neo's translation into a GPT-Neo stage holding layer 0 (its wte found
    as it is; its qkv_proj's layer holds GPT-2's c_attn) is still refused naming GPT-2, strict or not."""
    from smpckpt.model.translation import Translation, rename

    hf = tiny_model("gpt2", seed=7, dtype=torch.float32).state_dict()
    sd = {k: v for k, v in hf.items() if not k.endswith((".attn.bias", ".attn.masked_bias")) and k != "lm_head.weight"}
    smpckpt.save_checkpoint(str(tmp_path), "full", partial=False, model=Holder({k: v.clone() for k, v in sd.items()}))
    url, mine = str(tmp_path / "full"), Translation("mine", rules=(rename("head.w", "head.weight"),))
    head = torch.arange(12.0).reshape(3, 4)
    dst = Holder({**_stage_of(sd), "head.w": head.clone()})
    smpckpt.resume_from_checkpoint(url, None, partial=False, model=dst, strict=False, translate_function=mine)
    got = dst.state_dict()
    assert [k for k in got if k not in ("score.weight", "head.w") and not torch.equal(got[k], sd[k])] == []
    assert torch.equal(got["head.w"], head) and torch.equal(got["score.weight"], torch.zeros(3))
    with pytest.raises(
        smpckpt.errors.LayoutMismatch,
        match=r"2 keys are not in the checkpoint: model\.score\.weight, model\.head\.w \(pass",
    ) as e:
        smpckpt.resume_from_checkpoint(url, None, partial=False, model=dst, translate_function=mine)
    assert "do not match" not in str(e.value)
    neo = MODULES["gpt_neo"].translate_hf_state_dict_to_smpckpt(tiny_model("gpt_neo", seed=7).state_dict())
    for strict in (True, False):
        dst = Holder(_stage_of(neo))
        with pytest.raises(
            smpckpt.errors.LayoutMismatch,
            match=r"do not match translation 'gpt_neo' \(it takes none of its 28 model keys\): they are gpt2's Hugging Face "
            r"names \('transformer\.h\.0\.attn\.c_attn\.weight'\): resume with that family's, smpckpt\.hf\."
            r"translation_for\('gpt2'\), into a model of that family; 4 of our model keys are not in it: "
            r"model\.transformer\.h\.0\.attn\.attention\.qkv_proj\.weight,",
        ):
            smpckpt.resume_from_checkpoint(
                url, None, partial=False, model=dst, strict=strict, translate_function=MODULES["gpt_neo"].TRANSLATION
            )
        assert all(not v.any() for v in dst.state_dict().values())


def _headless_gpt2(root: Path, **overrides: Any) -> tuple[str, dict[str, torch.Tensor]]:
    """nanoGPT in GPT-2's Hugging Face names (a tiny GPT-2) saved full without its head: (its url, its tensors)."""
    hf = tiny_model("gpt2", seed=7, dtype=torch.float32, **overrides).state_dict()
    sd = {k: v for k, v in hf.items() if not k.endswith((".attn.bias", ".attn.masked_bias")) and k != "lm_head.weight"}
    smpckpt.save_checkpoint(str(root), "full", partial=False, model=Holder({k: v.clone() for k, v in sd.items()}))
    return str(root / "full"), sd


#: last stages holding a head their own translation renames, of an artifact saved without it: (the artifact's keys
#: the stage holds, the head's key); the head's source name is the head's key with "w" spelled "weight"
_LAST_STAGES = {
    "layer_norm_head": (r"h\.1\.|ln_f\.", "head.w"),
    "norm_head": (r"ln_f\.", "head.w"),
    "embedding_norm_head": (r"wte\.|ln_f\.", "head.w"),
    "layer_norm_dotless_head": (r"h\.1\.|ln_f\.", "head_w"),
}


@pytest.mark.parametrize("case", list(_LAST_STAGES))
def test_a_real_last_stage_with_a_head_its_own_translation_renames_loads_from_an_artifact_saved_without_it(
    tmp_path: Path, case: str
) -> None:
    """rev72g M2, L1, L2: a real last stage (its last layer, ln_f and the head), one with no layer (ln_f and the head;
    or wte too) and one whose renamed head has no dot (head_w <- head_weight: its place is the key itself, not every
    key) load the rest bit-exact under strict=False, keeping the head's values; strict refuses the head plainly.
    The layerless ones were refused as GPT-2's names (a strict xfail): their rank alone cannot tell; the job's keys
    (here, its one rank's) are judged in the global plan (fix73c)."""
    from smpckpt.model.translation import Translation, rename

    url, sd = _headless_gpt2(tmp_path)
    held, head_key = _LAST_STAGES[case]
    mine = Translation("mine", rules=(rename(head_key, head_key[:-1] + "weight"),))
    head = torch.arange(12.0).reshape(3, 4)
    dst = Holder({**{k: torch.zeros_like(v) for k, v in sd.items() if re.search(held, k)}, head_key: head.clone()})
    smpckpt.resume_from_checkpoint(url, None, partial=False, model=dst, strict=False, translate_function=mine)
    got = dst.state_dict()
    assert [k for k in got if k != head_key and not torch.equal(got[k], sd[k])] == [] and len(got) > 1
    assert torch.equal(got[head_key], head)
    with pytest.raises(
        smpckpt.errors.LayoutMismatch, match=rf"1 keys are not in the checkpoint: model\.{re.escape(head_key)} \(pass"
    ) as e:
        smpckpt.resume_from_checkpoint(url, None, partial=False, model=dst, translate_function=mine)
    assert "do not match" not in str(e.value)


def test_a_last_stage_in_another_familys_names_sharing_one_key_with_the_artifact_is_refused(tmp_path: Path) -> None:
    """rev72g M1: a model of one's own in GPT-Neo's Hugging Face names (a square mlp) whose translation renames only
    its head, its last stage (h.1, ln_f, head.w) read from GPT-2's names saved without a head: GPT-2's mlp.c_fc is
    GPT-Neo's name too, but the stage's missing q/k/v/out_proj are GPT-Neo's, in the layer the artifact holds, so the
    load is refused naming GPT-2, strict or not (strict=False loaded c_fc's Conv1D into a Linear: transposed)."""
    from smpckpt.model.translation import Translation, rename

    url, sd = _headless_gpt2(tmp_path, n_inner=32)
    neo = {k: torch.zeros_like(v) for k, v in sd.items() if re.search(r"h\.1\.(ln|mlp)|ln_f\.", k)}
    attn = "transformer.h.1.attn.attention."
    neo |= {f"{attn}{p}_proj.weight": torch.zeros(32, 32) for p in "qkv"}
    neo |= {f"{attn}out_proj.weight": torch.zeros(32, 32), f"{attn}out_proj.bias": torch.zeros(32)}
    mine = Translation("mine", rules=(rename("head.w", "head.weight"),))
    for strict in (False, True):
        dst = Holder({**neo, "head.w": torch.zeros(3, 4)})
        with pytest.raises(
            smpckpt.errors.LayoutMismatch,
            match=r"do not match translation 'mine' \(it takes none of its \d+ model keys\): they are gpt2's Hugging "
            r"Face names \('transformer\.h\.0\.attn\.c_attn\.weight'\): resume with that family's, smpckpt\.hf\."
            r"translation_for\('gpt2'\), into a model of that family; 6 of our model keys are not in it: "
            r"model\.transformer\.h\.1\.attn\.attention\.q_proj\.weight,",
        ):
            smpckpt.resume_from_checkpoint(url, None, partial=False, model=dst, strict=strict, translate_function=mine)
        assert all(not v.any() for v in dst.state_dict().values())


def _neo_layer(sd: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    """Layer ``i`` of ``sd`` (GPT-2's names, a square mlp) in GPT-Neo's Hugging Face names, zeroed: GPT-2's ln_1,
    ln_2 and mlp keys are GPT-Neo's too (the mlp's Conv1D [in, out] where GPT-Neo's Linear is [out, in])."""
    out = {k: torch.zeros_like(v) for k, v in sd.items() if re.search(rf"h\.{i}\.(ln|mlp)", k)}
    attn = f"transformer.h.{i}.attn.attention."
    out |= {f"{attn}{p}_proj.weight": torch.zeros(32, 32) for p in "qkv"}
    return out | {f"{attn}out_proj.weight": torch.zeros(32, 32), f"{attn}out_proj.bias": torch.zeros(32)}


def _pp_load(url: str, stages: list[dict[str, torch.Tensor]], translation: Any) -> list[dict[str, torch.Tensor]]:
    """A pipeline job of ``stages`` (one a rank) resumed strict=False from the full artifact ``url`` through
    ``translation``, simulated in one process (each rank's planner and reader, rank 0's global plan): the state
    dicts as loaded."""
    from sim import sim_load

    from smpckpt.model.layout import ParallelLayout
    from smpckpt.planners import ParallelLoadPlanner
    from smpckpt.storage import FsspecStorageReader

    states = [{f"model.{k}": v for k, v in stage.items()} for stage in stages]
    layout = ParallelLayout(pp=len(stages))
    planners = [ParallelLoadPlanner(layout, rank=r, allow_partial_load=True) for r in range(len(stages))]
    sim_load(states, planners, [FsspecStorageReader(url, translation=translation, hf_prefix="model.") for _ in states])
    return states


def test_a_pp_job_is_judged_over_every_stages_keys_when_its_last_stage_holds_no_layer(tmp_path: Path) -> None:
    """rev72k M1 and the middle stage (fix73c): a PP job of a model in GPT-Neo's Hugging Face names (square mlp)
    with a translation of one's own renaming its head, read from GPT-2's names saved without a head: its first and
    middle stages miss GPT-Neo's q/k/v/out_proj but hold no key the translation renames (their ranks alone judge
    nothing), its last stage (ln_f and the head) finds no family's key (its rank alone cannot tell): the global plan
    judges the job's keys and refuses naming GPT-2 and every stage's missing keys, nothing loaded (a waiver per rank
    loaded both layers' c_fc transposed; the middle stage alone still would: INDEX). A GPT-2-named job of the same
    cut (its layers, then ln_f and the head) loads bit-exact, the head kept."""
    from smpckpt.model.translation import Translation, rename

    url, sd = _headless_gpt2(tmp_path, n_inner=32)
    mine = Translation("mine", rules=(rename("head.w", "head.weight"),))
    outer = {k: torch.zeros_like(v) for k, v in sd.items() if re.search(r"wte|wpe", k)}
    last = {k: torch.zeros_like(v) for k, v in sd.items() if "ln_f" in k} | {"head.w": torch.arange(12.0).reshape(3, 4)}
    stages = [outer | _neo_layer(sd, 0), _neo_layer(sd, 1), last]
    with pytest.raises(smpckpt.errors.LayoutMismatch) as e:
        _pp_load(url, stages, mine)
    want = r"they are gpt2's Hugging Face names \('transformer\.h\.0\.attn\.c_attn\.weight'\): resume with that "
    want += r"family's, smpckpt\.hf\.translation_for\('gpt2'\), into a model of that family; 11 of our model keys"
    assert re.search(want, str(e.value)), str(e.value)
    assert all(f"model.transformer.h.{i}.attn.attention.q_proj.weight" in str(e.value) for i in (0, 1))
    assert all(not v.any() for stage in stages for k, v in stage.items() if k != "head.w")
    cut = [{k: torch.zeros_like(v) for k, v in sd.items() if re.search(r"wte|wpe|h\.[01]\.", k)}, last]
    got = _pp_load(url, cut, mine)
    assert [k for s in got for k, v in s.items() if k != "model.head.w" and not torch.equal(v, sd[k[6:]])] == []
    assert torch.equal(got[1]["model.head.w"], torch.arange(12.0).reshape(3, 4))


def test_a_head_stage_missing_more_than_its_renamed_head_is_refused_though_one_key_is_shared(tmp_path: Path) -> None:
    """rev72k M2: a layerless stage (RoBERTa's lm_head in our names and a head one's own translation renames) read
    from GPT-J's Hugging Face names finds GPT-J's lm_head.bias (no family's key) and misses lm_head.dense and
    layer_norm, no renamed key: refused naming GPT-J, strict=False, nothing loaded (waived as layerless it loaded
    GPT-J's lm_head.bias alone)."""
    from smpckpt.model.translation import Translation, rename

    hf = tiny_model("gptj", seed=7, dtype=torch.float32).state_dict()
    sd = {k: v for k, v in hf.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    smpckpt.save_checkpoint(str(tmp_path), "full", partial=False, model=Holder({k: v.clone() for k, v in sd.items()}))
    roberta = MODULES["roberta"].translate_hf_state_dict_to_smpckpt(
        tiny_model("roberta", seed=7, dtype=torch.float32).state_dict()
    )
    dst = Holder(
        {
            **{k: torch.zeros_like(v) for k, v in roberta.items() if k.startswith("lm_head.")},
            "head.w": torch.zeros(3, 4),
        }
    )
    mine = Translation("mine", rules=(rename("head.w", "head.weight"),))
    with pytest.raises(
        smpckpt.errors.LayoutMismatch,
        match=r"they are gptj's Hugging Face names \('transformer\.h\.0\.attn\.k_proj\.weight'\): resume with that "
        r"family's, smpckpt\.hf\.translation_for\('gptj'\), into a model of that family; 5 of our model keys are not "
        r"in it: model\.lm_head\.dense\.weight,",
    ):
        smpckpt.resume_from_checkpoint(
            str(tmp_path / "full"), None, partial=False, model=dst, strict=False, translate_function=mine
        )
    assert all(not v.any() for v in dst.state_dict().values())


def test_a_folder_with_a_module_in_another_familys_fused_name_beside_the_model_loads_as_it_did(
    tmp_path: Path,
) -> None:
    """A Llama folder with one more module whose name is GPT-J's fused tensor in our names (CodeGen's own
    Hugging Face name: a draft model stored beside it) reads as it always did with llama's translation, strict
    and not, and through the eager helper: the leftover shares no layer with what the rules take (rev71c3 M1:
    refused as 'gptj's fused tensors in our names')."""
    from safetensors.torch import save_file

    hf = dict(tiny_model("llama", seed=7, dtype=torch.float32).state_dict())
    extra = {"transformer.h.0.attn.qkv_proj.weight": torch.randn(96, 32)}
    save_file({k: v.contiguous() for k, v in {**hf, **extra}.items()}, str(tmp_path / "model.safetensors"))
    want = {**MODULES["llama"].translate_hf_state_dict_to_smpckpt(hf), **extra}
    for strict in (True, False):
        dst = Holder({k: torch.zeros_like(v) for k, v in want.items()})
        smpckpt.resume_from_checkpoint(
            str(tmp_path),
            None,
            partial=False,
            model=dst,
            strict=strict,
            translate_function=MODULES["llama"].TRANSLATION,
        )
        assert [k for k, v in want.items() if not torch.equal(dst.state_dict()[k], v)] == []
    assert "transformer.h.0.attn.qkv_proj.weight" in MODULES["llama"].translate_hf_state_dict_to_smpckpt(
        {**hf, **extra}
    )


def test_gpt_neo_in_our_names_read_with_gpt2s_translation_is_refused_naming_gpt_neo(tmp_path: Path) -> None:
    """A GPT-Neo in our names (a square MLP) read with GPT-2's translation, whose rules take its mlp.c_fc/c_proj
    as GPT-2's Conv1D weights: refused naming GPT-Neo's fused qkv_proj, strict or not, nothing loaded (strict=False
    loaded 20 of 28 keys, the MLP weights transposed); following the advice loads it bit-exact."""
    neo = tiny_model("gpt_neo", seed=7, dtype=torch.float32, intermediate_size=tiny_config("gpt_neo").hidden_size)
    ours = MODULES["gpt_neo"].translate_hf_state_dict_to_smpckpt(neo.state_dict())
    ours.pop("lm_head.weight", None)
    smpckpt.save_checkpoint(str(tmp_path), "full", partial=False, model=Holder({k: v.clone() for k, v in ours.items()}))
    url = str(tmp_path / "full")
    dims = {"n_inner": tiny_config("gpt2").n_embd, "n_embd": tiny_config("gpt_neo").hidden_size}
    gpt2 = tiny_model("gpt2", seed=7, dtype=torch.float32, **dims)
    want = MODULES["gpt2"].translate_hf_state_dict_to_smpckpt(gpt2.state_dict())
    for strict in (True, False):
        dst = Holder({k: torch.zeros_like(v) for k, v in want.items()})
        with pytest.raises(
            smpckpt.errors.LayoutMismatch,
            match=r"full: translation 'gpt2' takes some of the tensors as Hugging Face names but leaves "
            r"'transformer\.h\.0\.attn\.attention\.qkv_proj\.weight', 'transformer\.h\.1\.attn\.attention\.qkv_proj"
            r"\.weight', which are gpt_neo's fused tensors in our names: the tensors are that family's model in our "
            r"names, read as they are with its translation, smpckpt\.hf\.translation_for\('gpt_neo'\), into a model",
        ):
            smpckpt.resume_from_checkpoint(
                url, None, partial=False, model=dst, strict=strict, translate_function=MODULES["gpt2"].TRANSLATION
            )
        assert all(not v.any() for v in dst.state_dict().values())
    dst = Holder({k: torch.zeros_like(v) for k, v in ours.items()})
    smpckpt.resume_from_checkpoint(
        url, None, partial=False, model=dst, translate_function=smpckpt.hf.translation_for("gpt_neo")
    )
    assert [k for k, v in ours.items() if not torch.equal(dst.state_dict()[k], v)] == []

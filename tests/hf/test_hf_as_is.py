"""An untranslated artifact read through a translation (tier 1, one process; moved from ``test_hf_seams.py``):
an artifact of ours in Hugging Face names imports as a save_pretrained folder does, one no rule takes reads as
it is, and the wrong-family judgement (smpckpt/hf/_family.py) of a whole model's keys; over a stage's and a PP
job's keys in ``test_hf_stages.py``."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_e2e_workers import Holder
from hf_reference import MODULES, sim_full_load, tiny_config, tiny_model

import smpckpt
from smpckpt.api.options import ExportOptions

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

NAMES = sorted(MODULES)


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
    from sim import sim_save

    from smpckpt.model.layout import ParallelLayout
    from smpckpt.planners import ParallelSavePlanner
    from smpckpt.storage import FullArtifactWriter, FullOptions

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

    out = {"model": {k: torch.zeros_like(v) for k, v in want.items()}}
    sim_full_load(tmp_path, [out], mod.TRANSLATION)
    assert [k for k in want if not torch.equal(out["model"][k], want[k])] == []
    ema = {k: torch.zeros_like(v) for k, v in sd.items()}
    with pytest.raises(
        smpckpt.errors.LayoutMismatch,
        match=r"written without a translate_function, its 'ema' artifact holds tensors under 'ema\.' \(not model "
        r"weights, nor optimizer state\), which translate_function \(llama\) does not rename: read them without "
        r"translate_function \(asked for 21 such keys: ema\.model\.",
    ):
        sim_full_load(tmp_path, [{"ema": ema}], mod.TRANSLATION)
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


def test_the_judges_tail_filter_answers_as_rule_of_over_every_key_with_state_suffixes() -> None:
    """rev73c 5: the judge asks rule_of only of keys ending with a rule's literal tail; a key taken as a parameter's
    state (``...qkv_proj.weight.exp_avg``) ends with none, so the filter is right only as a whether: such a key is
    taken only beside its parameter (of its shape), which ends with the tail. Checked per family's translation (and a
    template ending in a field: every key passes) over every family's keys in Hugging Face names and ours, alone,
    as state alone, with its parameter, under another prefix."""
    from smpckpt.hf._family import _holds_made
    from smpckpt.model.translation import Translation, rename

    keys: set[str] = set()
    for name in NAMES:
        hf = tiny_model(name, seed=1, dtype=torch.float32).state_dict()
        keys |= set(hf) | set(MODULES[name].translate_hf_state_dict_to_smpckpt(hf))
    keys |= {"b.0", "b.1.w"}  # the field-ended template's
    groups = [[k] for k in keys] + [[f"{k}{s}"] for k in keys for s in (".exp_avg", ".step")]
    groups += [[k, f"{k}.exp_avg", f"{k}.exp_avg_sq"] for k in keys]
    groups += [[f"state.{k}", f"state.{k}.exp_avg"] for k in keys]
    translations = [MODULES[n].TRANSLATION for n in NAMES] + [Translation("mine", rules=(rename("b.{i}", "h.{i}"),))]
    checked = taken = 0
    for translation in translations:
        for group in groups:
            shapes = {k: (4,) for k in group}
            want = any(translation.rule_of(k, shapes, "ours") for k in shapes)
            assert _holds_made(translation, shapes, frozenset()) == want, (translation.name, group)
            checked, taken = checked + 1, taken + want
    assert taken > len(translations) and checked > taken  # both answers seen
    state = {"transformer.h.0.attn.qkv_proj.weight.exp_avg": (4,)}  # state alone (no parameter) is not taken
    assert not _holds_made(MODULES["gptj"].TRANSLATION, state, frozenset())
    assert _holds_made(
        MODULES["gptj"].TRANSLATION, {**state, "transformer.h.0.attn.qkv_proj.weight": (4,)}, frozenset()
    )

"""smpckpt.hf.{gpt2,llama,qwen2}: eager translation (bit-exact round trips, tied heads, buffers),
loading exported files with transformers, and tp_specs."""

from __future__ import annotations

import pytest
import torch
from hf_reference import MODULES, assert_same_state, tiny_config, tiny_model

from smpckpt.errors import SpecError
from smpckpt.hf import TRANSLATIONS, translation_for
from smpckpt.model.specs import ShardSpec

NAMES = ["gpt2", "llama", "qwen2"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", [*NAMES, "gptj", "gpt_neo", "mistral"])
def test_round_trip_hf_ours_hf(name, dtype):
    """Every causal-LM family (the encoders' MLM heads: tests/hf/test_hf_encoders.py)."""
    model = tiny_model(name, dtype=dtype)
    hf, tied = model.state_dict(), model.config.tie_word_embeddings
    mod = MODULES[name]
    ours = mod.translate_hf_state_dict_to_smpckpt(hf)
    assert ("lm_head.weight" in ours) is not tied
    assert_same_state(mod.translate_state_dict_to_hf(ours, tie_word_embeddings=tied), hf)
    # the default export leaves a tied head out, as HF's own files do
    assert set(mod.translate_state_dict_to_hf(ours)) == set(hf) - ({"lm_head.weight"} if tied else set())
    # ours -> HF -> ours, from model shapes and from view shapes
    assert_same_state(mod.translate_hf_state_dict_to_smpckpt(mod.translate_state_dict_to_hf(ours)), ours)
    view = mod.translate_hf_state_dict_to_smpckpt(hf, keep_view_shapes=True)
    back = mod.translate_hf_state_dict_to_smpckpt(mod.translate_state_dict_to_hf(view), keep_view_shapes=True)
    assert_same_state(back, view)
    # the eager helpers agree with the lazy rules, both ways
    exported = mod.translate_state_dict_to_hf(ours)
    plan = mod.TRANSLATION.from_artifact({k: v.shape for k, v in exported.items()})
    assert {k: shape for k, (_, shape) in plan.items()} == {k: tuple(v.shape) for k, v in view.items()}
    _, artifact_shapes = mod.TRANSLATION.to_artifact({k: v.shape for k, v in view.items()})
    assert artifact_shapes == {k: tuple(v.shape) for k, v in exported.items()}


def test_gpt2_layout():
    model = tiny_model("gpt2")
    hf = model.state_dict()
    ours = MODULES["gpt2"].translate_hf_state_dict_to_smpckpt(hf)
    d, p = 32, "transformer.h.1."
    assert set(ours) == {
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "transformer.ln_f.weight",
        "transformer.ln_f.bias",
    } | {
        f"transformer.h.{i}.{n}"
        for i in range(2)
        for n in (
            "ln_1.weight",
            "ln_1.bias",
            "ln_2.weight",
            "ln_2.bias",
            "attn.qkv.weight",
            "attn.qkv.bias",
            "attn.proj.weight",
            "attn.proj.bias",
            "mlp.fc.weight",
            "mlp.fc.bias",
            "mlp.proj.weight",
            "mlp.proj.bias",
        )
    }
    assert ours[p + "attn.qkv.weight"].shape == (3 * d, d)  # the unsharded nn.Linear
    assert torch.equal(ours[p + "attn.qkv.weight"], hf[p + "attn.c_attn.weight"].T)
    assert torch.equal(ours[p + "mlp.fc.weight"], hf[p + "mlp.c_fc.weight"].T)
    view = MODULES["gpt2"].translate_hf_state_dict_to_smpckpt(hf, keep_view_shapes=True)
    assert view[p + "attn.qkv.weight"].shape == (3, d, d) and view[p + "attn.qkv.bias"].shape == (3, d)
    assert torch.equal(view[p + "attn.qkv.weight"][1, 5, 7], hf[p + "attn.c_attn.weight"][7, d + 5])


def test_llama_layout():
    hf = tiny_model("llama").state_dict()
    ours = MODULES["llama"].translate_hf_state_dict_to_smpckpt(hf)
    p = "model.layers.0.mlp."
    assert set(ours) == (
        set(hf) - {f"model.layers.{i}.mlp.{n}_proj.weight" for i in range(2) for n in ("gate", "up")}
    ) | {f"model.layers.{i}.mlp.gate_up_proj.weight" for i in range(2)}
    assert torch.equal(
        ours[p + "gate_up_proj.weight"], torch.cat([hf[p + "gate_proj.weight"], hf[p + "up_proj.weight"]])
    )


def test_llama_biases_translate_both_ways():
    """``mlp_bias``: gate/up biases fuse into ``gate_up_proj.bias`` (``[2, I]`` in the view, ``[2I]`` as the
    model holds it) as the weights do, and come back apart; ``attention_bias`` keeps HF's keys."""
    mod = MODULES["llama"]
    hf = tiny_model("llama", attention_bias=True, mlp_bias=True).state_dict()
    p = "model.layers.1.mlp."
    view = mod.translate_hf_state_dict_to_smpckpt(hf, keep_view_shapes=True)
    assert p + "gate_proj.bias" not in view and p + "up_proj.bias" not in view
    assert torch.equal(view[p + "gate_up_proj.bias"], torch.stack([hf[p + "gate_proj.bias"], hf[p + "up_proj.bias"]]))
    merged = mod.translate_hf_state_dict_to_smpckpt(hf)
    assert torch.equal(merged[p + "gate_up_proj.bias"], torch.cat([hf[p + "gate_proj.bias"], hf[p + "up_proj.bias"]]))
    for ours in (view, merged):
        assert_same_state(mod.translate_state_dict_to_hf(ours), hf)
    assert all(k in view for k in hf if "self_attn" in k)  # q/k/v/o biases keep HF's keys


def test_exported_files_load_into_transformers(tmp_path):
    """What we export is what transformers reads: save_pretrained-style folder and strict load_state_dict."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    for name in NAMES:
        model = tiny_model(name, dtype=torch.float32)
        mod = MODULES[name]
        ours = {k: v.clone() for k, v in mod.translate_hf_state_dict_to_smpckpt(model.state_dict()).items()}
        folder = tmp_path / name
        model.config.save_pretrained(folder)
        save_file(
            {k: v.contiguous() for k, v in mod.translate_state_dict_to_hf(ours).items()},
            str(folder / "model.safetensors"),
            metadata={"format": "pt"},
        )
        loaded = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        fresh = AutoModelForCausalLM.from_config(model.config, attn_implementation="eager").eval()
        fresh.load_state_dict(
            mod.translate_state_dict_to_hf(ours, tie_word_embeddings=model.config.tie_word_embeddings)
        )
        ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            expect = model(ids).logits
            assert torch.equal(loaded(ids).logits, expect), name
            assert torch.equal(fresh(ids).logits, expect), name


def test_buffers_are_dropped_on_import():
    hf = tiny_model("gpt2").state_dict()
    extra = {
        "transformer.h.0.attn.bias": torch.ones(1, 1, 64, 64).tril(),
        "transformer.h.1.attn.masked_bias": torch.tensor(-1e4),
    }
    assert set(MODULES["gpt2"].translate_hf_state_dict_to_smpckpt({**hf, **extra})) == set(
        MODULES["gpt2"].translate_hf_state_dict_to_smpckpt(hf)
    )
    for name in ("llama", "qwen2"):
        hf = tiny_model(name).state_dict()
        extra = {
            "model.layers.1.self_attn.rotary_emb.inv_freq": torch.ones(4),
            "model.rotary_emb.inv_freq": torch.ones(4),
        }
        assert set(MODULES[name].translate_hf_state_dict_to_smpckpt({**hf, **extra})) == set(
            MODULES[name].translate_hf_state_dict_to_smpckpt(hf)
        )


def test_tied_head_detection():
    gpt2 = MODULES["gpt2"]
    hf = tiny_model("gpt2").state_dict()
    copied = {**hf, "lm_head.weight": hf["transformer.wte.weight"].clone()}  # a file with both entries
    assert "lm_head.weight" not in gpt2.translate_hf_state_dict_to_smpckpt(copied)
    untied = {**hf, "lm_head.weight": hf["transformer.wte.weight"] + 1}
    ours = gpt2.translate_hf_state_dict_to_smpckpt(untied)  # an untied head is kept, and exported again
    assert torch.equal(ours["lm_head.weight"], untied["lm_head.weight"])
    assert_same_state(gpt2.translate_state_dict_to_hf(ours), untied)
    assert "lm_head.weight" in gpt2.translate_hf_state_dict_to_smpckpt(hf, tie_word_embeddings=False)
    with pytest.raises(ValueError, match="tie_word_embeddings=True but 'lm_head.weight' differs"):
        gpt2.translate_hf_state_dict_to_smpckpt(untied, tie_word_embeddings=True)


def test_inconsistent_inputs_raise_clear_errors():
    llama, gpt2 = MODULES["llama"], MODULES["gpt2"]
    hf = tiny_model("llama").state_dict()
    p = "model.layers.1.mlp."
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.gate_proj\.weight'\] is missing"):
        llama.translate_hf_state_dict_to_smpckpt({k: v for k, v in hf.items() if k != p + "gate_proj.weight"})
    with pytest.raises(ValueError, match=r"gate_proj\.weight \(64, 32\), .*up_proj\.weight \(60, 32\)"):
        llama.translate_hf_state_dict_to_smpckpt({**hf, p + "up_proj.weight": torch.zeros(60, 32)})
    with pytest.raises(ValueError, match=r"does not split into 2 fused parts"):
        llama.translate_state_dict_to_hf({p + "gate_up_proj.weight": torch.zeros(7, 32)})
    with pytest.raises(ValueError, match=r"c_attn\.weight \(32, 95\): fused QKV width 95 does not divide by 3"):
        gpt2.TRANSLATION.from_artifact({"transformer.h.0.attn.c_attn.weight": (32, 95)})
    with pytest.raises(ValueError, match=r"our 'transformer\.h\.0\.attn\.qkv\.weight' of shape \(4, 8, 8\)"):
        gpt2.TRANSLATION.to_artifact({"transformer.h.0.attn.qkv.weight": (4, 8, 8)})


def test_optimizer_state_keys_follow_their_parameters():
    """Adam state of the fused tensors (``<param>.exp_avg``) translates like the parameter; ``step`` does not."""
    model = tiny_model("llama")
    mod = MODULES["llama"]
    ours = mod.translate_hf_state_dict_to_smpckpt(model.state_dict(), keep_view_shapes=True)
    key = "model.layers.0.mlp.gate_up_proj.weight"
    state = {key: ours[key], key + ".exp_avg": ours[key] * 3, key + ".step": torch.tensor(5.0)}
    out = mod.TRANSLATION.translate_to_artifact(state)
    assert set(out) == {
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.gate_proj.weight.exp_avg",
        "model.layers.0.mlp.up_proj.weight.exp_avg",
        key + ".step",
    }
    assert torch.equal(
        out["model.layers.0.mlp.up_proj.weight.exp_avg"], model.state_dict()["model.layers.0.mlp.up_proj.weight"] * 3
    )
    assert_same_state(mod.TRANSLATION.translate_from_artifact(out), state)


# -- tp_specs ------------------------------------------------------------------------------------------


def test_gpt2_tp_specs():
    cfg = tiny_config("gpt2")  # vocab 97: split near-evenly
    specs = MODULES["gpt2"].tp_specs(2, cfg)
    assert specs["transformer.wte.weight"] == ShardSpec(0, sizes=(49, 48))
    assert specs["transformer.h.*.attn.qkv.weight"] == ShardSpec(1, view=(3, -1, 32))
    assert specs["transformer.h.*.attn.qkv.bias"] == ShardSpec(1, view=(3, -1))
    assert specs["transformer.h.*.attn.proj.weight"] == ShardSpec(1)
    assert specs["transformer.h.*.mlp.fc.weight"] == specs["transformer.h.*.mlp.fc.bias"] == ShardSpec(0)
    assert specs["transformer.h.*.mlp.proj.weight"] == ShardSpec(1)
    assert not any("ln_" in k or "wpe" in k or k.endswith("proj.bias") for k in specs)  # replicated
    as_dict = {"n_embd": 32, "n_head": 4, "vocab_size": 96, "n_inner": None}
    assert MODULES["gpt2"].tp_specs(4, as_dict, prefix="model.")["model.transformer.wte.weight"] == ShardSpec(0)
    with pytest.raises(SpecError, match="n_head=4 does not divide by tp=3"):
        MODULES["gpt2"].tp_specs(3, cfg)
    with pytest.raises(SpecError, match="needs the model config"):
        MODULES["gpt2"].tp_specs(2)
    with pytest.raises(SpecError, match="positive int"):
        MODULES["gpt2"].tp_specs(0, cfg)


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_llama_family_tp_specs(name):
    mod, attn = MODULES[name], "model.layers.*.self_attn."
    cfg = tiny_config(name)  # nh=4, nkv=2
    sharded, replicated = mod.tp_specs(2, cfg), mod.tp_specs(4, cfg)
    assert sharded[attn + "q_proj.weight"] == replicated[attn + "q_proj.weight"] == ShardSpec(0)
    assert sharded[attn + "k_proj.weight"] == sharded[attn + "v_proj.weight"] == ShardSpec(0)
    assert attn + "k_proj.weight" not in replicated and attn + "v_proj.weight" not in replicated  # GQA, nkv < tp
    assert sharded[attn + "o_proj.weight"] == ShardSpec(1)
    assert sharded["model.layers.*.mlp.gate_up_proj.weight"] == ShardSpec(1, view=(2, -1, 32))
    assert sharded["model.layers.*.mlp.down_proj.weight"] == ShardSpec(1)
    assert sharded["model.embed_tokens.weight"] == sharded["lm_head.weight"] == ShardSpec(0)
    # biases (Qwen2's q/k/v, Llama's attention_bias / mlp_bias) follow their weights' rows; o/down's replicated
    assert sharded[attn + "q_proj.bias"] == replicated[attn + "q_proj.bias"] == ShardSpec(0)
    assert sharded[attn + "k_proj.bias"] == sharded[attn + "v_proj.bias"] == ShardSpec(0)
    assert attn + "k_proj.bias" not in replicated and attn + "v_proj.bias" not in replicated
    assert sharded["model.layers.*.mlp.gate_up_proj.bias"] == ShardSpec(1, view=(2, -1))
    assert attn + "o_proj.bias" not in sharded and "model.layers.*.mlp.down_proj.bias" not in sharded
    with pytest.raises(SpecError, match="num_attention_heads=4 does not divide by tp=8"):
        mod.tp_specs(8, cfg)
    odd = {
        "hidden_size": 48,
        "intermediate_size": 96,
        "vocab_size": 96,
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
    }
    with pytest.raises(SpecError, match="num_key_value_heads=3 and tp=2"):
        mod.tp_specs(2, odd)
    assert attn + "k_proj.weight" not in mod.tp_specs(6, {**odd, "vocab_size": 96})  # 6 % 3 == 0: replicated
    with pytest.raises(SpecError, match="intermediate_size=96 does not divide by tp=5"):
        mod.tp_specs(5, {**odd, "num_attention_heads": 5, "num_key_value_heads": 5})


def test_registry():
    """Every family under its transformers ``config.model_type``, with its head class and tied heads."""
    from transformers import AutoConfig

    assert (
        sorted(TRANSLATIONS)
        == sorted(MODULES)
        == [
            "bert",
            "gpt2",
            "gpt_neo",
            "gptj",
            "llama",
            "mistral",
            "qwen2",
            "roberta",
        ]
    )
    for name, translation in TRANSLATIONS.items():
        assert translation.name == name and MODULES[name].TRANSLATION is translation
        assert AutoConfig.for_model(name).model_type == name  # the key transformers itself uses
        assert translation.architecture and translation.tied
        assert translation_for(name) is translation
    assert translation_for("gptneo") is TRANSLATIONS["gpt_neo"]  # smp's module name
    with pytest.raises(KeyError, match="no Hugging Face translation for 'opt'"):
        translation_for("opt")


def test_gpt2_smp_names():
    """smp's GPT-2 functions: the export loads strictly into GPT2LMHeadModel (tied head included);
    max_seq_len adds the causal-mask buffers old transformers kept; the import is ours."""
    gpt2 = MODULES["gpt2"]
    model = tiny_model("gpt2", dtype=torch.float32)
    ours = gpt2.translate_hf_state_dict_to_smdistributed_gpt2(model.state_dict())
    assert_same_state(ours, gpt2.translate_hf_state_dict_to_smpckpt(model.state_dict()))
    hf = gpt2.translate_state_dict_to_hf_gpt2(ours)
    fresh = type(model)(model.config)
    fresh.load_state_dict(hf)  # strict: every key, lm_head.weight included
    assert_same_state(fresh.state_dict(), model.state_dict())
    old = gpt2.translate_state_dict_to_hf_gpt2(ours, max_seq_len=16)
    assert set(old) - set(hf) == {f"transformer.h.{i}.attn.{b}" for i in range(2) for b in ("bias", "masked_bias")}
    mask = old["transformer.h.1.attn.bias"]
    assert (
        mask.shape == (1, 1, 16, 16)
        and mask.dtype == torch.bool
        and torch.equal(mask[0, 0], torch.ones(16, 16).tril().bool())
    )
    assert set(gpt2.translate_hf_state_dict_to_smpckpt(old)) == set(ours)  # the buffers are dropped again
    with pytest.raises(ValueError, match="max_seq_len must be a positive int"):
        gpt2.translate_state_dict_to_hf_gpt2(ours, max_seq_len=0)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_optimizer_state_in_the_other_shape_than_its_parameter_follows_it(family):
    """rev61f F1: a fused parameter in one shape (a live ``model.state_dict()``: ``[2I, d]``) beside its state
    in the other (read from a checkpoint in the view's shape ``[2, I, d]``): the state came back under our
    own key, untranslated, with no error. It follows its parameter, as it did before the fused rules merged."""
    mod = MODULES[family]
    hf = tiny_model(family).state_dict()
    merged = mod.translate_hf_state_dict_to_smpckpt(hf)
    view = mod.translate_hf_state_dict_to_smpckpt(hf, keep_view_shapes=True)
    key = next(k for k in merged if merged[k].shape != view[k].shape)
    for param, state in ((merged, view), (view, merged)):
        out = mod.translate_state_dict_to_hf({key: param[key], key + ".exp_avg": state[key] * 3})
        assert {k for k in out if k.endswith(".exp_avg")} == {k + ".exp_avg" for k in out if not k.endswith(".exp_avg")}
        for k, v in out.items():
            if k.endswith(".exp_avg"):
                assert torch.equal(v, out[k[: -len(".exp_avg")]] * 3), k

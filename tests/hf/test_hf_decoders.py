"""smpckpt.hf.{gptj,gptneo,mistral}: eager translation (bit-exact round trips, layouts, tied heads, buffers),
the lazy rules, tp_specs, reference TP forwards against HF logits, exported files and smp's names."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_reference import assert_same_state
from ref_decoders import FORWARDS, MODULES, NAMES, forward, global_view, shard_all, tiny_config, tiny_model

from smpckpt.errors import SpecError
from smpckpt.model.specs import ShardSpec, SpecRules

#: our fused attention input projection of each family with its HF parts (no biases in either)
QKV = {
    "gptj": ("transformer.h.{i}.attn.qkv_proj.weight", "transformer.h.{i}.attn.{p}_proj.weight"),
    "gpt_neo": (
        "transformer.h.{i}.attn.attention.qkv_proj.weight",
        "transformer.h.{i}.attn.attention.{p}_proj.weight",
    ),
}


def _ids(config, seed: int, shape=(2, 7)) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["gptj", "gpt_neo"])
def test_qkv_layout(name):
    """The only rewritten keys are q/k/v -> one fused tensor: ``[3, d, d]`` view, ``[3d, d]`` model shape,
    whose rows are HF's q, k and v weights."""
    model = tiny_model(name)
    hf, d, mod = model.state_dict(), 32, MODULES[name]
    ours, view = mod.translate_hf_state_dict_to_smpckpt(hf), global_view(name, model)
    fused, part = QKV[name]
    parts = {part.format(i=i, p=p) for i in range(2) for p in "qkv"}
    head = {"lm_head.weight"} if model.config.tie_word_embeddings else set()  # GPT-Neo's is tied: dropped
    assert set(ours) == (set(hf) - parts - head) | {fused.format(i=i) for i in range(2)}
    for i in range(2):
        key = fused.format(i=i)
        assert view[key].shape == (3, d, d) and ours[key].shape == (3 * d, d)
        for j, p in enumerate("qkv"):
            assert torch.equal(view[key][j], hf[part.format(i=i, p=p)])
            assert torch.equal(ours[key][j * d : (j + 1) * d], hf[part.format(i=i, p=p)])
    assert not any(k.endswith(("q_proj.bias", "qkv_proj.bias")) for k in ours)  # neither family has q/k/v biases


def test_mistral_layout():
    hf = tiny_model("mistral").state_dict()
    mod, p = MODULES["mistral"], "model.layers.1.mlp."
    ours = mod.translate_hf_state_dict_to_smpckpt(hf)
    assert set(ours) == (
        set(hf) - {f"model.layers.{i}.mlp.{n}_proj.weight" for i in range(2) for n in ("gate", "up")}
    ) | {f"model.layers.{i}.mlp.gate_up_proj.weight" for i in range(2)}
    assert torch.equal(
        ours[p + "gate_up_proj.weight"], torch.cat([hf[p + "gate_proj.weight"], hf[p + "up_proj.weight"]])
    )
    view = mod.translate_hf_state_dict_to_smpckpt(hf, keep_view_shapes=True)
    assert view[p + "gate_up_proj.weight"].shape == (2, 64, 32)
    assert ours["model.layers.0.self_attn.k_proj.weight"].shape == (16, 32)  # 2 kv heads of 8


def test_translations_and_public_names():
    for name, mod in ((n, MODULES[n]) for n in NAMES):
        arch = {"gptj": "GPTJForCausalLM", "gpt_neo": "GPTNeoForCausalLM", "mistral": "MistralForCausalLM"}[name]
        assert mod.TRANSLATION.name == name and mod.TRANSLATION.architecture == arch
        head_of = {"mistral": "model.embed_tokens.weight"}.get(name, "transformer.wte.weight")
        assert mod.TRANSLATION.tied == {"lm_head.weight": head_of}
        public = {
            k for k, v in vars(mod).items() if not k.startswith("_") and getattr(v, "__module__", None) == mod.__name__
        }
        assert public | {"TRANSLATION"} == set(mod.__all__) and all(hasattr(mod, k) for k in mod.__all__)
    assert "translate_state_dict_to_hf_gptj" in MODULES["gptj"].__all__
    assert "translate_hf_state_dict_to_smdistributed_gptneo" in MODULES["gpt_neo"].__all__


# -- heads and buffers ---------------------------------------------------------------------------------


def test_gptneo_tied_head_detection():
    gptneo = MODULES["gpt_neo"]
    model = tiny_model("gpt_neo")
    hf = model.state_dict()
    assert hf["lm_head.weight"].data_ptr() == hf["transformer.wte.weight"].data_ptr()  # tied in memory
    assert "lm_head.weight" not in gptneo.translate_hf_state_dict_to_smpckpt(hf)
    copied = {**hf, "lm_head.weight": hf["transformer.wte.weight"].clone()}  # a file with both entries
    assert "lm_head.weight" not in gptneo.translate_hf_state_dict_to_smpckpt(copied)
    untied = {**hf, "lm_head.weight": hf["transformer.wte.weight"] + 1}
    ours = gptneo.translate_hf_state_dict_to_smpckpt(untied)  # a head that differs is kept, and exported again
    assert torch.equal(ours["lm_head.weight"], untied["lm_head.weight"])
    assert_same_state(gptneo.translate_state_dict_to_hf(ours), untied)
    assert "lm_head.weight" in gptneo.translate_hf_state_dict_to_smpckpt(hf, tie_word_embeddings=False)
    with pytest.raises(ValueError, match="tie_word_embeddings=True but 'lm_head.weight' differs"):
        gptneo.translate_hf_state_dict_to_smpckpt(untied, tie_word_embeddings=True)
    # an untied config: the head is its own tensor, kept, and the reference forward uses it
    model = tiny_model("gpt_neo", tie_word_embeddings=False)
    ours = global_view("gpt_neo", model)
    assert not torch.equal(ours["lm_head.weight"], ours["transformer.wte.weight"])
    ids = _ids(model.config, 3)
    with torch.no_grad():
        torch.testing.assert_close(
            forward(shard_all("gpt_neo", ours, 2, model.config), model.config, ids),
            model(ids).logits,
            rtol=1e-5,
            atol=1e-5,
        )


def test_gptj_untied_head_and_bias_kept():
    gptj = MODULES["gptj"]
    model = tiny_model("gptj")
    assert model.config.tie_word_embeddings is False
    hf = model.state_dict()
    ours = gptj.translate_hf_state_dict_to_smpckpt(hf)
    assert torch.equal(ours["lm_head.weight"], hf["lm_head.weight"])
    assert torch.equal(ours["lm_head.bias"], hf["lm_head.bias"]) and ours["lm_head.bias"].shape == (97,)
    assert_same_state(gptj.translate_state_dict_to_hf(ours), hf)
    # a GPT-J config that ties: the head's weight goes, its bias (never tied) stays
    model = tiny_model("gptj", tie_word_embeddings=True)
    ours = global_view("gptj", model)
    assert "lm_head.weight" not in ours and "lm_head.bias" in ours
    assert_same_state(gptj.translate_state_dict_to_hf(ours, tie_word_embeddings=True), model.state_dict())
    ids = _ids(model.config, 4)
    with torch.no_grad():
        torch.testing.assert_close(
            forward(shard_all("gptj", ours, 2, model.config), model.config, ids),
            model(ids).logits,
            rtol=1e-5,
            atol=1e-5,
        )


#: the buffers older transformers versions wrote into each family's state dicts
OLD_BUFFERS = {
    "gptj": {
        "transformer.h.0.attn.bias": torch.ones(1, 1, 64, 64, dtype=torch.bool).tril(),
        "transformer.h.1.attn.masked_bias": torch.tensor(-1e9),
        "transformer.h.1.attn.embed_positions": torch.zeros(64, 4),
    },
    "gpt_neo": {
        "transformer.h.0.attn.attention.bias": torch.ones(1, 1, 64, 64, dtype=torch.bool).tril(),
        "transformer.h.1.attn.attention.masked_bias": torch.tensor(-1e9),
    },
    "mistral": {
        "model.layers.1.self_attn.rotary_emb.inv_freq": torch.ones(4),
        "model.rotary_emb.inv_freq": torch.ones(4),
    },
}


@pytest.mark.parametrize("name", NAMES)
def test_buffers_are_dropped_on_import(name):
    mod = MODULES[name]
    hf = tiny_model(name).state_dict()
    assert_same_state(
        mod.translate_hf_state_dict_to_smpckpt({**hf, **OLD_BUFFERS[name]}), mod.translate_hf_state_dict_to_smpckpt(hf)
    )
    with_buffers = {k: v.shape for k, v in {**hf, **OLD_BUFFERS[name]}.items()}
    # the lazy rules skip the buffers too (and, unlike the eager import, leave tied heads to the caller)
    expect = mod.translate_hf_state_dict_to_smpckpt(hf, tie_word_embeddings=False)
    assert set(mod.TRANSLATION.from_artifact(with_buffers)) == set(expect)


def test_optimizer_state_follows_fused_qkv():
    """Adam state of the fused QKV (``<param>.exp_avg``) translates like the parameter; ``step`` does not."""
    model = tiny_model("gptj")
    mod = MODULES["gptj"]
    key = "transformer.h.0.attn.qkv_proj.weight"
    ours = global_view("gptj", model)
    state = {key: ours[key], key + ".exp_avg": ours[key] * 3, key + ".step": torch.tensor(5.0)}
    out = mod.TRANSLATION.translate_to_artifact(state)
    parts = [f"transformer.h.0.attn.{p}_proj.weight" for p in "qkv"]
    assert set(out) == {*parts, *(p + ".exp_avg" for p in parts), key + ".step"}
    assert torch.equal(out[parts[1] + ".exp_avg"], model.state_dict()[parts[1]] * 3)
    assert_same_state(mod.TRANSLATION.translate_from_artifact(out), state)


# -- tp_specs ------------------------------------------------------------------------------------------


def _expected_spec(name: str, key: str, tp: int) -> ShardSpec | None:
    """What every key of our tiny models must get (None: replicated), written out independently."""
    if name == "mistral":
        rows = ShardSpec(0)  # vocab 96
        if key in ("model.embed_tokens.weight", "lm_head.weight") or key.endswith("q_proj.weight"):
            return rows
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            return ShardSpec(0) if tp <= 2 else None  # 2 kv heads: replicated over 4 ranks
        if key.endswith("gate_up_proj.weight"):
            return ShardSpec(1, view=(2, -1, 32))
        if key.endswith(("o_proj.weight", "down_proj.weight")):
            return ShardSpec(1)
        return None
    rows = ShardSpec(0, sizes={2: (49, 48), 4: (25, 24, 24, 24)}[tp])  # vocab 97
    if key in ("transformer.wte.weight", "lm_head.weight", "lm_head.bias"):
        return rows
    if key.endswith("qkv_proj.weight"):
        return ShardSpec(1, view=(3, -1, 32))
    if key.endswith(("out_proj.weight", "fc_out.weight", "c_proj.weight")):
        return ShardSpec(1)
    if key.endswith(("fc_in.weight", "fc_in.bias", "c_fc.weight", "c_fc.bias")):
        return ShardSpec(0)
    return None  # wpe, norms, out_proj / fc_out / c_proj biases


@pytest.mark.parametrize(("name", "tp"), [("gptj", 2), ("gpt_neo", 2), ("mistral", 2), ("mistral", 4), ("gptj", 4)])
def test_tp_specs_every_key(name, tp):
    model = tiny_model(name, tie_word_embeddings=False)  # every key there is, the head included
    rules = SpecRules(MODULES[name].tp_specs(tp, model.config))
    ours = global_view(name, model)
    assert "lm_head.weight" in ours
    for key in ours:
        matched = rules.match(key)
        assert (None if matched is None else matched[0][0]) == _expected_spec(name, key, tp), key


@pytest.mark.parametrize("name", NAMES)
def test_tp_specs_errors_and_dict_configs(name):
    mod = MODULES[name]
    cfg = tiny_config(name, **({"intermediate_size": 96} if name == "mistral" else {}))  # heads fail first
    heads = {"gptj": "n_head", "gpt_neo": "num_heads", "mistral": "num_attention_heads"}[name]
    with pytest.raises(SpecError, match=f"{name}: {heads}=4 does not divide by tp=3"):
        mod.tp_specs(3, cfg)
    with pytest.raises(SpecError, match="needs the model config"):
        mod.tp_specs(2)
    with pytest.raises(SpecError, match="positive int"):
        mod.tp_specs(0, cfg)
    # plain dicts, with the field names the family's config takes, and a prefix
    as_dict = {
        "gptj": {"n_embd": 32, "n_head": 8, "vocab_size": 97, "n_inner": 36},
        "gpt_neo": {"hidden_size": 32, "num_heads": 8, "vocab_size": 97, "intermediate_size": 36},
        "mistral": {
            "hidden_size": 32,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "vocab_size": 97,
            "intermediate_size": 36,
        },
    }[name]
    inner = {"gptj": "n_inner", "gpt_neo": "intermediate_size", "mistral": "intermediate_size"}[name]
    with pytest.raises(SpecError, match=f"{inner}=36 does not divide by tp=8"):
        mod.tp_specs(8, as_dict)
    specs = mod.tp_specs(4, as_dict, prefix="model.")
    embed = "model.embed_tokens.weight" if name == "mistral" else "transformer.wte.weight"
    assert specs["model." + embed] == ShardSpec(0, sizes=(25, 24, 24, 24))
    with pytest.raises(SpecError, match="vocab_size=3 is smaller than tp=4"):
        mod.tp_specs(4, {**as_dict, "vocab_size": 3, inner: 32})
    if name != "mistral":  # the alternative (attribute-map) names are accepted too
        alt = {"hidden_size": 32, "num_attention_heads": 4, "vocab_size": 96}
        qkv = QKV[name][0].replace("{i}", "*")
        assert mod.tp_specs(2, alt)[qkv] == ShardSpec(1, view=(3, -1, 32))


def test_mistral_gqa_replicates_kv_at_tp4():
    specs, attn = MODULES["mistral"].tp_specs(4, tiny_config("mistral")), "model.layers.*.self_attn."
    assert specs[attn + "q_proj.weight"] == ShardSpec(0)
    assert attn + "k_proj.weight" not in specs and attn + "v_proj.weight" not in specs
    with pytest.raises(SpecError, match="num_attention_heads=4 does not divide by tp=8"):
        MODULES["mistral"].tp_specs(8, tiny_config("mistral"))


# -- the translated weights mean the same thing --------------------------------------------------------


@pytest.mark.parametrize("name", ["gptj", "gpt_neo"])
@pytest.mark.parametrize("tp", [2, 4])
def test_qkv_shard_is_q_k_v_of_its_heads(name, tp):
    """Rank r's local QKV Linear outputs exactly HF's q, k and v features of heads r*nh/tp.."""
    model = tiny_model(name)
    ranks = shard_all(name, global_view(name, model), tp, model.config)
    d, w = 32, 32 // tp
    x = torch.randn(2, 5, d, dtype=torch.float64)
    for layer in range(2):
        attn = model.transformer.h[layer].attn
        attn = attn if name == "gptj" else attn.attention
        hf = [getattr(attn, f"{p}_proj")(x) for p in "qkv"]
        key = QKV[name][0].format(i=layer)
        for rank, local in enumerate(ranks):
            assert local[key].shape == (3 * w, d)
            for j, out in enumerate((x @ local[key].T).chunk(3, -1)):
                torch.testing.assert_close(out, hf[j][..., rank * w : (rank + 1) * w], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_reference_forward_matches_hf_logits(name, tp):
    """Our layout, sharded by tp_specs and run rank by rank (all-reduce by summing), gives HF's logits.

    tp=4 splits GPT-J's and GPT-Neo's odd vocabulary (97) unevenly -- GPT-J's head bias with it -- and
    replicates Mistral's k/v (nkv=2 < tp)."""
    model = tiny_model(name)
    ranks = shard_all(name, global_view(name, model), tp, model.config)
    ids = _ids(model.config, tp)
    with torch.no_grad():
        expect = model(ids).logits
    torch.testing.assert_close(forward(ranks, model.config, ids), expect, rtol=1e-5, atol=1e-5)


def test_gptneo_local_window_masks():
    """The tiny GPT-Neo's local layer (window 4) really masks at length 7: treating it as global misses HF."""
    model = tiny_model("gpt_neo")
    assert model.config.attention_layers == ["global", "local"]
    ranks = shard_all("gpt_neo", global_view("gpt_neo", model), 1, model.config)
    ids = _ids(model.config, 5)
    all_global = copy.deepcopy(model.config)
    all_global.attention_layers = ["global", "global"]
    with torch.no_grad():
        expect = model(ids).logits
    assert not torch.allclose(FORWARDS["gpt_neo"](ranks, all_global, ids), expect, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(FORWARDS["gpt_neo"](ranks, model.config, ids), expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_exported_files_load_into_transformers(tmp_path, name):
    """What we export is what transformers reads: a save_pretrained-style folder and a strict load_state_dict."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = tiny_model(name, dtype=torch.float32)
    mod = MODULES[name]
    ours = {k: v.clone() for k, v in mod.translate_hf_state_dict_to_smpckpt(model.state_dict()).items()}
    model.config.save_pretrained(tmp_path)
    save_file(
        {k: v.contiguous() for k, v in mod.translate_state_dict_to_hf(ours).items()},
        str(tmp_path / "model.safetensors"),
        metadata={"format": "pt"},
    )
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(loaded).__name__ == mod.TRANSLATION.architecture
    fresh = AutoModelForCausalLM.from_config(model.config, attn_implementation="eager").eval()
    fresh.load_state_dict(mod.translate_state_dict_to_hf(ours, tie_word_embeddings=model.config.tie_word_embeddings))
    ids = _ids(model.config, 0, (2, 6))
    with torch.no_grad():
        expect = model(ids).logits
        assert torch.equal(loaded(ids).logits, expect)
        assert torch.equal(fresh(ids).logits, expect)


# -- SageMaker model parallel (smp v1) names -----------------------------------------------------------

SMP = {
    "gptj": ("translate_state_dict_to_hf_gptj", "translate_hf_state_dict_to_smdistributed_gptj", "attn."),
    "gpt_neo": (
        "translate_state_dict_to_hf_gptneo",
        "translate_hf_state_dict_to_smdistributed_gptneo",
        "attn.attention.",
    ),
}


def test_smp_alias_names():
    gptj = MODULES["gptj"]
    assert gptj.translate_hf_gptj_state_dict_to_smdistributed_gptj is gptj.translate_hf_state_dict_to_smdistributed_gptj
    assert not any(k.startswith("translate_") and "smdistributed" in k for k in MODULES["mistral"].__all__)


@pytest.mark.parametrize("name", ["gptj", "gpt_neo"])
def test_smp_aliases_load_strictly(name):
    """``..._to_hf_<fam>(ours)`` is what ``load_state_dict(strict=True)`` takes (the tied head included);
    with ``max_seq_len`` the old mask buffers are added per layer (which current transformers refuses
    strictly, and reports as nothing but unexpected keys); the import alias undoes it."""
    from transformers import AutoModelForCausalLM

    to_hf, to_ours, attn = SMP[name]
    mod = MODULES[name]
    model = tiny_model(name, dtype=torch.float32)
    ours = getattr(mod, to_ours)(model.state_dict())
    assert_same_state(ours, mod.translate_hf_state_dict_to_smpckpt(model.state_dict()))
    fresh = AutoModelForCausalLM.from_config(model.config, attn_implementation="eager").eval()
    fresh.load_state_dict(getattr(mod, to_hf)(ours), strict=True)
    ids = _ids(model.config, 1)
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)

    old = getattr(mod, to_hf)(ours, max_seq_len=16)
    buffers = {f"transformer.h.{i}.{attn}{b}" for i in range(2) for b in ("bias", "masked_bias")}
    assert set(old) - set(getattr(mod, to_hf)(ours)) == buffers
    for i in range(2):
        mask = old[f"transformer.h.{i}.{attn}bias"]
        assert mask.shape == (1, 1, 16, 16) and mask.dtype == torch.bool
        assert torch.equal(mask[0, 0], torch.ones(16, 16, dtype=torch.bool).tril())
        assert old[f"transformer.h.{i}.{attn}masked_bias"].item() == -1e9
    with pytest.raises(RuntimeError, match="Unexpected key"):
        fresh.load_state_dict(old, strict=True)
    result = fresh.load_state_dict(old, strict=False)
    assert set(result.unexpected_keys) == buffers and not result.missing_keys
    assert_same_state(getattr(mod, to_ours)(old), ours)  # the buffers are dropped again on import
    with pytest.raises(ValueError, match="max_seq_len must be a positive int"):
        getattr(mod, to_hf)(ours, max_seq_len=0)

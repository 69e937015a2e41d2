"""smpckpt.hf.{bert,roberta}: bit-exact round trips, the fused q/k/v layout, tied MLM decoders, buffers,
tp_specs for every key (head and bare models), a reference TP forward equal to HF's logits, exported files
loading into transformers, and smp v1's alias names."""

from __future__ import annotations

import re

import pytest
import torch
from hf_reference import assert_same_state
from ref_encoders import AUTO_CLASS, FORWARDS, MODULES, PREFIXES, global_view, shard_all, tiny_config, tiny_model

from smpckpt.errors import SpecError
from smpckpt.model.specs import ShardSpec, SpecRules

NAMES = ["bert", "roberta"]
D, LAYERS = 32, 2


def _decoder(name: str) -> set[str]:
    head = PREFIXES[name][1]
    return {head + "decoder.weight", head + "decoder.bias"}


def _qkv_parts(base: str, i: int, w: str) -> list[str]:
    return [f"{base}encoder.layer.{i}.attention.self.{n}.{w}" for n in ("query", "key", "value")]


def _expected_keys(name: str, hf: dict[str, torch.Tensor], base: str) -> set[str]:
    """Our keys: HF's, less q/k/v and a tied decoder, plus the fused qkv."""
    fused = {f"{base}encoder.layer.{i}.attention.self.qkv.{w}" for i in range(LAYERS) for w in ("weight", "bias")}
    parts = {k for i in range(LAYERS) for w in ("weight", "bias") for k in _qkv_parts(base, i, w)}
    return (set(hf) - parts - _decoder(name)) | fused


# -- eager translation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", NAMES)
def test_round_trip_hf_ours_hf(name, dtype, tied):
    model = tiny_model(name, dtype=dtype, tie_word_embeddings=tied)
    hf, mod = model.state_dict(), MODULES[name]
    assert _decoder(name) <= set(hf)  # model.state_dict() holds the decoder, tied or not
    ours = mod.translate_hf_state_dict_to_smpckpt(hf)
    assert (_decoder(name) <= set(ours)) is not tied and (_decoder(name) & set(ours) == set()) is tied
    assert_same_state(mod.translate_state_dict_to_hf(ours, tie_word_embeddings=tied), hf)
    # the default export leaves a tied decoder out, as save_pretrained does
    assert set(mod.translate_state_dict_to_hf(ours)) == set(hf) - (_decoder(name) if tied else set())
    # ours -> HF -> ours, from model shapes and from view shapes
    assert_same_state(mod.translate_hf_state_dict_to_smpckpt(mod.translate_state_dict_to_hf(ours)), ours)
    view = mod.translate_hf_state_dict_to_smpckpt(hf, keep_view_shapes=True)
    assert_same_state(
        mod.translate_hf_state_dict_to_smpckpt(mod.translate_state_dict_to_hf(view), keep_view_shapes=True), view
    )
    assert_same_state(mod.translate_state_dict_to_hf(view, tie_word_embeddings=tied), hf)
    # the eager helpers agree with the lazy rules
    plan = mod.TRANSLATION.from_artifact({k: v.shape for k, v in mod.translate_state_dict_to_hf(ours).items()})
    assert {k: shape for k, (_, shape) in plan.items()} == {k: tuple(v.shape) for k, v in view.items()}


@pytest.mark.parametrize("name", NAMES)
def test_layout(name):
    base = PREFIXES[name][0]
    hf = tiny_model(name).state_dict()
    mod = MODULES[name]
    ours = mod.translate_hf_state_dict_to_smpckpt(hf)
    view = mod.translate_hf_state_dict_to_smpckpt(hf, keep_view_shapes=True)
    assert set(ours) == set(view) == _expected_keys(name, hf, base)
    for i in range(LAYERS):
        p = f"{base}encoder.layer.{i}.attention.self.qkv."
        q, k, v = _qkv_parts(base, i, "weight")
        qb, kb, vb = _qkv_parts(base, i, "bias")
        assert ours[p + "weight"].shape == (3 * D, D) and ours[p + "bias"].shape == (3 * D,)
        assert view[p + "weight"].shape == (3, D, D) and view[p + "bias"].shape == (3, D)
        assert torch.equal(ours[p + "weight"], torch.cat([hf[q], hf[k], hf[v]]))
        assert torch.equal(ours[p + "bias"], torch.cat([hf[qb], hf[kb], hf[vb]]))
        for j, (w, b) in enumerate([(q, qb), (k, kb), (v, vb)]):
            assert torch.equal(view[p + "weight"][j], hf[w]) and torch.equal(view[p + "bias"][j], hf[b])
        assert view[p + "weight"][1, 5, 7] == hf[k][5, 7] and view[p + "bias"][2, 3] == hf[vb][3]
    for key in set(ours) - {k for k in ours if ".qkv." in k}:
        assert torch.equal(ours[key], hf[key]), key  # every other tensor under its HF key, unchanged


@pytest.mark.parametrize("name", NAMES)
def test_bare_base_model_round_trips(name):
    """BertModel / RobertaModel keys (``encoder.layer.0...``, ``embeddings...``, ``pooler...``)."""
    model = tiny_model(name, auto_class="AutoModel")
    hf, mod = model.state_dict(), MODULES[name]
    assert "pooler.dense.weight" in hf and not any(k.startswith(PREFIXES[name][0]) for k in hf)
    ours = mod.translate_hf_state_dict_to_smpckpt(hf)
    assert set(ours) == _expected_keys(name, hf, "")
    assert ours["encoder.layer.1.attention.self.qkv.weight"].shape == (3 * D, D)
    assert_same_state(mod.translate_state_dict_to_hf(ours), hf)
    view = mod.translate_hf_state_dict_to_smpckpt(hf, keep_view_shapes=True)
    assert view["encoder.layer.1.attention.self.qkv.bias"].shape == (3, D)
    assert_same_state(mod.translate_state_dict_to_hf(view), hf)
    plan = mod.TRANSLATION.from_artifact({k: v.shape for k, v in hf.items()})
    assert {k: shape for k, (_, shape) in plan.items()} == {k: tuple(v.shape) for k, v in view.items()}


@pytest.mark.parametrize("name", NAMES)
def test_tied_decoder_detection(name):
    mod, (base, head) = MODULES[name], PREFIXES[name]
    embed = base + "embeddings.word_embeddings.weight"
    hf = dict(tiny_model(name).state_dict())
    assert hf[head + "decoder.weight"].data_ptr() == hf[embed].data_ptr()  # tied: one tensor, two names
    copied = {**hf, head + "decoder.weight": hf[embed].clone(), head + "decoder.bias": hf[head + "bias"].clone()}
    assert not _decoder(name) & set(mod.translate_hf_state_dict_to_smpckpt(copied))  # a file with both entries
    untied = {**hf, head + "decoder.weight": hf[embed] + 1}
    ours = mod.translate_hf_state_dict_to_smpckpt(untied)  # an untied weight is kept, the equal bias dropped
    assert torch.equal(ours[head + "decoder.weight"], untied[head + "decoder.weight"])
    assert head + "decoder.bias" not in ours
    assert_same_state(mod.translate_state_dict_to_hf(ours, tie_word_embeddings=True), untied)
    bias_only = {**hf, head + "decoder.bias": hf[head + "bias"] * 2}
    ours = mod.translate_hf_state_dict_to_smpckpt(bias_only)
    assert head + "decoder.weight" not in ours and torch.equal(ours[head + "decoder.bias"], hf[head + "bias"] * 2)
    assert _decoder(name) <= set(mod.translate_hf_state_dict_to_smpckpt(hf, tie_word_embeddings=False))
    with pytest.raises(ValueError, match=f"tie_word_embeddings=True but '{head}decoder.weight' differs"):
        mod.translate_hf_state_dict_to_smpckpt(untied, tie_word_embeddings=True)
    with pytest.raises(ValueError, match=f"tie_word_embeddings=True but '{head}decoder.bias' differs"):
        mod.translate_hf_state_dict_to_smpckpt(bias_only, tie_word_embeddings=True)


@pytest.mark.parametrize("name", NAMES)
def test_buffers_are_dropped_on_import(name):
    mod, base = MODULES[name], PREFIXES[name][0]
    for hf, prefix in (
        (tiny_model(name).state_dict(), base),
        (tiny_model(name, auto_class="AutoModel").state_dict(), ""),
    ):
        extra = {
            prefix + "embeddings.position_ids": torch.arange(40).unsqueeze(0),
            prefix + "embeddings.token_type_ids": torch.zeros(1, 40, dtype=torch.int64),
        }
        assert set(mod.translate_hf_state_dict_to_smpckpt({**hf, **extra})) == set(
            mod.translate_hf_state_dict_to_smpckpt(hf)
        )
        assert all(mod.TRANSLATION.is_ignored(k) for k in extra)


def test_inconsistent_inputs_raise_clear_errors():
    mod = MODULES["bert"]
    hf = tiny_model("bert").state_dict()
    key = "bert.encoder.layer.1.attention.self.key.weight"
    with pytest.raises(ValueError, match=re.escape(f"['{key}'] is missing")):
        mod.translate_hf_state_dict_to_smpckpt({k: v for k, v in hf.items() if k != key})
    with pytest.raises(ValueError, match=r"must share a shape"):
        mod.translate_hf_state_dict_to_smpckpt({**hf, key: torch.zeros(30, 32)})
    with pytest.raises(ValueError, match=r"does not split into 3 fused parts"):
        mod.translate_state_dict_to_hf({"bert.encoder.layer.0.attention.self.qkv.weight": torch.zeros(95, 32)})


# -- tp_specs ------------------------------------------------------------------------------------------


def _expected_spec(name: str, key: str) -> ShardSpec | None:
    """What each key must get at tp=2 (hidden 32, vocab 97: rows split 49 / 48), written per key."""
    head = PREFIXES[name][1]
    rows = ShardSpec(0, sizes=(49, 48))
    if key.endswith("embeddings.word_embeddings.weight") or key in {head + "bias", *_decoder(name)}:
        return rows
    if key.endswith("attention.self.qkv.weight"):
        return ShardSpec(1, view=(3, -1, D))
    if key.endswith("attention.self.qkv.bias"):
        return ShardSpec(1, view=(3, -1))
    if re.fullmatch(r"(\w+\.)?encoder\.layer\.\d+\.(attention\.)?output\.dense\.weight", key):
        return ShardSpec(1)  # row-parallel: the attention's output and the layer's
    if re.fullmatch(r"(\w+\.)?encoder\.layer\.\d+\.intermediate\.dense\.(weight|bias)", key):
        return ShardSpec(0)
    replicated = ("LayerNorm", "layer_norm", "position_embeddings", "token_type_embeddings", "output.dense.bias")
    assert any(r in key for r in replicated) or key.startswith(
        (
            "pooler.",
            f"{PREFIXES[name][0]}pooler.",
            "cls.predictions.transform.",
            "cls.seq_relationship.",
            "lm_head.dense.",
            "classifier.",
        )
    ), key
    return None


def _spec_of(rules: SpecRules, key: str) -> ShardSpec | None:
    matched = rules.match(key)
    return None if matched is None else matched[0][0]


@pytest.mark.parametrize("name", NAMES)
def test_tp_specs_every_key(name):
    """Each key of the MLM model (tied and untied), the bare model, sequence classification and (BERT) pre-training."""
    mod = MODULES[name]
    cfg = tiny_config(name)
    models = [
        tiny_model(name),
        tiny_model(name, tie_word_embeddings=False),
        tiny_model(name, auto_class="AutoModel"),
        tiny_model(name, auto_class="AutoModelForSequenceClassification"),
    ] + ([tiny_model(name, auto_class="AutoModelForPreTraining")] if name == "bert" else [])
    keys = set().union(*(mod.translate_hf_state_dict_to_smpckpt(m.state_dict()) for m in models))
    assert _decoder(name) <= keys and "pooler.dense.weight" in keys and any(k.startswith("classifier.") for k in keys)
    assert ("cls.seq_relationship.weight" in keys) is (name == "bert")
    rules, nested = SpecRules(mod.tp_specs(2, cfg)), SpecRules(mod.tp_specs(2, cfg, prefix="model."))
    under = SpecRules(mod.tp_specs(2, cfg), also_under=("model",))
    for key in sorted(keys):
        expect = _expected_spec(name, key)
        assert _spec_of(rules, key) == expect, key
        assert _spec_of(nested, "model." + key) == _spec_of(under, "model." + key) == expect, key
    # fnmatch's * crosses dots: cross-attention (replicated under HF's keys) must not match the layer output
    base = PREFIXES[name][0]
    assert _spec_of(rules, base + "encoder.layer.0.crossattention.output.dense.weight") is None
    assert _spec_of(rules, base + "encoder.layer.11.output.dense.weight") == ShardSpec(1)
    assert mod.tp_specs(4, {**cfg.to_dict(), "vocab_size": 96})["embeddings.word_embeddings.weight"] == ShardSpec(0)


@pytest.mark.parametrize("name", NAMES)
def test_tp_specs_errors(name):
    mod = MODULES[name]
    cfg = {"hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 97}
    with pytest.raises(SpecError, match=f"{name}: num_attention_heads=4 does not divide by tp=3"):
        mod.tp_specs(3, tiny_config(name))
    with pytest.raises(SpecError, match="intermediate_size=66 does not divide by tp=4"):
        mod.tp_specs(4, {**cfg, "intermediate_size": 66})
    with pytest.raises(SpecError, match="vocab_size=3 is smaller than tp=4"):
        mod.tp_specs(4, {**cfg, "vocab_size": 3})
    with pytest.raises(SpecError, match="needs the model config"):
        mod.tp_specs(2)
    with pytest.raises(SpecError, match=r"none of \['hidden_size'\]"):
        mod.tp_specs(2, {k: v for k, v in cfg.items() if k != "hidden_size"})
    with pytest.raises(SpecError, match="positive int"):
        mod.tp_specs(0, cfg)


# -- meaning: TP shards compute HF's outputs ------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qkv_shard_is_q_k_v_of_its_heads(name, tp):
    """Rank r's local QKV Linear outputs exactly HF's query, key and value features of heads r*nh/tp.."""
    model = tiny_model(name)
    cfg, ours, base = model.config, global_view(name, model), PREFIXES[name][0]
    w = D // tp
    x = torch.randn(2, 5, D, dtype=torch.float64)
    ranks = shard_all(name, ours, tp, cfg)
    for i in range(LAYERS):
        attn = getattr(model, base[:-1]).encoder.layer[i].attention.self
        hf = torch.stack([attn.query(x), attn.key(x), attn.value(x)], -2)  # [B, T, 3, d]
        p = f"{base}encoder.layer.{i}.attention.self.qkv."
        for rank, local in enumerate(ranks):
            assert local[p + "weight"].shape == (3 * w, D) and local[p + "bias"].shape == (3 * w,)
            out = torch.nn.functional.linear(x, local[p + "weight"], local[p + "bias"]).unflatten(-1, (3, w))
            torch.testing.assert_close(out, hf[..., rank * w : (rank + 1) * w], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("tp", "tied"), [(1, True), (2, True), (4, True), (2, False), (4, False)])
def test_reference_forward_matches_hf_logits(name, tp, tied):
    """Our layout, sharded by tp_specs and run rank by rank (all-reduce by summing), gives HF's logits.

    vocab 97 splits unevenly at tp 2 and 4; untied, the decoder's own weight and bias are vocab-parallel."""
    model = tiny_model(name, tie_word_embeddings=tied)
    ranks = shard_all(name, global_view(name, model), tp, model.config)
    assert (PREFIXES[name][1] + "decoder.weight" in ranks[0]) is not tied
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(tp))
    ids[0, -2:] = model.config.pad_token_id  # RoBERTa: padding keeps position pad_token_id
    with torch.no_grad():
        expect = model(ids).logits
        got = FORWARDS[name](ranks, model.config, ids)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


# -- transformers reads what we export -------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("name", NAMES)
def test_exported_files_load_into_transformers(tmp_path, name, tied):
    import transformers
    from safetensors.torch import save_file

    cls = getattr(transformers, AUTO_CLASS[name])
    model = tiny_model(name, dtype=torch.float32, tie_word_embeddings=tied)
    mod = MODULES[name]
    ours = {k: v.clone() for k, v in mod.translate_hf_state_dict_to_smpckpt(model.state_dict()).items()}
    model.config.save_pretrained(tmp_path)
    save_file(
        {k: v.contiguous() for k, v in mod.translate_state_dict_to_hf(ours).items()},
        str(tmp_path / "model.safetensors"),
        metadata={"format": "pt"},
    )
    loaded = cls.from_pretrained(tmp_path, attn_implementation="eager").eval()
    fresh = cls.from_config(model.config, attn_implementation="eager").eval()
    fresh.load_state_dict(mod.translate_state_dict_to_hf(ours, tie_word_embeddings=tied), strict=True)
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expect = model(ids).logits
        assert torch.equal(loaded(ids).logits, expect)
        assert torch.equal(fresh(ids).logits, expect)


def test_smp_alias_names():
    from smpckpt.hf import bert, roberta

    assert bert.translate_hf_state_dict_to_smdistributed_bert is bert.translate_hf_state_dict_to_smpckpt
    assert roberta.translate_hf_state_dict_to_smdistributed_roberta is roberta.translate_hf_state_dict_to_smpckpt
    assert roberta.translate_state_dict_to_smdistributed is roberta.translate_hf_state_dict_to_smpckpt
    for mod, fam in ((bert, "bert"), (roberta, "roberta")):
        assert {"TRANSLATION", "translate_hf_state_dict_to_smpckpt", "translate_state_dict_to_hf", "tp_specs"} | {
            f"translate_state_dict_to_hf_{fam}",
            f"translate_hf_state_dict_to_smdistributed_{fam}",
        } <= set(mod.__all__)
        assert all(hasattr(mod, n) for n in mod.__all__)
        assert mod.TRANSLATION.name == fam
        assert mod.TRANSLATION.architecture == {"bert": "BertForMaskedLM", "roberta": "RobertaForMaskedLM"}[fam]
    assert "translate_state_dict_to_smdistributed" in roberta.__all__


@pytest.mark.parametrize("name", NAMES)
def test_smp_to_hf_alias_loads_strictly(name):
    mod, base = MODULES[name], PREFIXES[name][0]
    to_hf = getattr(mod, f"translate_state_dict_to_hf_{name}")
    model = tiny_model(name)
    ours = getattr(mod, f"translate_hf_state_dict_to_smdistributed_{name}")(model.state_dict())
    assert set(ours) == set(mod.translate_hf_state_dict_to_smpckpt(model.state_dict()))
    exported = to_hf(ours)
    assert_same_state(exported, model.state_dict())  # what load_state_dict(strict=True) wants: tied decoder included
    fresh = tiny_model(name, seed=1)
    fresh.load_state_dict(exported, strict=True)
    ids = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)
    with_ids = to_hf(ours, max_seq_len=40)
    assert set(with_ids) - set(exported) == {base + "embeddings.position_ids"}
    buf = with_ids[base + "embeddings.position_ids"]
    assert buf.shape == (1, 40) and buf.dtype == torch.int64 and torch.equal(buf[0], torch.arange(40))
    with pytest.raises(RuntimeError, match="Unexpected key.*position_ids"):  # why None is the default
        fresh.load_state_dict(with_ids, strict=True)
    # the bare model's buffer goes under its own (empty) prefix
    bare = mod.translate_hf_state_dict_to_smpckpt(tiny_model(name, auto_class="AutoModel").state_dict())
    assert "embeddings.position_ids" in to_hf(bare, max_seq_len=8)
    with pytest.raises(ValueError, match="max_seq_len must be a positive int"):
        to_hf(ours, max_seq_len=0)
    with pytest.raises(ValueError, match="cannot tell where embeddings.position_ids goes"):
        # (a dict the translation takes, a fused q/k/v, but without embeddings: the eager export refuses one it
        # takes nothing of, as the online export does)
        qkv = base + "encoder.layer.0.attention.self.qkv.weight"
        to_hf({"lm_head.dense.weight": torch.zeros(2, 2), qkv: torch.zeros(3, 2, 2)}, max_seq_len=8)

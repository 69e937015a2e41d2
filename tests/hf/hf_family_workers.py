"""Rank functions of the per-family Hugging Face end-to-end test (two real gloo ranks).

For every family: an HF model -> our TP=2 shards (each rank holds only its pieces, in a parameter-only
module) -> a partial checkpoint -> a full HF artifact, online (``save_checkpoint(partial=False)``) and
offline (``consolidate_checkpoint`` of the partial one), and online in bf16 under the ``config.json``
``save_pretrained`` wrote (which says float32); and an HF ``save_pretrained`` folder cut into small
shards -> our TP=2 layout. Then what must be refused: a folder of an untied model whose head differs
from its embedding, loaded into a model tying them (until ``keep_tied`` says which to keep), and
another family's translation, on export and on import. The spec rules are ``tp_specs``' defaults (the
model's own names), as a user writes them. The pipeline case loads a GPT-2 folder, which leaves the
tied head out, into two stages whose last holds its own ``lm_head.weight``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
from hf_e2e_workers import Holder, name_map_for, stage_keys, to_local_name
from hf_reference import AUTO_CLASS, MODULES, global_view, shard, tiny_config, tiny_model

import smpckpt
from smpckpt.model.layout import ParallelLayout
from smpckpt.model.specs import SpecRules

TP = ParallelLayout(tp=2)
PP = ParallelLayout(pp=2, pp_layers=(1, 1))
SEED = 7


def _ids(config: Any) -> torch.Tensor:
    return torch.randint(3, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(11))


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose values differ (or are missing) -- empty when every tensor is bit-exact."""
    return sorted(k for k in want if k not in got or not torch.equal(got[k], want[k]))


def _expected_shards(name: str, model: Any, rank: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    specs = MODULES[name].tp_specs(TP.tp, model.config)
    rules = SpecRules(specs)
    mine = {}
    for key, tensor in global_view(name, model).items():
        matched = rules.match(key)
        mine[key] = shard(key, tensor, None if matched is None else matched[0][0], TP.tp, rank)
    return specs, mine


def untied_model(name: str) -> Any:
    """The family's model with its heads untied, each different from the tensor HF would tie it to."""
    return tiny_model(name, seed=SEED + 1, dtype=torch.float32, tie_word_embeddings=False)


def other_family(name: str) -> str:
    """A family of another layout than ``name``'s: neither's rules hold the other's (Llama, Qwen2 and
    Mistral share theirs; Llama's add the gate/up bias)."""
    rules = {n: {(r.ours, r.artifact) for r in MODULES[n].TRANSLATION.rules} for n in MODULES}
    names = sorted(MODULES)
    return next(
        n for n in names[names.index(name) + 1 :] + names if not (rules[n] <= rules[name] or rules[name] <= rules[n])
    )


def _error(fn: Any) -> str:
    try:
        fn()
    except smpckpt.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def tie_mismatch(rank: int, name: str, untied_dir: str) -> dict[str, Any]:
    """A folder whose heads differ from their embeddings, into our TP=2 model that ties them."""
    mod = MODULES[name]
    untied = untied_model(name)
    specs, mine = _expected_shards(name, untied, rank)
    heads = {h: e for h, e in mod.TRANSLATION.tied.items() if h in mine and e in mine}
    held = Holder({k: torch.zeros_like(v) for k, v in mine.items() if k not in heads})
    for head, embed in heads.items():  # the head is the embedding's very parameter, as HF ties them
        *path, leaf = head.split(".")
        owner: torch.nn.Module = held
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        setattr(owner, leaf, held.get_parameter(embed))
    common: dict[str, Any] = dict(partial=False, model=held, translate_function=mod.TRANSLATION, layout=TP, specs=specs)
    out: dict[str, Any] = {"heads": heads}
    out["refused"] = _error(lambda: smpckpt.resume_from_checkpoint(untied_dir, **common))
    smpckpt.resume_from_checkpoint(untied_dir, keep_tied=[f"model.{h}" for h in heads], **common)
    want = {k: v for k, v in mine.items() if k not in heads}
    want.update({embed: mine[head] for head, embed in heads.items()})  # the tied tensor took the heads
    out["kept_heads"] = _same(dict(held.named_parameters()), want)
    out["still_tied"] = all(held.get_parameter(h) is held.get_parameter(e) for h, e in heads.items())
    return out


def wrong_translation(rank: int, name: str, root: str, hf_dir: str, holder: Any, specs: Any) -> dict[str, Any]:
    """Another family's translation, refused on export (nothing written) and on import."""
    other = MODULES[other_family(name)].TRANSLATION
    kw: dict[str, Any] = dict(partial=False, model=holder, translate_function=other, layout=TP, specs=specs)
    return {
        "other": other.name,
        "export": _error(lambda: smpckpt.save_checkpoint(root, f"{name}-wrong", **kw)),
        "import": _error(lambda: smpckpt.resume_from_checkpoint(hf_dir, strict=False, **kw)),
        "written": sorted(os.listdir(os.path.join(root, f"{name}-wrong")))
        if os.path.isdir(os.path.join(root, f"{name}-wrong"))
        else [],
    }


def one_family(rank: int, name: str, root: str, hf_dir: str) -> dict[str, Any]:
    mod = MODULES[name]
    model = tiny_model(name, seed=SEED, dtype=torch.float32)
    specs, mine = _expected_shards(name, model, rank)
    common = dict(layout=TP, specs=specs)
    holder = Holder({k: v.clone() for k, v in mine.items()})
    out: dict[str, Any] = {}

    # our TP=2 shards -> partial checkpoint -> back into zeroed shards
    smpckpt.save_checkpoint(root, name, model=holder, save_rng=False, **common)
    back = Holder({k: torch.zeros_like(v) for k, v in mine.items()})
    smpckpt.resume_from_checkpoint(root, name, model=back, **common)
    out["partial_round_trip"] = _same(dict(back.named_parameters()), mine)

    # -> full artifact with HF names (config never saved: architectures and dtype come from us)
    fresh_config = tiny_config(name)
    smpckpt.save_checkpoint(
        root,
        f"{name}-full",
        partial=False,
        model=holder,
        translate_function=mod.TRANSLATION,
        hf_config=fresh_config,
        **common,
    )
    if rank == 0:  # the partial checkpoint -> the same artifact offline, config as a plain dict
        smpckpt.consolidate_checkpoint(
            os.path.join(root, f"{name}_partial"),
            os.path.join(root, f"{name}-offline"),
            translation=mod.TRANSLATION,
            hf_config=fresh_config.to_dict(),
            progress=False,
        )

    # bf16, under the config.json save_pretrained wrote (it says float32): config.json must say bfloat16
    with open(os.path.join(hf_dir, "config.json")) as f:
        pretrained_config = json.load(f)
    smpckpt.save_checkpoint(
        root,
        f"{name}-bf16",
        partial=False,
        model=holder,
        translate_function=mod.TRANSLATION,
        hf_config=pretrained_config,
        dtype=torch.bfloat16,
        **common,
    )

    # HF save_pretrained folder in small shards -> our TP=2 layout, each rank reading its pieces
    loaded = Holder({k: torch.full_like(v, -3.0) for k, v in mine.items()})
    smpckpt.resume_from_checkpoint(hf_dir, partial=False, model=loaded, translate_function=mod.TRANSLATION, **common)
    out["hf_folder_into_tp2"] = _same(dict(loaded.named_parameters()), mine)
    # our own artifact of the HF model (HF names, no translation; replicated over both ranks) -> TP=2 the same way
    smpckpt.save_checkpoint(root, f"{name}-hfnames", partial=False, model=model, hf_config=model.config)
    loaded = Holder({k: torch.full_like(v, -3.0) for k, v in mine.items()})
    smpckpt.resume_from_checkpoint(
        root, f"{name}-hfnames", partial=False, model=loaded, translate_function=mod.TRANSLATION, **common
    )
    out["hf_names_artifact_into_tp2"] = _same(dict(loaded.named_parameters()), mine)
    out["tie_mismatch"] = tie_mismatch(rank, name, f"{hf_dir}-untied")
    out["wrong_translation"] = wrong_translation(rank, name, root, hf_dir, holder, specs)

    dist.barrier()
    if rank == 0:
        import transformers

        auto = getattr(transformers, AUTO_CLASS[name])
        ids, want = _ids(model.config), _logits(model, _ids(model.config))
        for artifact in (f"{name}-full", f"{name}-offline"):
            folder = os.path.join(root, artifact)
            hf = auto.from_pretrained(folder, attn_implementation="eager").eval()
            out[f"{artifact}:logits_equal"] = bool(torch.equal(_logits(hf, ids), want))
            out[f"{artifact}:class"] = type(hf).__name__
            out[f"{artifact}:weights"] = _same(hf.state_dict(), model.state_dict())
        folder = os.path.join(root, f"{name}-bf16")
        with open(os.path.join(folder, "config.json")) as f:
            out["bf16:config_dtype"] = json.load(f).get("dtype")
        hf = auto.from_pretrained(folder, attn_implementation="eager").eval()
        out["bf16:model_dtype"] = hf.dtype
        out["bf16:weights"] = _same(hf.state_dict(), {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    return out


# -- pipeline: GPT-2 over two stages, the last holding its own copy of the tied head ------------------
def pipeline(rank: int, root: str, hf_dir: str) -> dict[str, Any]:
    model = tiny_model("gpt2", seed=SEED, dtype=torch.float32)
    ours = global_view("gpt2", model)  # no lm_head: tied
    stage = PP.coords(rank).pp
    want = {to_local_name(k, stage, PP): ours[k] for k in stage_keys(stage, sorted(ours), PP)}
    if stage == PP.pp - 1:
        want["lm_head.weight"] = ours["transformer.wte.weight"]  # the last stage's own copy of the head
    held = Holder({k: torch.full_like(v, -3.0) for k, v in want.items()})
    common = dict(layout=PP, name_map=name_map_for(stage, PP))
    # a save_pretrained folder leaves lm_head out: the last stage reads it from the embedding's bytes
    smpckpt.resume_from_checkpoint(
        hf_dir, partial=False, model=held, translate_function=MODULES["gpt2"].TRANSLATION, **common
    )
    out: dict[str, Any] = {"hf_folder_into_pp2": _same(dict(held.named_parameters()), want)}
    smpckpt.save_checkpoint(root, "pp", model=held, save_rng=False, **common)
    smpckpt.save_checkpoint(
        root,
        "pp-full",
        partial=False,
        model=held,
        translate_function=MODULES["gpt2"].TRANSLATION,
        hf_config=tiny_config("gpt2"),
        **common,
    )
    again = Holder({k: torch.zeros_like(v) for k, v in want.items()})
    smpckpt.resume_from_checkpoint(root, "pp", model=again, **common)
    out["partial_round_trip"] = _same(dict(again.named_parameters()), want)
    dist.barrier()
    if rank == 0:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.join(root, "pp-full"), attn_implementation="eager"
        ).eval()
        ids = _ids(model.config)
        out["pp-full:logits_equal"] = bool(torch.equal(_logits(hf, ids), _logits(model, ids)))
    return out


# -- DTensor: GPT-2 whose vocab-parallel embedding is a DTensor, the head tied to it again -------------
def dtensor_tied(rank: int, world: int, root: str) -> dict[str, Any]:
    """The same GPT-2 held in plain tensors and with ``parallelize_module`` over a 1-D mesh of the ranks,
    its head tied to the DTensor embedding again as a user re-ties it: both full saves must write the
    same artifact (the head left out, as ``save_pretrained`` writes a tied model), and a partial save
    of the DTensor model resumes into another one bit-exact, tie intact."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    layout, cfg = ParallelLayout(tp=world), tiny_config("gpt2", vocab_size=98)

    def dtensor_model(seed: int) -> Any:
        model = tiny_model("gpt2", seed=seed, dtype=torch.float32, vocab_size=98)
        parallelize_module(model, mesh, {"transformer.wte": RowwiseParallel()})  # vocab-parallel rows
        model.lm_head.weight = model.transformer.wte.weight  # tied again, as the model was
        return model

    mesh = init_device_mesh("cpu", (world,))
    plain, model = tiny_model("gpt2", seed=SEED, dtype=torch.float32, vocab_size=98), dtensor_model(SEED)
    assert isinstance(model.lm_head.weight, DTensor)
    smpckpt.save_checkpoint(root, "plain", partial=False, model=plain, layout=layout, hf_config=cfg)
    smpckpt.save_checkpoint(root, "dtensor", partial=False, model=model, layout=layout, hf_config=cfg)
    smpckpt.save_checkpoint(root, "p", model=model, layout=layout, save_rng=False)
    again = dtensor_model(SEED + 1)
    smpckpt.resume_from_checkpoint(root, "p", model=again, layout=layout)

    def whole(t: Any) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    pairs = zip(model.state_dict().items(), again.state_dict().values())
    return {
        "resumed": sorted(k for (k, a), b in pairs if not torch.equal(whole(a), whole(b))),
        "still_tied": again.lm_head.weight is again.transformer.wte.weight,
        "want": {k: v for k, v in plain.state_dict().items() if k != "lm_head.weight"} if rank == 0 else {},
    }


def families(rank: int, world: int, root: str, hf_root: str, names: list[str]) -> dict[str, Any]:
    import transformers

    transformers.logging.set_verbosity_error()
    results = {name: one_family(rank, name, root, os.path.join(hf_root, name)) for name in names}
    results["gpt2 pp=2"] = pipeline(rank, os.path.join(root, "pp"), os.path.join(hf_root, "gpt2"))
    results["gpt2 dtensor"] = dtensor_tied(rank, world, os.path.join(root, "dtensor"))
    return results

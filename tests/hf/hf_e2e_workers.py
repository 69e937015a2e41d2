"""Rank functions of the Hugging Face end-to-end test (real gloo ranks, tp=2 x pp=2).

Each rank holds only its pieces of our Megatron-style GPT-2 (its TP shard of its stage's layers) in a
parameter-only module; the sharded model's logits come from the reference TP forward over every
rank's gathered pieces (:func:`hf_reference.gpt2_forward`), which shares no code with transformers.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
import torch.distributed as dist
from hf_reference import gpt2_forward, shard, tiny_config
from torch import nn

import smpckpt
from smpckpt.hf import gpt2
from smpckpt.model.layout import ParallelLayout
from smpckpt.model.specs import SpecRules

LAYOUT = ParallelLayout(tp=2, pp=2, pp_layers=(1, 1))
_LAYER = re.compile(r"^(model\.transformer\.h\.)(\d+)\.")


def stage_keys(stage: int, keys: list[str], layout: ParallelLayout = LAYOUT) -> list[str]:
    """Global keys (without ``model.``) a stage holds: embeddings and layer 0 first, layer 1 and ln_f last."""
    first = layout.layer_offset(stage)
    count = layout.pp_layers[stage] if layout.pp_layers else 0
    mine = []
    for k in keys:
        m = re.match(r"^transformer\.h\.(\d+)\.", k)
        if m:
            if first <= int(m.group(1)) < first + count:
                mine.append(k)
        elif k.startswith(("transformer.wte.", "transformer.wpe.")) and stage == 0:
            mine.append(k)
        elif k.startswith("transformer.ln_f.") and stage == layout.pp - 1:
            mine.append(k)
    return mine


def to_local_name(key: str, stage: int, layout: ParallelLayout = LAYOUT) -> str:
    """``transformer.h.<global>.`` -> the stage's own numbering ``transformer.h.<local>.``."""
    first = layout.layer_offset(stage)
    return re.sub(r"^(transformer\.h\.)(\d+)\.", lambda m: f"{m.group(1)}{int(m.group(2)) - first}.", key)


def name_map_for(stage: int, layout: ParallelLayout = LAYOUT) -> Any:
    first = layout.layer_offset(stage)

    def to_global(key: str) -> str:
        return _LAYER.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + first}.", key)

    return to_global


class Holder(nn.Module):
    """Parameters under dotted names (nested empty modules), nothing else."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, t in tensors.items():
            *path, leaf = name.split(".")
            mod: nn.Module = self
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, nn.Parameter(t))


def end_to_end(rank: int, world: int, root: str, hf_dir: str) -> dict[str, Any]:
    cfg = tiny_config("gpt2", vocab_size=96)
    coords = LAYOUT.coords(rank)
    specs = gpt2.tp_specs(LAYOUT.tp, cfg, prefix="model.")
    rules = SpecRules(specs)
    # the original weights, as every rank can compute them (only to know shapes and expected slices)
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(hf_dir)
    ours = gpt2.translate_hf_state_dict_to_smpckpt(original.state_dict(), keep_view_shapes=True)
    expected: dict[str, torch.Tensor] = {}
    for key in stage_keys(coords.pp, sorted(ours)):
        matched = rules.match("model." + key)
        spec = None if matched is None else matched[0][0]
        expected[key] = shard(key, ours[key], spec, LAYOUT.tp, coords.tp)
    model = Holder({to_local_name(k, coords.pp): torch.zeros_like(v) for k, v in expected.items()})
    common = dict(layout=LAYOUT, specs=specs, name_map=name_map_for(coords.pp))

    # 1. pretrained HF folder straight into tp=2 x pp=2: each rank reads only its pieces
    smpckpt.resume_from_checkpoint(hf_dir, partial=False, model=model, translate_function=gpt2.TRANSLATION, **common)
    local = dict(model.named_parameters())
    loaded_exact = all(torch.equal(local[to_local_name(k, coords.pp)].detach(), v) for k, v in expected.items())

    # 2. one training step (deterministic gradients, identical on replicas)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.sin(p.detach() * 3.0)
    opt.step()

    # 3. partial save, and a full one with Hugging Face names, layouts and config.json
    smpckpt.save_checkpoint(root, "step1", model=model, optimizer=opt, **common)
    smpckpt.save_checkpoint(
        root, "final", partial=False, model=model, translate_function=gpt2.TRANSLATION, hf_config=cfg, **common
    )
    if rank == 0:
        smpckpt.consolidate_checkpoint(
            os.path.join(root, "step1_partial"),
            os.path.join(root, "offline"),
            translation=gpt2.TRANSLATION,
            hf_config=cfg,
            progress=False,
        )

    # 4. the sharded model's logits: every rank's trained pieces, gathered
    mine = {name_map_for(coords.pp)("model." + n)[len("model.") :]: p.detach().clone() for n, p in local.items()}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (coords.tp, mine))
    if rank != 0:
        return {"loaded_exact": loaded_exact}
    per_tp: list[dict[str, torch.Tensor]] = [{} for _ in range(LAYOUT.tp)]
    for tp_rank, pieces in gathered:
        per_tp[tp_rank].update(pieces)
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        sharded = gpt2_forward(per_tp, cfg, ids)
        logits = {}
        for name in ("final", "offline"):
            hf = AutoModelForCausalLM.from_pretrained(os.path.join(root, name), attn_implementation="eager").eval()
            logits[name] = hf(ids).logits
        before = original.eval()(ids).logits
    return {"loaded_exact": loaded_exact, "sharded": sharded, "logits": logits, "before": before}

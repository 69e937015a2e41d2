"""Rank functions of the tied-head tests on real gloo ranks: a GPT-2 whose embedding is a DTensor
(vocab-parallel over a 1-D mesh of 2) with the head tied to it again after ``parallelize_module``, as a
user re-ties it, saved full beside the same model held in plain tensors."""

from __future__ import annotations

import os
from typing import Any

import torch

import smpckpt
from smpckpt import ParallelLayout


def gpt2_config() -> Any:
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=98, n_positions=32)


def gpt2(seed: int) -> Any:
    import transformers
    from transformers import GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    return GPT2LMHeadModel(gpt2_config()).eval()


def dtensor_tied_world(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    layout = ParallelLayout(tp=world)
    plain = gpt2(0)
    model = gpt2(0)
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(model, mesh, {"transformer.wte": RowwiseParallel()})  # vocab-parallel rows
    model.lm_head.weight = model.transformer.wte.weight  # tied again, as the model was
    assert isinstance(model.lm_head.weight, DTensor)
    cfg = gpt2_config()
    smpckpt.save_checkpoint(root, "plain", partial=False, model=plain, layout=layout, hf_config=cfg)
    smpckpt.save_checkpoint(root, "dtensor", partial=False, model=model, layout=layout, hf_config=cfg)
    # a partial save of the DTensor model writes the tied tensor once and resumes into the tied model
    smpckpt.save_checkpoint(root, "p", model=model, layout=layout, save_rng=False)
    again = gpt2(1)
    parallelize_module(again, mesh, {"transformer.wte": RowwiseParallel()})
    again.lm_head.weight = again.transformer.wte.weight
    smpckpt.resume_from_checkpoint(root, "p", model=again, layout=layout)
    same = all(
        torch.equal(a.full_tensor() if isinstance(a, DTensor) else a, b.full_tensor() if isinstance(b, DTensor) else b)
        for a, b in zip(model.state_dict().values(), again.state_dict().values())
    )
    return {
        "resumed_equal": same,
        "still_tied": again.lm_head.weight is again.transformer.wte.weight,
        "files": sorted(os.listdir(os.path.join(root, "dtensor"))),
    }

"""Helpers shared by the test_optimizer_state_*.py modules: an optimizer keeping its moments in a dtype of its
own, and name_maps moving the model's or the optimizer's prefix."""

from __future__ import annotations

from typing import Any

import torch


class _MomentIn(torch.optim.Optimizer):
    """Momentum SGD keeping its moment in a dtype of its own (AnyPrecisionAdamW's fp32 moments of a bf16 model)."""

    dtype = torch.float32  # a class attribute: a deepcopy of the optimizer keeps it

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    if not state:
                        state["m"], state["step"] = torch.zeros_like(p, dtype=self.dtype), torch.tensor(0.0)
                        state["nest"] = {"m": torch.zeros_like(p, dtype=self.dtype)}  # nested state (hunt71d2)
                    state["m"].mul_(0.9).add_(p.grad.to(self.dtype))
                    state["nest"]["m"].mul_(0.5).add_(p.grad.to(self.dtype) / 3)
                    state["step"] += 1
                    p.add_((state["m"] + state["nest"]["m"]).to(p.dtype), alpha=-group["lr"])


_MAPS = {  # name_maps moving the model's or the optimizer's prefix (applied at the save and the resume alike)
    "model-to-net": lambda k: "net." + k[6:] if k.startswith("model.") else k,
    "model-only-under-body": lambda k: "model.body." + k[6:] if k.startswith("model.") else k,
    "optim-to-opt": lambda k: "opt." + k[6:] if k.startswith("optim.") else k,
    "all-under-stage": lambda k: "stage/" + k if k.startswith(("model.", "optim.")) else k,
}

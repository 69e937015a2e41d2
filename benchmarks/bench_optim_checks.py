"""The optimizer-state checks a save and a resume run (``smpckpt._checks``) at scale: the stray-key check (state
under a key that is none of the optimizer's parameters) and the whole ``refuse_unflattenable`` (stray keys, the walk
for values DCP does not keep, the clash check of names flattening onto one key), beside what the same save pays
anyway to extract that state (``opt.state_dict()``, and DCP's ``get_state_dict`` flattening it).

One process, a model of ``--params`` tiny parameters (default 100,000) with Adam state (one step), optionally nested
state too (``--nested``: each parameter's state holds a dict, which the clash check must look into). Medians of
``--rounds`` rounds, the rows interleaved in each round; a table printed and JSON written.

    python benchmarks/bench_optim_checks.py [--params 100000] [--rounds 3] [--out benchmarks/out/optim_checks.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from smpckpt._checks import _refuse_stray_keys, refuse_unflattenable


def _model(n: int, nested: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = nn.Module()
    m.ps = nn.ParameterList(nn.Parameter(torch.randn(4)) for _ in range(n))
    o = torch.optim.Adam(m.parameters(), lr=1e-3, foreach=False)
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    o.step()
    if nested:  # nested state, as some optimizers keep (a dict per parameter): the clash check looks into it
        for p in m.parameters():
            o.state[p]["nest"] = {"m": torch.zeros(4)}
    return m, o


def _time(fn: Callable[[], Any]) -> float:
    gc.collect()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _rows(m: nn.Module, o: torch.optim.Optimizer, rounds: int) -> dict[str, dict[str, float]]:
    """Each row's median, min and max over ``rounds``, the rows interleaved in each round."""
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    rows: dict[str, Callable[[], Any]] = {
        "stray-key check": lambda: _refuse_stray_keys(0, o),
        "refuse_unflattenable (stray + walk + clash)": lambda: refuse_unflattenable(m, [o]),
        "opt.state_dict() (torch)": lambda: o.state_dict(),
        "get_state_dict(model, opt), flattened (DCP)": lambda: get_state_dict(m, o, options=flat),
    }
    times: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(rounds):
        for name, fn in rows.items():
            times[name].append(_time(fn))
    return {k: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v)} for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "optim_checks.json"))
    args = ap.parse_args()
    results: dict[str, Any] = {}
    for nested in (False, True):
        m, o = _model(args.params, nested)
        results["nested" if nested else "plain"] = _rows(m, o, args.rounds)
        del m, o
        gc.collect()
    extract = "get_state_dict(model, opt), flattened (DCP)"
    print(f"{args.params} parameters, Adam state; medians of {args.rounds} rounds (min..max)")
    print(f"{'state':8} {'what':46} {'ms':>22} {'of get_state_dict':>18}")
    for kind, rows_ in results.items():
        for name, r in rows_.items():
            spread = f"{r['median_s'] * 1e3:.1f} ({r['min_s'] * 1e3:.1f}..{r['max_s'] * 1e3:.1f})"
            share = r["median_s"] / rows_[extract]["median_s"]
            print(f"{kind:8} {name:46} {spread:>22} {share:>17.1%}")
    record = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "load_avg": os.getloadavg(),
        },  # fmt: skip
        "params": args.params,
        "rounds": args.rounds,
        "results": results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

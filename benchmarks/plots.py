"""PNG plots of the benchmark driver (matplotlib, Agg backend: no display needed, CI-safe)."""

from __future__ import annotations

from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: headless machines and CI have no display
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["throughput", "amplification", "planning"]

OPS = (("save", "save"), ("load_cold", "cold load"), ("load_warm", "warm load"))


def _save(fig: Any, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def throughput(res: dict[str, Any], path: str) -> str:
    """Aggregate GB/s by contender, one panel per storage, bars per op; whiskers: min..max over rounds."""
    summary = res["summary"]
    storages = [s for s in summary if summary[s]] or ["(none)"]
    fig, axes = plt.subplots(len(storages), 1, figsize=(11, 3.6 * len(storages)), squeeze=False)
    for ax, storage in zip(axes[:, 0], storages):
        rows = summary.get(storage, {})
        names = list(rows)
        total = sum(res["storages"][storage]["bytes_per_rank"]) if rows else 0
        ops = [(op, label) for op, label in OPS if any(op in rows[n] for n in names)]
        width = 0.8 / max(1, len(ops))
        for i, (op, label) in enumerate(ops):
            xs, ys, lo, hi = [], [], [], []
            for j, n in enumerate(names):
                row = rows[n].get(op)
                if row is None:
                    continue
                xs.append(j + (i - (len(ops) - 1) / 2) * width)
                ys.append(row["agg_GBps"])
                # slowest round -> lowest GB/s: whiskers from the time spread
                lo.append(row["agg_GBps"] - total / row["s"]["max"] / 1e9)
                hi.append(total / row["s"]["min"] / 1e9 - row["agg_GBps"])
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=label)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([n.replace(" ", "\n", 2) for n in names], fontsize=7)
        ax.set_ylabel("GB/s (all ranks)")
        env = res["env"]
        ax.set_title(f"{storage}: {total / 2**20:.0f} MiB, {env['world_size']} rank(s), {env['device']}", fontsize=9)
        if ops:
            ax.legend(fontsize=7)
    return _save(fig, path)


def amplification(reshard: dict[str, Any], path: str) -> str:
    """Bytes read / bytes needed per reshard case, smpckpt vs DCP; the 1.05x goal as a line."""
    fig, ax = plt.subplots(figsize=(9, 3.8))
    cases = list(reshard)
    whos = sorted({w for rows in reshard.values() for w in rows})
    width = 0.8 / max(1, len(whos))
    for i, who in enumerate(whos):
        xs = [j + (i - (len(whos) - 1) / 2) * width for j, c in enumerate(cases) if who in reshard[c]]
        ys = [reshard[c][who]["rchar_ampl"] for c in cases if who in reshard[c]]
        ax.bar(xs, ys, width, label=who)
    ax.axhline(1.05, color="k", linestyle="--", linewidth=1, label="goal <= 1.05x")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([c.replace(" (", "\n(") for c in cases], fontsize=7)
    ax.set_ylabel("bytes read / bytes needed")
    ax.set_title("reshard read amplification (rchar of read_data)", fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, path)


def planning(plan: dict[str, Any], path: str) -> str:
    """Bytes gathered to the coordinator and global-plan time against world size, smpckpt vs DCP."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for who in sorted({r["who"] for r in plan["rows"]}):
        rows = sorted((r for r in plan["rows"] if r["who"] == who), key=lambda r: r["world"])
        worlds = [r["world"] for r in rows]
        a.plot(worlds, [r["gathered_bytes"] / 1024 for r in rows], marker="o", label=who)
        b.plot(worlds, [r["global_plan_s"] for r in rows], marker="o", label=who)
    for ax, what in ((a, "gathered to coordinator, KiB"), (b, "global plan, s")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("world size")
        ax.set_ylabel(what)
        ax.legend(fontsize=7)
    fig.suptitle(f"planning cost ({plan.get('layers')} layers, tp={plan.get('tp')}; {plan['source']})", fontsize=9)
    return _save(fig, path)

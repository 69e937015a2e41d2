"""What the fault-injection parent and child share: kill kinds, limits, tags and the deterministic model."""

from __future__ import annotations

from typing import Any

KEEP = 3  # num_kept_partial_checkpoints
FAULT_ENV = "SMPCKPT_FI_FAULT"
MANIFEST = "smpckpt.manifest.json"
SIZES = (256, 256, 256, 64)  # Linear stack: ~0.28 M parameters, ~3.3 MB with Adam state
POISON_STEP = 1_000_000_007  # fills a fresh model before resume, so a no-op load is caught
READY_TIMEOUT_S = 240.0  # child import (torch) on a loaded 2-core machine
RUN_TIMEOUT_S = 120.0  # one child run, from "go" to its death
TIMED_RANGE_S = (0.05, 2.0)
DET_MAX_SAVES = 12  # armed saves of a deterministic run (its N lands within ~3 saves)
TIMED_MAX_SAVES = 2000  # bounded anyway by the timed kill (<= 2 s)

# kind: (counter, when, (N low, N high), what the kill interrupts). Counters are per child run and
# count only after the restart save (when the fault is armed). Calls per save with this model (see
# "calls_per_save" in the JSON, measured by the final run): ~100 sink.write, 4 sink.commit, ~12 fsync,
# 1-2 write_bytes_atomic/renames of .metadata, one manifest commit (rename or hard link), one newest
# write; once more than 3 checkpoints exist, 1 remove_checkpoint and ~8 deletions inside it.
KINDS: dict[str, tuple[str, str, tuple[int, int], str]] = {
    "data_write": ("sink.write", "before", (1, 200), "before a data-file chunk write (LocalSink.write)"),
    "data_write_torn": ("sink.write", "torn", (1, 200), "half of a data-file chunk written"),
    "data_fsync": ("sink.commit", "before", (1, 12), "before a data file's fsync+close (LocalSink.commit)"),
    "fsync": ("fsync", "before", (1, 36), "before any os.fsync of the save loop"),
    "metadata_write": ("write:.metadata", "before", (1, 6), "before .metadata[.<id>] is created or published"),
    "metadata_rename": ("publish:.metadata", "before", (1, 6), ".metadata temp written+fsynced, not renamed"),
    "manifest_write": ("commit", "before", (1, 3), "before the writer's _write_manifest (the commit)"),
    "manifest_rename": ("publish:manifest", "before", (1, 3), "manifest temp written+fsynced, not published"),
    "manifest_renamed": ("publish:manifest", "after", (1, 3), "manifest published (rename/link), dir not fsynced"),
    "manifest_committed": ("commit", "after", (1, 3), "_write_manifest returned; before the rest of finish()"),
    "newest_write": ("write_newest", "before", (1, 3), "committed, before write_newest"),
    "newest_rename": ("publish:newest", "before", (1, 3), "newest temp written, not renamed"),
    "newest_renamed": ("publish:newest", "after", (1, 3), "newest renamed, before its dir fsync/retention"),
    "retention_start": ("remove_checkpoint", "before", (1, 3), "before retention's remove_checkpoint"),
    "retention_mid": ("rm_in_removal", "before", (2, 8), "between the deletions of remove_checkpoint"),
    "post_save": ("post_save", "before", (1, 3), "save returned, progress line not written"),
    # issue 42: the protocol's own steps, and those of full saves, fast-tier node copies and drains
    "manifest_publish": ("write:manifest", "before", (1, 6), "before any manifest is published (node copy, drain)"),
    "manifest_published": ("write:manifest", "after", (1, 6), "a manifest published (node copy, drain, save)"),
    "full_box_write": ("pwrite", "before", (1, 60), "before a full artifact's box (or header) pwrite"),
    "full_publish": ("publish:folder", "before", (1, 2), "a full save's staging folder complete, not renamed"),
    "full_published": ("publish:folder", "after", (1, 2), "the staging folder renamed into place, root not fsynced"),
}
#: save loops the campaign kills (``--modes``): plain partial saves; partial + full saves of each step;
#: tiered saves (fast tier + a drain of every 2nd save, in the background)
MODES = ("partial", "full", "tiered")
#: the kinds that can land in each mode (a counter a mode never reaches would leave its child unkilled)
_COMMON = ("data_write", "data_write_torn", "data_fsync", "fsync", "metadata_write", "newest_write")
_COMMON += ("newest_rename", "newest_renamed", "retention_start", "retention_mid", "post_save")
MODE_KINDS: dict[str, tuple[str, ...]] = {
    "partial": (*_COMMON, "metadata_rename", "manifest_write", "manifest_rename", "manifest_renamed")
    + ("manifest_committed", "manifest_published"),
    "full": (*_COMMON, "manifest_write", "manifest_committed", "full_box_write", "full_publish", "full_published"),
    "tiered": (*_COMMON, "metadata_rename", "manifest_rename", "manifest_renamed", "manifest_publish")
    + ("manifest_published",),
}
TIMED = "timed"
#: verify_checkpoint's warning for a committed checkpoint whose stock ``.metadata`` copy (written after
#: the commit, for stock DCP readers) is missing: a crash right after the commit leaves it so. smpckpt
#: loads such a checkpoint; it is counted ("no .metadata"), not treated as corruption.
STOCK_ONLY = ".metadata: missing"
ALL_KINDS = (*KINDS, TIMED)


def tag_of(step: int) -> str:
    return f"step{step:05d}"


def full_tag_of(step: int) -> str:
    """The full artifact of ``step`` (mode "full")."""
    return f"full{step:05d}"


def tier_options(root: str) -> dict[str, Any]:
    """The tiered saves' options (mode "tiered"): this root's fast tier beside it."""
    return {"local_path": f"{root.rstrip('/')}_fast", "replicas": 1, "durable_every": 2, "num_kept_local": 2}


def step_of(tag: str) -> int | None:
    if tag.startswith("step") and tag[4:].isdigit():
        return int(tag[4:])
    return None


# -- the model (child and parent) -------------------------------------------------------------------
def build_model() -> tuple[Any, Any]:
    """The tiny model and an Adam whose state exists (one zero-grad step), as resume needs it."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[Any] = []
    for i in range(len(SIZES) - 1):
        layers.append(nn.Linear(SIZES[i], SIZES[i + 1]))
        if i < len(SIZES) - 2:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def fill_state(model: Any, opt: Any, step: int) -> None:
    """The "training step": parameters and Adam state at ``step`` are a pure function of ``step``."""
    import torch

    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
            st = opt.state[p]
            st["exp_avg"].copy_(torch.randn(p.shape, generator=g))
            st["exp_avg_sq"].copy_(torch.rand(p.shape, generator=g))
            st["step"].fill_(float(step + 1))


def model_mismatches(model: Any, step: int) -> list[str]:
    """Names of the parameters of ``model`` that differ (bit-exact) from those of ``step``."""
    import torch

    exp_model, exp_opt = build_model()
    fill_state(exp_model, exp_opt, step)
    got = dict(model.named_parameters())
    return [n for n, q in exp_model.named_parameters() if n not in got or not torch.equal(got[n].detach(), q.detach())]


def state_mismatches(model: Any, opt: Any, step: int) -> list[str]:
    """Names of the tensors of (model, opt) that differ (bit-exact) from the expected state of ``step``."""
    import torch

    exp_model, exp_opt = build_model()
    fill_state(exp_model, exp_opt, step)
    bad: list[str] = []
    got = dict(model.named_parameters())
    for name, q in exp_model.named_parameters():
        p = got.get(name)
        if p is None or not torch.equal(p.detach(), q.detach()):
            bad.append(f"model.{name}")
            continue
        for key in ("exp_avg", "exp_avg_sq", "step"):
            a, b = opt.state.get(p, {}).get(key), exp_opt.state[q][key]
            if a is None or not torch.equal(a, b):
                bad.append(f"optim.{name}.{key}")
    return bad

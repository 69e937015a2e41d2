"""The words of a refused or partial load: what a list of missing or unexpected keys most likely means
(an LR scheduler's ``initial_lr``, optimizer state saved unflattened, a container saved the other way,
``module.`` added by a wrapper), of a save whose ranks of one stage disagree (:func:`stage_differences`), and
what a ``strict=False`` resume skipped (:func:`warn_skipped`). Error paths only, but for the evidence and the job's
judgement of an artifact read as it is (:func:`as_is_evidence`, :func:`judge_job`: called on no other load)."""

from __future__ import annotations

import bisect
import logging
import math
import re
import warnings
from collections.abc import Container, Iterable, Mapping, Sequence, Set
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan

from smpckpt.errors import LayoutMismatch
from smpckpt.model.layout import RESERVED, UNREAD_KEY
from smpckpt.planners._entries import SHOW

__all__ = ["likely_causes", "nesting_mismatches", "module_note", "show_keys", "stage_differences"]
__all__ += ["refuse_unread", "unread_note", "warn_skipped", "as_is_evidence", "judge_job", "reshape_hint"]

_AS_IS = "as_is"  #: a load plan's planner_data: (missing, tied) keys of a rank reading an artifact as it is


def _unread(metadata: Any) -> Mapping[str, Any]:
    data = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    found = data.get(UNREAD_KEY)
    return found if isinstance(found, Mapping) else {}


def refuse_unread(missing: Sequence[str], metadata: Any, asked: Container[str] = frozenset()) -> None:
    """(error path) Refuse ``missing`` keys under a prefix the storage reader left out of what it presents
    (:data:`~smpckpt.model.layout.UNREAD_KEY`: an untranslated artifact's optimizer state read through a
    translation), in its words: optional or not, skipping them would load without what was asked for; and model
    keys of ours missing from an artifact read as it is that the reader's judge (``smpckpt.hf``'s wrong-family
    rule) finds another family's, strict or not (``asked``: the keys this rank loads)."""
    for prefix, why in (_unread(metadata).get("refuse") or {}).items():
        found = [k for k in missing if k.startswith(prefix)]
        if found:
            raise LayoutMismatch(f"{why} (asked for {len(found)} such keys: {show_keys(found)})")
    unread_note(metadata, missing, asked)


def unread_note(metadata: Any, missing: Sequence[str] = (), asked: Container[str] = frozenset()) -> str:
    """(error path) Why our keys are missing from an untranslated artifact read through a translation that
    takes none of its names, when no family's takes them either, or ``""`` (raises naming a family's)."""
    judge = _unread(metadata).get("as_is")
    return judge(missing, metadata.state_dict_metadata, asked) if judge is not None else ""


def as_is_evidence(metadata: Any, missing: Sequence[str], tied: Iterable[str]) -> dict[str, Any]:
    """(each rank) What the job's family judgement (:func:`judge_job`) needs of this rank beyond the keys its
    reads name: its ``missing`` keys and those loaded through a tied key's (``tied``); ``{}`` (nothing sent)
    unless the reader left a judge (an untranslated artifact read as it is through a translation)."""
    return {_AS_IS: (list(missing), list(tied))} if _unread(metadata).get("as_is") is not None else {}


def judge_job(metadata: Any, plans: Sequence[Any]) -> None:
    """(coordinator, in the global plan: the local plans every load gathers anyway, no collective of its own)
    The reader's wrong-family judge over every rank's keys, when some rank misses one: a stage alone (``ln_f``
    and a head, waived by its own judgement) cannot tell the job's names, which another stage's layers may
    show to be another family's (rev72k M1: read transposed under ``strict=False``); raises naming the family."""
    judge = _unread(metadata).get("as_is")
    if judge is None:
        return
    sent = [(p.planner_data or {}).get(_AS_IS) or ((), ()) for p in plans]
    missing = list(dict.fromkeys(k for gone, _ in sent for k in gone))
    if not missing:
        return
    asked = {item.storage_index.fqn for p in plans for item in p.items}
    for plan, (gone, tied) in zip(plans, sent):
        asked.update((plan.planner_data or {}).get("empty", ()), gone, tied)
    judge(missing, metadata.state_dict_metadata, asked)


def reshape_hint(shape: Any, md: Any, whole: bool) -> str:
    """(error path) What to do when only a ShardSpec view separates the shapes of a partial checkpoint's tensor
    (``shape``: the destination's global shape; ``md``: the saved tensor's; ``whole``: the reader's tensors are
    whole and reshapable, a full artifact's)."""
    if whole or math.prod(md.size) != math.prod(shape or ()):
        return ""
    return (
        "; a partial checkpoint is read only in the shape it was saved in (same elements, other view), but "
        "for a tensor saved before its spec's view, which an unsharded (TP=1) resume reads into it (then "
        "save again): else consolidate it first (`smpckpt consolidate` / smpckpt.consolidate_checkpoint): "
        "a full artifact is read reshaped into a ShardSpec view"
    )


def likely_causes(keys: Sequence[str], saved: Iterable[str], asked: Set[str] = frozenset()) -> str:
    """(error path) The common causes of a long list of missing or unexpected keys, when they match (``saved``:
    the checkpoint's keys, or those of them no rank loads; ``asked``: the keys loaded, ``keys`` unexpected)."""
    notes = []
    if any(k.rsplit(".", 1)[-1] == "initial_lr" and "param_groups." in k for k in keys):
        notes.append(
            "an LR scheduler adds initial_lr to the param groups when it is built: build it before the resume exactly when the saving run had built it before the save"
        )
    if any(re.search(r"(^|\.)param_groups\.\d+\.params$", k) for k in saved):  # groups listing their params
        notes.append(
            "the checkpoint holds optimizer state unflattened (param_groups a list, as stock DCP's get_state_dict gives by default): save it with StateDictOptions(flatten_optimizer_state_dict=True)"
        )
    owners = {k[len(at) :].rpartition(".")[0] for k in keys if k.startswith(at := f"{RESERVED.optim}.param_groups.")}
    if out := sorted(f for f in owners if f"{RESERVED.model}.{f}" in asked):  # loaded, their groups not: in none
        notes.append(
            f"parameter(s) {', '.join(out[:8])}{' ...' if len(out) > 8 else ''} were in a saved optimizer (the checkpoint holds their param groups and any state) but are in no optimizer passed now (frozen and left out of it?): pass the optimizer over them as saved (steps skip a frozen parameter, its state is kept), or resume with strict=False to leave their optimizer state unloaded"
        )
    return "; likely cause: " + "; ".join(notes) if notes else ""


def nesting_mismatches(missing: Sequence[str], saved: Mapping[str, Any]) -> str:
    """(error path) Missing keys the checkpoint holds nested the other way, said as such: a dict saved
    under ``x`` is stored as ``x.a``, ``x.b`` (DCP flattens it), so a tensor asked for as ``x`` would
    otherwise be called absent, and ``x.a`` asked of a checkpoint holding ``x`` whole likewise."""
    keys = sorted(saved)
    notes = []
    for key in missing:
        # the keys under ``key.``: one run of the sorted keys, ending before ``key/`` ("/" follows ".")
        under = keys[bisect.bisect_left(keys, f"{key}.") : bisect.bisect_left(keys, f"{key}/")]
        parts = key.split(".")
        whole = next((p for p in (".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)) if p in saved), None)
        if under:
            notes.append(f"{key}: the checkpoint holds a container there (keys {show_keys(under)}), not one value")
        elif whole is not None:
            what = "an object" if isinstance(saved[whole], BytesStorageMetadata) else "a tensor"
            notes.append(f"{key}: the checkpoint holds {whole!r} whole ({what}), not a container of keys under it")
    return "; " + "; ".join(notes[:SHOW]) if notes else ""


def module_note(missing: Sequence[str], saved: Container[str]) -> str:
    """(error path) A missing model key ``saved`` holds with ``module.`` added or removed (nn.DataParallel's)."""
    m, why = f"{RESERVED.model}.", "saved or resumed inside a wrapper holding the model as `module`"
    for k in missing:
        added, removed = f"{m}module.{k[len(m) :]}", f"{m}{k[len(m) + 7 :]}" if k.startswith(f"{m}module.") else ""
        if k.startswith(m) and (added in saved or removed in saved):
            return f"; {k}: the checkpoint holds it with module. added or removed ({why}: nn.DataParallel, AveragedModel, ...): resume it wrapped as saved, or map the keys with Sharding(name_map=...)"
    return ""


def show_keys(keys: Sequence[str]) -> str:
    """(error path) The first :data:`SHOW` of ``keys``, and how many more."""
    shown = ", ".join(keys[:SHOW])
    return shown + (f", ... ({len(keys) - SHOW} more)" if len(keys) > SHOW else "")


def stage_differences(plans: list[SavePlan], ranks: set[int], shown: int = 5) -> str:
    """(failure path only) The first keys whose global shape or dtype differs between the write plans of
    ``ranks`` (each written piece carries the global size its rank computed), with their ranks (a
    replica only its owner writes shows nothing here), and the first keys not split that some of them tie
    and others do not, or tie to another key (each plan lists its rank's ties)."""
    views: dict[str, dict[tuple[tuple[int, ...], Any], list[int]]] = {}
    for plan in plans:
        rank = plan.planner_data["rank"]
        for item in plan.items if rank in ranks else ():
            if item.tensor_data is not None:
                key = (tuple(item.tensor_data.size), item.tensor_data.properties.dtype)
                holders = views.setdefault(item.index.fqn, {}).setdefault(key, [])
                if rank not in holders:
                    holders.append(rank)
    lines = []
    for fqn in sorted(f for f, seen in views.items() if len(seen) > 1)[:shown]:
        dtypes = len({dtype for _, dtype in views[fqn]}) > 1  # named only where they differ
        seen = [f"{s}{f' {d}' if dtypes else ''} on ranks {sorted(r)}" for (s, d), r in views[fqn].items()]
        lines.append(f"'{fqn}': global shape {', '.join(seen)}")
    ties = {
        p.planner_data["rank"]: (p.planner_data.get("tied") or {}) for p in plans if p.planner_data["rank"] in ranks
    }
    split = {a for p in plans for a in p.planner_data.get("tie_axes") or ()}  # tied per group: an empty piece ties none
    for alias in sorted({a for tied in ties.values() for a in tied} - split)[:shown]:
        firsts: dict[str | None, list[int]] = {}
        for rank, tied in sorted(ties.items()):
            firsts.setdefault(tied.get(alias), []).append(rank)
        if len(firsts) > 1:  # None: a tensor of its own
            seen = [
                f"tied to {f!r} on ranks {r}" if f else f"a tensor of its own on ranks {r}" for f, r in firsts.items()
            ]
            lines.append(f"{alias!r}: {', '.join(sorted(seen, key=lambda s: s.startswith('a ')))}")
    return f" ({'; '.join(lines)})" if lines else ""


def warn_skipped(
    coordinator: bool, url: str, kept: list[str], unexpected: list[str], dropped: list[str], full: bool
) -> None:
    """(every rank, in a checked step) Name, on rank 0, what a ``strict=False`` resume skipped: a checkpoint
    of other keys (a stock ``dcp.save(model.state_dict())``, unflattened optimizer state) loads nothing of
    them, which ``ResumeInfo.skipped_keys`` alone would not tell anyone (a full resume makes no ResumeInfo)."""
    if not coordinator:
        return

    def show(keys: list[str]) -> str:
        return ", ".join(keys[:20]) + (f", ... ({len(keys)} in all)" if len(keys) > 20 else "")

    noun = "artifact" if full else "checkpoint"
    parts = [f"not in the {noun}{', kept as they were' if full else ''}: {show(kept)}"] if kept else []
    parts += [f"in the {noun}, loaded by no rank: {show(unexpected)}"] if unexpected else []
    dropped_by = "left unloaded by the translate_function (dropped, or not in the model)"
    parts += [f"{dropped_by}: {show(dropped)}"] if dropped else []
    message = f"{url}: strict=False skipped keys; " + "; ".join(parts) + module_note(kept, set(unexpected))
    message += likely_causes(kept + unexpected, unexpected)
    logging.getLogger("smpckpt.api").warning(message)  # the API's logger: its words
    # the caller's frame: all_ok, its lambda, skipped_keys (smpckpt.api._resume), _resume (and resume_full), resume
    warnings.warn(message, stacklevel=8 if full else 7)

"""Full artifacts: :func:`save_full` (all ranks write their shards into ``{out}/model*.safetensors``;
rank 0 adds user_content and commits; ``newest`` and retention are left alone) and :func:`resume_full`
(``ResumeOptions(partial=False)``: each rank reads only its shards' bytes of an artifact or a plain Hugging
Face folder, then ``set_state_dict`` and user_content).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from smpckpt.api._dist import (
    OPTIONS,
    PICKLED_KEY,
    CommonRequest,
    DistContext,
    decode_user_content,
    encode_user_content,
    refuse_pickled,
    train_state,
)
from smpckpt.api._resume import (
    InventedState,
    drop_optimizer_state,
    init_missing_state,
    load_checkpoint,
    stateless_at_save,
)
from smpckpt.api._save import PlannerCache, manifest_extra, run_save
from smpckpt.api.options import ExportOptions, ResumeOptions
from smpckpt.catalog.root import NEWEST_NAME, SequenceCounter, join_url
from smpckpt.errors import CheckpointError, LayoutMismatch
from smpckpt.model.layout import FULL_API_RECORD, RESERVED
from smpckpt.planners import ObjectBytes
from smpckpt.storage import FsspecStorageReader, FullArtifactWriter, probe_checkpoint

__all__ = ["save_full", "resume_full", "full_url"]

log = logging.getLogger("smpckpt.api")


def full_url(root: str, tag: str) -> str:
    """``{root}/{tag}``: the folder of a full checkpoint (``tag`` validated at the caller's edge)."""
    if tag == NEWEST_NAME:
        raise ValueError(f"{tag!r} cannot name a full checkpoint: {{path}}/{tag} is the pointer file of partial ones")
    return join_url(root, tag)


def _tensor_state(common: CommonRequest, optim: bool, destinations: bool = False) -> dict[str, Any]:
    """The model's state and (``optim``) the optimizer's per-parameter state, numbers included (Adafactor's
    int ``step``: left behind, a resume paired the saved moments with the live step)."""
    state = train_state(common.model, common.optimizers if optim else (), destinations=destinations)
    if RESERVED.optim in state:
        state[RESERVED.optim] = {
            k: v for k, v in state[RESERVED.optim].items() if isinstance(v, torch.Tensor) or k.startswith("state.")
        }
    return state


def _numbers_not_saved(state: dict[str, Any], planner: Any, unsaved: frozenset[str], strict: bool) -> None:
    """(each rank) Refuse (``strict``; else warn) an artifact holding a parameter's tensor state but not its
    numbers: it would resume with the saved moments and the live ``step``."""
    report = planner.report
    if report is None or RESERVED.optim not in state:
        return
    numbers = {f"{RESERVED.optim}.{k}" for k, v in state[RESERVED.optim].items() if not isinstance(v, torch.Tensor)}
    # state names hold no dots: the parameter is what comes before the last one
    lost = [
        k
        for k in report.skipped_optional
        if k in numbers and planner.entries[k].local_key.partition(".state.")[2].rpartition(".")[0] not in unsaved
    ]
    if not lost:
        return
    message = (
        f"the artifact holds optimizer tensor state but not {len(lost)} non-tensor state value(s) the optimizer "
        f"keeps beside it ({', '.join(sorted(lost)[:5])}): resume from a partial checkpoint, or re-export"
    )
    _refuse_or_warn(message, strict, "they keep the live optimizer's values")


def _untied_without_state(planner: Any, unsaved: frozenset[str], strict: bool) -> None:
    """(each rank) Refuse (``strict``; else warn, fresh state) a parameter read through a tie the artifact
    records into a model holding it as a parameter of its own: it would resume with the tied tensor's
    weights and no optimizer state (a partial checkpoint refuses the same under strict)."""
    report, in_model = planner.report, planner.dest_tied  # later key -> first key of one tensor
    if report is None:
        return
    prefix, untied = f"{RESERVED.model}.", []
    for key, source in report.tied.items():
        head, embed = key.removeprefix(prefix), source.removeprefix(prefix)
        # tied in the model too: one parameter, whose state the artifact holds under the key it read
        if head == key or in_model.get(key, key) == in_model.get(source, source):
            continue
        if head not in unsaved or embed in unsaved:
            continue
        untied.append(f"{head!r} (tied to {embed!r} in the artifact)")
    if not untied:
        return
    message = (
        f"{', '.join(sorted(untied))}: loaded through a tie the artifact records, into a model holding it as "
        "a parameter of its own, which has no optimizer state in the artifact (stored once, for the tied "
        "tensor): tie it as saved, or resume from a partial checkpoint"
    )
    _refuse_or_warn(message, strict, "its optimizer state starts fresh")


def _refuse_or_warn(message: str, strict: bool, consequence: str) -> None:
    """``strict``: a ``LayoutMismatch``; else logged and warned, with what ``strict=False`` does instead."""
    if strict:
        raise LayoutMismatch(message)
    log.warning("%s; strict=False: %s", message, consequence)
    warnings.warn(f"{message}; strict=False: {consequence}", stacklevel=3)


def save_full(
    ctx: DistContext,
    common: CommonRequest,
    tag: str,
    url: str,
    opts: ExportOptions,
    user_content: Any,
    counter: SequenceCounter,
    planners: PlannerCache,
) -> str:
    """(all ranks, arguments compared) The full save of ``tag`` into ``url``; returns the folder."""
    if opts.include_optimizer and not common.optimizers:
        raise ValueError("include_optimizer=True needs optimizer=")
    # a transformers model (found without importing transformers): its class name is what save_pretrained
    # records as ``architectures``
    model_class = type(common.model)
    hf = opts.translate_function is None and any(c.__name__ == "PreTrainedModel" for c in model_class.__mro__)
    artifact = opts.artifact(architecture=model_class.__name__ if hf else None)

    def build() -> tuple[dict[str, Any], dict[str, Any]]:
        state = _tensor_state(common, opts.include_optimizer)
        if not ctx.is_coordinator:
            return state, {}
        payload, safe = encode_user_content(user_content, stacklevel=5)  # warns when it needs allow_pickle
        state[RESERVED.user_content] = ObjectBytes(payload)
        translation = opts.translate_function
        return state, manifest_extra(
            FULL_API_RECORD,
            tag,
            counter.next(),
            user_content,
            not safe,
            optimizer=opts.include_optimizer,
            dtype=str(opts.dtype) if opts.dtype is not None else None,
            translation=translation.name if translation is not None else None,
        )

    state, extra = ctx.all_ok(build)
    writer = FullArtifactWriter(
        url,
        storage_options=opts.out_storage_options if opts.out_storage_options is not None else common.storage_options,
        manifest_extra=extra,
        sync_files=opts.sync_files,
        full=artifact,
        process_group=common.process_group,
    )
    started = time.monotonic()
    # as save_pretrained: a head tied to its embedding is left out unless untied (consolidate's rule too)
    action = f"saving full checkpoint {url}"
    run_save("full", common, writer, state, action, planners, opts.verify_replicas, artifact.leaves_tied_out)
    log.info("saved full checkpoint %s (%s) in %.2fs", url, common.layout, time.monotonic() - started)
    return url


def resume_full(ctx: DistContext, common: CommonRequest, tag: str | None, opts: ResumeOptions) -> Any:
    """(all ranks, arguments compared) Load a full artifact or Hugging Face folder into the model."""
    if common.model is None:
        raise ValueError("a resume from a full checkpoint (partial=False) needs model=")
    url = full_url(common.root, tag) if tag is not None else common.root
    # rank 0 reads the manifest once more (small): a user_content needing allow_pickle is refused before
    # the load writes into the model (a refusal at the decode, after it, left the model overwritten)
    pickled = ctx.on_coordinator(lambda: _pickled(url, common.storage_options))
    refuse_pickled(pickled, opts.allow_pickle, f"full checkpoint {url}")
    with InventedState(common.model, common.optimizers) as guard:

        def destinations() -> dict[str, Any]:
            init_missing_state(common.optimizers)
            return _tensor_state(common, True, destinations=True)

        state = ctx.all_ok(destinations)
        state[RESERVED.user_content] = ObjectBytes(b"")
        reader = FsspecStorageReader(
            url,
            storage_options=common.storage_options,
            verify_checksums=opts.verify_checksums,
            allow_pickle=opts.allow_pickle,
            translation=opts.translate_function,  # type: ignore[arg-type]  # a Translation (ResumeOptions checks)
            hf_prefix=f"{RESERVED.model}.",
        )
        optional = (RESERVED.user_content, f"{RESERVED.optim}.*")
        planner = load_checkpoint(common, opts, url, state, reader, optional=optional, what="full checkpoint")
        if not opts.strict:
            report = planner.report
            missing = ctx.all_ok_values(lambda: tuple(report.missing_keys) if report is not None else ())
            # in a checked step: a warning filter making it an error on rank 0 fails every rank alike
            ctx.all_ok(lambda: _warn_skipped(ctx.is_coordinator, planner, url, missing))
        # exported with an optimizer (its manifest says so: one saved before its first step holds no state),
        # the artifact holds the state of every parameter that had some: the others had none
        exported = reader.manifest is not None and reader.manifest.extra.get("optimizer") is True
        holds_optim = exported or any(
            k.startswith(f"{RESERVED.optim}.state.") for k in planner.metadata.state_dict_metadata
        )
        unsaved = stateless_at_save(
            common.model, common.optimizers, state, guard.stateless, planner, all_state_saved=holds_optim
        )

        def apply() -> Any:
            sd_opts = dataclasses.replace(OPTIONS, strict=opts.strict)
            if common.optimizers and RESERVED.optim in state:
                _, current = get_state_dict(common.model, common.optimizers, options=OPTIONS)  # type: ignore[arg-type]
                current.update(state[RESERVED.optim])
                set_state_dict(
                    common.model,  # type: ignore[arg-type]
                    common.optimizers,
                    model_state_dict=state[RESERVED.model],
                    optim_state_dict=current,
                    options=sd_opts,
                )
                drop_optimizer_state(common.model, common.optimizers, unsaved)
            else:
                common.model.load_state_dict(state[RESERVED.model], strict=opts.strict)  # type: ignore[union-attr]
            stored = state[RESERVED.user_content]
            return decode_user_content(stored if stored else None, allow_pickle=opts.allow_pickle, nested=False)

        if holds_optim:
            ctx.all_ok(lambda: _numbers_not_saved(state, planner, unsaved, opts.strict))
            ctx.all_ok(lambda: _untied_without_state(planner, unsaved, opts.strict))
        guard.applied = True
        user_content = ctx.all_ok(apply)
    log.info("loaded full checkpoint %s into %s (%s)", url, common.layout, reader.state or "committed")
    return user_content


def _pickled(url: str, storage_options: Any) -> bool:
    """(rank 0) Whether the artifact's manifest says its user_content needs ``allow_pickle``."""
    try:
        found = probe_checkpoint(url, storage_options)
    except (OSError, CheckpointError):  # the load reports it, in its own words
        return False
    return found.manifest is not None and found.manifest.extra.get(PICKLED_KEY) is True


def _warn_skipped(coordinator: bool, planner: Any, url: str, missing: list[tuple[str, ...]]) -> None:
    """(every rank, in a checked step; ``strict=False``) Name, on rank 0, the keys the load skipped (a full
    resume makes no ResumeInfo): model keys the artifact lacks on any rank, and artifact keys no rank loaded."""
    report = planner.report
    skipped = sorted({k for keys in missing for k in keys})
    unexpected = sorted(report.unexpected_keys) if report is not None and coordinator else []
    if not coordinator or not (skipped or unexpected):
        return

    def show(keys: list[str]) -> str:
        return ", ".join(keys[:20]) + (f", ... ({len(keys)} in all)" if len(keys) > 20 else "")

    parts = [f"not in the artifact, kept as they were: {show(skipped)}"] if skipped else []
    parts += [f"in the artifact, loaded by no rank: {show(unexpected)}"] if unexpected else []
    message = f"{url}: strict=False skipped keys; " + "; ".join(parts)
    log.warning(message)
    warnings.warn(message, stacklevel=7)  # the caller's frame: below it all_ok, its lambda, resume_full, ...

"""``partial=False``: :func:`smpckpt.save_checkpoint` writes one consolidated artifact and
:func:`smpckpt.resume_from_checkpoint` starts from one (ours, or a plain Hugging Face folder).

Which rank does what ("all" = every rank of the group)::

    save_full    (all)    validate; model (+ optimizer tensors) state; rank 0 adds user_content;
                          dcp.save with ParallelSavePlanner + FullArtifactWriter:
                          every rank writes its shards into {path}/{tag}/model*.safetensors at their
                          offsets; rank 0 commits the manifest. ``newest`` and retention are left alone:
                          they track the partial checkpoints training resumes from.
    resume_full  (all)    dcp.load of the artifact (or HF folder) with ParallelLoadPlanner: each rank
                          reads only its own shards' bytes; then set_state_dict and user_content.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict

from smpckpt._version import VERSION
from smpckpt.api._args import OPTIONS, check_flag, common_args, quiet_no_dist, translate_dcp
from smpckpt.api._dist import DistContext
from smpckpt.api._planner_reuse import kept_save_planner
from smpckpt.api.user_content import decode_user_content, describe_user_content, encode_user_content
from smpckpt.catalog.tags import join_url, validate_tag
from smpckpt.errors import CheckpointNotFound
from smpckpt.model.keys import FULL_API_RECORD, RESERVED
from smpckpt.model.translation import Translation
from smpckpt.planners import ObjectBytes, ParallelLoadPlanner
from smpckpt.storage import FsspecStorageReader, FullArtifactWriter, FullOptions

__all__ = ["save_full", "resume_full", "FULL_API_RECORD", "full_url"]

log = logging.getLogger("smpckpt.api")

#: flattened-key prefix -> artifact: HF-style ``model.safetensors`` and ``optimizer.safetensors``
MODEL_PREFIX, OPTIM_PREFIX = f"{RESERVED.model}.", f"{RESERVED.optim}.state."
ARTIFACTS = {MODEL_PREFIX: "model", OPTIM_PREFIX: "optimizer"}
_NOT_TAGS = ("newest",)


def full_url(root: str, tag: str) -> str:
    """``{root}/{tag}``: the folder of a full checkpoint (partial ones are ``{root}/{tag}_partial``)."""
    validate_tag(tag)
    if tag in _NOT_TAGS:
        raise ValueError(f"{tag!r} cannot name a full checkpoint: {{path}}/{tag} is the pointer file of partial ones")
    return join_url(root, tag)


def _translation(value: Any) -> Translation | None:
    if value is None or isinstance(value, Translation):
        return value
    raise TypeError(
        "with partial=False, translate_function must be a smpckpt.model.translation.Translation (for example "
        "smpckpt.hf.llama.TRANSLATION): full checkpoints are translated shard by shard, never as a gathered "
        f"state dict; got {type(value).__name__}"
    )


def _hf_class(model: Any) -> str | None:
    """The model's class name when it is a transformers model (what ``save_pretrained`` records as
    ``architectures``), found without importing transformers."""
    is_hf = any(cls.__name__ == "PreTrainedModel" for cls in type(model).__mro__)
    return type(model).__name__ if is_hf else None


def _config_value(config: Any, name: str) -> Any:
    """``config.<name>`` of a transformers config or a dict (``None`` when absent)."""
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


def save_full(ctx: DistContext, path: Any, tag: Any, kw: Mapping[str, Any]) -> str:
    """(all ranks) The full save; returns the artifact's folder."""
    common = common_args(ctx, path, True, kw)
    if common.model is None:
        raise ValueError("save_checkpoint(partial=False) needs model=: a full checkpoint holds the model's weights")
    translation = _translation(kw["translate_function"])
    file_format = kw.get("format", "raw")
    if file_format not in ("raw", "safetensors", "torch_save"):
        raise ValueError(
            f"with partial=False, format must be 'safetensors' (or 'raw') or 'torch_save', got {file_format!r}"
        )
    opts = FullOptions(
        format="torch_save" if file_format == "torch_save" else "safetensors",
        max_shard_size=kw["max_shard_size"],
        dtype=kw["dtype"],
        artifacts=ARTIFACTS,
        translation=translation,
        hf_config=kw["hf_config"],
        architecture=_hf_class(common.model) if translation is None else None,
    )
    # as save_pretrained: a head tied to its embedding is left out unless the config unties them
    dedup_tied = _config_value(kw["hf_config"], "tie_word_embeddings") is not False
    verify = check_flag("verify_replicas", kw.get("verify_replicas", True))
    include_optimizer = bool(kw["include_optimizer"])
    if include_optimizer and not common.optimizers:
        raise ValueError("include_optimizer=True needs optimizer=")
    ctx.check_identical(
        (tag, common.root, common.layout.to_dict(), include_optimizer, str(opts.dtype), opts.max_shard_size, verify),
        "save_checkpoint(path, tag, layout, include_optimizer, dtype, max_shard_size, verify_replicas) with partial=False",
    )
    url = full_url(common.root, tag)

    def build() -> tuple[dict[str, Any], dict[str, Any]]:
        if include_optimizer:
            model_sd, optim_sd = get_state_dict(common.model, common.optimizers, options=OPTIONS)  # type: ignore[arg-type]
            # tensors only: hyper-parameters (param_groups) stay with the code that builds the optimizer
            state: dict[str, Any] = {
                RESERVED.model: model_sd,
                RESERVED.optim: {k: v for k, v in optim_sd.items() if isinstance(v, torch.Tensor)},
            }
        else:
            state = {RESERVED.model: get_model_state_dict(common.model, options=OPTIONS)}  # type: ignore[arg-type]
        if not ctx.is_coordinator:
            return state, {}
        payload, _ = encode_user_content(kw["user_content"], stacklevel=5)  # warns when it needs allow_pickle
        state[RESERVED.user_content] = ObjectBytes(payload)
        now = time.time_ns()
        extra = {
            "api": FULL_API_RECORD,
            "tag": tag,
            "saved_at_ns": now,
            "saved_at": datetime.datetime.fromtimestamp(now / 1e9, datetime.timezone.utc).isoformat(),
            "optimizer": include_optimizer,
            **describe_user_content(kw["user_content"]),
            "dtype": str(opts.dtype) if opts.dtype is not None else None,
            "translation": translation.name if translation is not None else None,
            "smpckpt_version": VERSION,
            "torch_version": torch.__version__,
        }
        return state, extra

    state, extra = ctx.all_ok(build)
    writer = FullArtifactWriter(
        url,
        storage_options=common.storage_options,
        manifest_extra=extra,
        sync_files=bool(kw["sync_files"]),
        full=opts,
        process_group=common.process_group,
    )
    started = time.monotonic()
    try:
        with kept_save_planner("full", common) as planner, quiet_no_dist():
            planner.dedup_tied = dedup_tied
            planner.verify_replicas = verify
            dcp.save(state, storage_writer=writer, planner=planner, process_group=common.process_group)
    except CheckpointException as exc:
        try:  # every rank is past its writes: the coordinator removes the unfinished artifact
            writer.discard_failed_save(exc)
        except Exception:  # noqa: BLE001 - the save's own error is the one to raise
            log.warning("%s: removing the failed full save's files failed", url, exc_info=True)
        raise translate_dcp(exc, f"saving full checkpoint {url}") from exc
    log.info("saved full checkpoint %s (%s) in %.2fs", url, common.layout, time.monotonic() - started)
    return url


def resume_full(ctx: DistContext, path: Any, tag: Any, kw: Mapping[str, Any]) -> Any:
    """(all ranks) Load a full artifact or Hugging Face folder into the model (and optimizer)."""
    common = common_args(ctx, path, True, kw)
    if common.model is None:
        raise ValueError("resume_from_checkpoint(partial=False) needs model=")
    translate = kw["translate_function"]
    translation = _translation(translate) if not callable(translate) or isinstance(translate, Translation) else None
    if translate is not None and translation is None:
        raise TypeError(
            "with partial=False, translate_function must be a smpckpt.model.translation.Translation (for example "
            "smpckpt.hf.llama.TRANSLATION); plain callables would need the whole state dict on one rank"
        )
    ctx.check_identical((tag, common.root, common.layout.to_dict()), "resume_from_checkpoint(path, tag, layout)")
    url = full_url(common.root, tag) if tag is not None else common.root
    state: dict[str, Any] = {RESERVED.model: get_model_state_dict(common.model, options=OPTIONS)}
    if common.optimizers:
        _, optim_sd = get_state_dict(common.model, common.optimizers, options=OPTIONS)
        state[RESERVED.optim] = {k: v for k, v in optim_sd.items() if isinstance(v, torch.Tensor)}
    state[RESERVED.user_content] = ObjectBytes(b"")
    reader = FsspecStorageReader(
        url,
        storage_options=common.storage_options,
        verify_checksums=bool(kw["verify_checksums"]),
        allow_pickle=bool(kw["allow_pickle"]),
        translation=translation,
        hf_prefix=f"{RESERVED.model}.",
    )
    planner = ParallelLoadPlanner(
        **common.planner_args(),
        allow_dtype_cast=bool(kw["allow_dtype_cast"]),
        allow_pickle=bool(kw["allow_pickle"]),
        allow_partial_load=not kw["strict"],
        optional=(RESERVED.user_content, f"{RESERVED.optim}.*"),
    )
    try:
        with quiet_no_dist():
            dcp.load(state, storage_reader=reader, planner=planner, process_group=common.process_group)
    except CheckpointException as exc:
        err = translate_dcp(exc, f"loading full checkpoint {url}", metadata_error=reader.metadata_error)
        if isinstance(reader.metadata_error, CheckpointNotFound):
            raise err from exc
        raise err from exc

    def apply() -> Any:
        opts = OPTIONS.__class__(**{**OPTIONS.__dict__, "strict": bool(kw["strict"])})
        if common.optimizers and RESERVED.optim in state:
            _, current = get_state_dict(common.model, common.optimizers, options=OPTIONS)  # type: ignore[arg-type]
            current.update(state[RESERVED.optim])
            set_state_dict(
                common.model,  # type: ignore[arg-type]
                common.optimizers,
                model_state_dict=state[RESERVED.model],
                optim_state_dict=current,
                options=opts,
            )
        else:
            common.model.load_state_dict(state[RESERVED.model], strict=bool(kw["strict"]))  # type: ignore[union-attr]
        stored = state[RESERVED.user_content]
        return decode_user_content(stored if stored else None, allow_pickle=bool(kw["allow_pickle"]), nested=False)

    user_content = ctx.all_ok(apply)
    log.info("loaded full checkpoint %s into %s (%s)", url, common.layout, reader.state or "committed")
    return user_content

"""The steps of :meth:`smpckpt.Checkpointer.save`, each over a :class:`SaveRequest` (validated and
compared across ranks by the Checkpointer), and full artifacts (:func:`save_full`, :func:`resume_full`): :func:`build_save_state` (all; rank 0 adds user_content and the
API record) -> :func:`write_checkpoint` (all; rank 0 commits) -> :func:`publish_newest` (rank 0, after the
commit) -> :func:`retain` (rank 0; failures only logged).

:class:`PlannerCache` keeps one save planner per kind ("partial", "full") across saves, memoising each
rank's local plan (``cache_scope="local"``: checked against the state's structure at every save, nothing
cached crosses ranks, so a rank planning afresh mixes safely with ranks that reuse theirs;
``benchmarks/RESULTS.md``). Between saves it holds no tensors, name map or process group
(:meth:`~smpckpt.planners.ParallelSavePlanner.release_state`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import logging
import os
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

from smpckpt._version import VERSION
from smpckpt.api._async import commit_point
from smpckpt.api._dist import (
    OPTIONS,
    PICKLED_KEY,
    CommonRequest,
    DistContext,
    RecordSlot,
    describe_user_content,
    encode_user_content,
    get_rng_state,
    quiet_no_dist,
    refuse_pickled,
    train_state,
    translate_dcp,
)
from smpckpt.api._resume import (
    InventedState,
    ResumeRequest,
    apply_state,
    init_missing_state,
    load_checkpoint,
    skipped_keys,
    stateless_at_save,
)
from smpckpt.api.options import ExportOptions, Retention, SaveOptions
from smpckpt.catalog._abandoned import write_abandoned
from smpckpt.catalog.root import (
    ABANDONED_KEY,
    ABANDONED_NAME,
    NEWEST_NAME,
    PARTIAL_SUFFIX,
    SEQUENCE_KEY,
    ManifestCache,
    SequenceCounter,
    apply_retention,
    join_url,
    newest_record,
    open_root,
    write_newest,
)
from smpckpt.errors import CheckpointCorrupt, CheckpointError, LayoutMismatch, ReplicaMismatch, UnsafeCheckpoint
from smpckpt.model.layout import API_RECORD, FULL_API_RECORD, RESERVED
from smpckpt.planners import ParallelSavePlanner
from smpckpt.planners._replica_values import KEYS_WAY, RANK_WAY, replica_differences
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter, FullArtifactWriter, probe_checkpoint
from smpckpt.storage.format.manifest import probe
from smpckpt.storage.write._base import FsspecWriterBase
from smpckpt.storage.write.writer import Workers

__all__ = ["SaveRequest", "manifest_extra", "job_token", "build_save_state", "write_checkpoint", "run_save"]
__all__ += ["publish_newest", "retain", "PlannerCache", "save_full", "resume_full", "full_url", "not_found_hint"]
__all__ += ["refuse_damaged_newest"]


log = logging.getLogger("smpckpt.api")


@dataclasses.dataclass(frozen=True)
class SaveRequest(CommonRequest):
    """Everything one partial save needs, validated and identical on every rank."""

    tag: str
    url: str
    user_content: Any
    opts: SaveOptions
    retention: Retention
    planners: PlannerCache = dataclasses.field(compare=False)  #: the Checkpointer's kept planners


def manifest_extra(api: str, tag: str, seq: int, user_content: Any, pickled: bool, **fields: Any) -> dict[str, Any]:
    """(rank 0) The manifest's ``extra`` of a save: the API record, the tag, its sequence number (``seq``,
    drawn by the job's :class:`~smpckpt.catalog.root.SequenceCounter`: what orders checkpoints), the save
    time, ``fields``, what user_content holds (``pickled``: needs ``allow_pickle``) and the versions."""
    now = time.time_ns()
    return {
        "api": api,
        "tag": tag,
        SEQUENCE_KEY: seq,
        "saved_at_ns": now,
        "saved_at": datetime.datetime.fromtimestamp(now / 1e9, datetime.timezone.utc).isoformat(),
        **fields,
        **describe_user_content(user_content, pickled),
        "smpckpt_version": VERSION,
        "torch_version": torch.__version__,
    }


def build_save_state(
    req: SaveRequest, ctx: DistContext, counter: SequenceCounter
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(all ranks, through ``ctx.all_ok``) This rank's state dict and, on rank 0, the manifest's ``extra``."""
    state = train_state(req.model, req.optimizers, group=ctx.pg)
    if req.opts.save_rng:
        state[RESERVED.rng] = {RESERVED.rng_of(ctx.rank): get_rng_state()}
    if not ctx.is_coordinator:
        return state, {}
    parts = sorted(k for k in (RESERVED.model, RESERVED.optim, RESERVED.rng) if k in state)
    fields = {"name_map": req.name_map is not None, "parts": parts, "rng": req.opts.save_rng}
    return state, _stamp(state, counter, API_RECORD, req.tag, req.user_content, True, **fields)


def _stamp(
    state: dict[str, Any], counter: SequenceCounter, api: str, tag: str, user_content: Any, record: bool, **fields: Any
) -> dict[str, Any]:
    """(rank 0) Add ``user_content`` to ``state``; the manifest's ``extra``, numbered by ``counter`` (``record``:
    with what a roll-back abandoned, catalog.root)."""
    # warns when it needs allow_pickle, at the caller's line: below it Checkpointer.save or save_checkpoint,
    # Checkpointer._save, all_ok (and its lambda), build_save_state (or save_full's build), this function
    payload, safe = encode_user_content(user_content, stacklevel=7)
    state[RESERVED.user_content] = payload  # an ObjectBuffer: written as torch.save left it, not copied
    if not counter.drawn and not counter.offline:  # (the job's first save into the root, or an export: one probe)
        refuse_checkpoint_root(counter.root, counter.storage_options)
    # a save into the root (not an export) is refused while another job saves there (catalog.root)
    seq = counter.next(job_token(), guard=record)
    return manifest_extra(api, tag, seq, user_content, not safe, **fields, **(counter.record(tag) if record else {}))


def refuse_checkpoint_root(root: str, storage_options: Any) -> None:
    """(rank 0) Refuse a ``root`` that is itself a checkpoint folder (a committed one of ours, or stock DCP's):
    a save there made a root inside it (hunt73c F7), whose saves a resume of the real root never sees and which
    that root's retention removes along with the folder. Two reads, no listing; unreadable: not known to be one
    (the save's own listing reports it)."""
    try:
        found = probe(*open_root(root, storage_options), list_when_empty=False)
    except (OSError, CheckpointError):
        return
    if found.state not in ("committed", "legacy"):
        return
    root = root.rstrip("/")
    parent, _, name = root.rpartition("/")
    if found.manifest is not None and found.manifest.kind == "partial" and name.endswith(PARTIAL_SUFFIX) and parent:
        raise CheckpointError(
            f"{root} is itself a committed checkpoint (tag {name[: -len(PARTIAL_SUFFIX)]!r}) of the root {parent}: "
            f"a save there would make a root inside it, which a resume of {parent} never sees and whose retention "
            f"removes it with that checkpoint; nothing written: save to {parent!r}"
        )
    kind = found.manifest.kind if found.manifest is not None else found.state
    raise CheckpointError(
        f"{root} is itself a checkpoint folder ({kind}): a save there would make a root inside a checkpoint; "
        "nothing written: save to a root of its own (a folder of tags, not one checkpoint)"
    )


def job_token() -> str:
    """(rank 0) The job's identity (``extra["job"]``): its process's host, boot, pid namespace, pid and start
    time, hashed. Every Checkpointer of the process (one job's) records the same; another process (another job,
    a restart, another container's process of the same pid) another. Derived at each save: nothing is kept."""
    parts = [os.uname().nodename, str(os.getpid())]
    # Linux; elsewhere host and pid alone. Each part on its own: one unreadable keeps the others (rev69c 9)
    with contextlib.suppress(OSError, ValueError), open("/proc/sys/kernel/random/boot_id", "rb") as f:
        parts.append(f.read(64).strip().decode())
    with contextlib.suppress(OSError, IndexError, ValueError), open("/proc/self/stat", "rb") as g:
        parts.append("start " + g.read(4096).rsplit(b")", 1)[1].split()[19].decode())
    with contextlib.suppress(OSError):
        parts.append(f"ns {os.stat('/proc/self/ns/pid').st_ino}")
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=8).hexdigest()


def write_checkpoint(req: SaveRequest, state: dict[str, Any], extra: Mapping[str, Any]) -> None:
    """(all ranks) ``dcp.save``; returns only after rank 0 committed the manifest."""
    writer = FsspecStorageWriter(
        req.url,
        storage_options=req.storage_options,
        overwrite=req.opts.overwrite,
        manifest_extra=extra,
        format=req.opts.format,
        sync_files=req.opts.sync_files,
    )
    # a background save given up on while a peer was silent commits nothing if that peer comes back
    writer.before_commit = commit_point
    run_save("partial", req, writer, state, f"saving checkpoint {req.url}", req.planners, req.opts.verify_replicas)


def run_save(
    kind: Literal["partial", "full"],
    common: CommonRequest,
    writer: FsspecWriterBase,
    state: dict[str, Any],
    action: str,
    planners: PlannerCache,
    verify_replicas: bool,
    dedup_tied: bool | None = None,
) -> None:
    """(all ranks) ``dcp.save`` with the kept planner of ``kind``; on failure the save's files are removed
    (a retry must not find them), then our error is raised. ``dedup_tied``: leave out a head tied to its
    embedding (full artifacts, as ``save_pretrained``)."""
    if isinstance(writer, FsspecStorageWriter):  # a full artifact's writer keeps its own threads
        writer.pool_of = planners.workers.pool
    rows: dict[str, str] = {}
    try:
        with planners.kept(kind, common) as planner, quiet_no_dist():
            planner.verify_replicas = verify_replicas
            if dedup_tied is not None:
                planner.dedup_tied = dedup_tied
            try:
                dcp.save(state, storage_writer=writer, planner=planner, process_group=common.process_group)
            except CheckpointException:  # what this rank holds, to name a replica mismatch (below)
                tied = getattr(planner, "tied", {})  # a tie one rank holds and another not (rev62b F4)
                rows = {
                    e.key: f"{e.value.dtype} {tuple(e.global_shape or ())}"
                    + (f" (the tensor of {tied[e.key]!r})" if e.key in tied else "")
                    for e in planner.entries.values()
                    if e.kind == "tensor" and not e.rank_local
                }
                raise
    except CheckpointException as exc:
        try:
            writer.discard_failed_save(exc)
        except Exception:  # noqa: BLE001 - the save's own error is the one to raise
            log.warning("%s: removing the failed save's files failed", action, exc_info=True)
        err = translate_dcp(exc, action, group=common.process_group)
        if isinstance(err, ReplicaMismatch) and "disagree on their replicated" in str(err):
            # every rank got this failure from DCP's plan step: more collectives name the keys. Each distinct
            # key list crosses once, from its first holder (every rank's, gathered, padded to the longest:
            # 15 GiB per rank at 100k keys x 2,048 ranks, rev62b F3)
            ctx = DistContext(common.process_group)
            digests = ctx.all_gather_object(hashlib.sha256(repr(sorted(rows.items())).encode()).hexdigest())
            first = {d: ctx.broadcast_object(rows, src=r) for r, d in enumerate(digests) if digests.index(d) == r}
            named = replica_differences(common.layout, [first[d] for d in digests])
            way = "pass Sharding(held_by_some=[globs]) for keys only some ranks hold"  # what the API takes
            err = ReplicaMismatch((f"{err} {named}" if named else str(err)).replace(KEYS_WAY, way))
        if isinstance(err, CheckpointError) and RANK_WAY in str(err):  # the API has no rank_local= (rev64c F3)
            err = type(err)(str(err).replace(RANK_WAY, "listed in Sharding(held_by_some=[globs])"))
        raise err from exc


def publish_newest(req: SaveRequest, ctx: DistContext, extra: Mapping[str, Any] | None = None) -> None:
    """(all ranks) Rank 0 points ``newest`` at the committed tag; its success or failure reaches all. A save
    that rolled back (``extra``, rank 0's) first leaves the root's copy of what it abandoned (catalog.root)."""

    def point() -> None:
        commit_point()  # a background save given up on (a silent peer) leaves newest as it was
        if extra and extra.get(ABANDONED_KEY):
            try:
                write_abandoned(req.root, req.storage_options, req.tag, extra)
            except (OSError, CheckpointError) as exc:  # the manifest holds the record too
                log.warning("%s: could not record the roll-back beside 'newest': %s", req.root, exc)
        fs, root_path = open_root(req.root, req.storage_options)
        write_newest(fs, root_path, req.tag, sync=req.opts.sync_files)

    try:
        ctx.on_coordinator(point)
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {req.url} is committed but {req.root}/newest could not be updated: {exc}"
        ) from exc


def retain(req: SaveRequest, ctx: DistContext, manifests: ManifestCache | None = None) -> None:
    """(rank 0) Retention and stale-debris removal (``manifests``: the Checkpointer's records of the root,
    catalog.root); never fails the committed save."""
    keep, stale_after = req.retention.num_kept_partial_checkpoints, req.retention.remove_uncommitted_older_than
    if not ctx.is_coordinator or (keep is None and stale_after is None):
        return
    try:
        result = apply_retention(
            req.root,
            keep,
            storage_options=req.storage_options,
            protected={req.tag},
            just_saved=req.tag,
            uncommitted_older_than=stale_after,
            cache=manifests,
        )
    except Exception as exc:  # noqa: BLE001 - retention never fails a committed save
        log.warning("retention after saving %s failed (nothing else affected): %s", req.url, exc)
        return
    if result.removed:
        log.info("retention kept %s checkpoint(s); removed %s", keep, list(result.removed))
    if result.removed_uncommitted or result.aborted_uploads:
        log.info(
            "removed stale uncommitted folders %s and aborted %d multipart upload(s)",
            list(result.removed_uncommitted),
            len(result.aborted_uploads),
        )


class PlannerCache:
    """The save planners one Checkpointer keeps, one per kind (a planner in use is taken out), and the
    threads writing every save's files (``workers``, ended by its close: threads new at each save left
    glibc's per-thread arenas holding their freed buffers, README "Tiered checkpoints", Memory)."""

    def __init__(self, workers: Workers | None = None) -> None:
        self._lock = threading.Lock()  # the caller's saves and the background save's
        self._kept: dict[str, ParallelSavePlanner] = {}
        self.workers = workers or Workers("smpckpt-write")

    @contextlib.contextmanager
    def kept(self, kind: str, req: CommonRequest) -> Iterator[ParallelSavePlanner]:
        """(all ranks) The kept planner for ``kind`` scoped to ``req`` (a new one when none is free), kept
        again without this save's tensors or scope once the save ends."""
        with self._lock:
            planner = self._kept.pop(kind, None)
        if planner is None:
            planner = ParallelSavePlanner(**req.planner_args(), cache_scope="local")
        else:
            planner.rescope(**req.planner_args())
        try:
            yield planner
        finally:
            planner.release_state(scope=True)
            with self._lock:
                self._kept[kind] = planner


# -- full artifacts: save_full (all ranks write their shards into ``{out}/model*.safetensors``; rank 0 adds
# user_content and commits; ``newest`` and retention are left alone) and resume_full (``partial=False``: each
# rank reads only its shards' bytes of an artifact or a plain Hugging Face folder, then ``set_state_dict``)
def full_url(root: str, tag: str, *, saving: bool = True) -> str:
    """``{root}/{tag}``: the folder of a full checkpoint (``tag`` validated at the caller's edge). A resume
    still reads an artifact saved as ``smpckpt.abandoned`` before that name was refused (rev68d F2)."""
    if tag in (NEWEST_NAME, ABANDONED_NAME)[: 2 if saving else 1]:  # the root's own files (a roll-back's record)
        raise ValueError(f"{tag!r} cannot name a full checkpoint: {{path}}/{tag} is a file of the root's partial ones")
    return join_url(root, tag)


def _tensor_state(common: CommonRequest, optim: bool, destinations: bool = False) -> dict[str, Any]:
    """The model's state and (``optim``) the optimizer's per-parameter state, numbers included (Adafactor's
    int ``step``: left behind, a resume paired the saved moments with the live step)."""
    state = train_state(
        common.model, common.optimizers if optim else (), destinations=destinations, group=common.process_group
    )
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
    # a state name may hold dots, and nested state more: the parameter is the longest FQN in front
    fqns, at = state[RESERVED.model].keys(), len(f"{RESERVED.optim}.state.")
    local = {k: planner.entries[k].local_key for k in report.skipped_optional}
    owners = {k: RESERVED.state_owner(key[at:], fqns) for k, key in local.items() if key in numbers}
    lost = sorted(k for k, fqn in owners.items() if fqn not in unsaved)
    if not lost:
        return
    params = ", ".join(repr(p) for p in sorted({owners[k] or local[k] for k in lost})[:5])
    message = (
        f"the artifact holds optimizer tensor state but not {len(lost)} non-tensor state value(s) the optimizer "
        f"keeps beside it, of parameter(s) {params} ({', '.join(lost[:5])}): resume from a partial checkpoint, "
        "or re-export"
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
        "tensor, as in a partial checkpoint of the tied model): tie it as saved, or resume from a partial "
        "checkpoint saved with it held apart (a pipeline's last stage holding its own head)"
    )
    _refuse_or_warn(message, strict, "its optimizer state starts fresh")


def _refuse_or_warn(message: str, strict: bool, consequence: str) -> None:
    """``strict``: a ``LayoutMismatch``; else logged and warned, with what ``strict=False`` does instead."""
    if strict:
        raise LayoutMismatch(message)
    log.warning("%s; strict=False: %s", message, consequence)
    # the caller's line: below it resume (or resume_from_checkpoint), _resume, resume_full, all_ok, its lambda, the check
    warnings.warn(f"{message}; strict=False: {consequence}", stacklevel=8)


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
    if common.optimizers and not opts.include_optimizer:  # smp's meaning, kept: said once, in an agreement
        said = (
            "optimizer= was passed to a full save without ExportOptions(include_optimizer=True): the artifact holds "
            "no optimizer state (smp's full save does not combine optimizer states); pass that option to export "
            "it, or leave optimizer= out"
        )  # the caller's line: below it save_checkpoint or export, _export, save_full, all_ok, its lambda
        ctx.all_ok(lambda: ctx.is_coordinator and warnings.warn(said, UserWarning, stacklevel=6))
    # a transformers model (found without importing transformers): its class name is what save_pretrained
    # records as ``architectures``
    model_class = type(common.model)
    hf = opts.translate_function is None and any(c.__name__ == "PreTrainedModel" for c in model_class.__mro__)
    artifact = opts.artifact(architecture=model_class.__name__ if hf else None)
    if opts.translate_function is None:  # config.json's ties beside the model_type family's (FullOptions.tied)
        artifact = dataclasses.replace(artifact, tied=_model_ties(common.model))

    def build() -> tuple[dict[str, Any], dict[str, Any]]:
        state, translation = _tensor_state(common, opts.include_optimizer), opts.translate_function
        if not ctx.is_coordinator:
            return state, {}
        fields = {"optimizer": opts.include_optimizer, "dtype": str(opts.dtype) if opts.dtype is not None else None}
        fields["translation"] = translation.name if translation is not None else None
        return state, _stamp(state, counter, FULL_API_RECORD, tag, user_content, False, **fields)

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


def _model_ties(model: Any) -> dict[str, str]:
    """A transformers model's head -> embedding ties: ``_tied_weights_keys`` (transformers 5: that dict;
    4.x: a list of heads tied to the input embedding, named where this rank holds it, as the first stage does)."""
    tied = getattr(model, "_tied_weights_keys", None)
    if isinstance(tied, Mapping):
        return {str(k): str(v) for k, v in tied.items()}
    if not isinstance(tied, list) or not tied:
        return {}
    try:
        weight = getattr(model.get_input_embeddings(), "weight", None)
    except (AttributeError, NotImplementedError):
        return {}
    if weight is None:
        return {}
    embed = next((name for name, p in model.named_parameters() if p is weight), None)
    # every listed key (RoBERTa's bias too): whole shapes, known at the commit, tell the embedding's partners
    return {str(head): embed for head in tied} if embed else {}


def resume_full(ctx: DistContext, req: ResumeRequest) -> Any:
    """(all ranks, arguments compared) Load a full artifact or Hugging Face folder into the model."""
    if req.model is None:
        raise ValueError("a resume from a full checkpoint (partial=False) needs model=")
    url = full_url(req.root, req.tag, saving=False) if req.tag is not None else req.root
    # rank 0 reads the manifest once more (small): a user_content needing allow_pickle is refused before
    # the load writes into the model (a refusal at the decode, after it, left the model overwritten)
    pickled = ctx.on_coordinator(lambda: _pickled(url, req.storage_options))
    refuse_pickled(pickled, req.opts.allow_pickle, f"full checkpoint {url}")
    with InventedState(req.model, req.optimizers) as guard:

        def destinations() -> dict[str, Any]:
            init_missing_state(req.optimizers, req.model)
            return _tensor_state(req, True, destinations=True)

        state = ctx.all_ok(destinations)
        state[RESERVED.user_content] = RecordSlot(b"")
        reader = FsspecStorageReader(
            url,
            storage_options=req.storage_options,
            verify_checksums=req.opts.verify_checksums,
            allow_pickle=req.opts.allow_pickle,
            translation=req.opts.translate_function,  # type: ignore[arg-type]  # a Translation (ResumeOptions checks)
            hf_prefix=f"{RESERVED.model}.",
        )
        optional = (RESERVED.user_content, f"{RESERVED.optim}.*")
        planner = load_checkpoint(req, req.opts, url, state, reader, optional=optional, what="full checkpoint")
        guard.loaded = True
        if not req.opts.strict:
            skipped_keys(url, ctx, planner, full=True)
        # exported with an optimizer (its manifest says so: one saved before its first step holds no state),
        # the artifact holds the state of every parameter that had some: the others had none
        exported = reader.manifest is not None and reader.manifest.extra.get("optimizer") is True
        holds_optim = exported or any(
            k.startswith(f"{RESERVED.optim}.state.") for k in planner.metadata.state_dict_metadata
        )
        unsaved = stateless_at_save(
            req.model, req.optimizers, state, guard.stateless, planner, all_state_saved=holds_optim
        )

        def apply() -> Any:
            if req.optimizers:  # the artifact holds tensors only: the rest of the optimizer's state is kept
                _, current = get_state_dict(req.model, req.optimizers, options=OPTIONS)  # type: ignore[arg-type]
                state[RESERVED.optim] = {**current, **state[RESERVED.optim]}
            return apply_state(req, None, ctx, state, planner.report, False, unsaved)[0]

        if holds_optim:
            ctx.all_ok(lambda: _numbers_not_saved(state, planner, unsaved, req.opts.strict))
            ctx.all_ok(lambda: _untied_without_state(planner, unsaved, req.opts.strict))
        guard.applied = True
        user_content = ctx.all_ok(apply)
    log.info("loaded full checkpoint %s into %s (%s)", url, req.layout, reader.state or "committed")
    return user_content


def _pickled(url: str, storage_options: Any) -> bool:
    """(rank 0) Whether the artifact's manifest says its user_content needs ``allow_pickle``."""
    try:
        found = probe_checkpoint(url, storage_options)
    except (OSError, CheckpointError):  # the load reports it, in its own words
        return False
    return found.manifest is not None and found.manifest.extra.get(PICKLED_KEY) is True


def not_found_hint(root: str, storage_options: Any) -> str:
    """(a tag-less resume that found nothing) A hint when ``root`` is itself a checkpoint folder, not the root of
    tags, or ``{root}_partial`` is one (a root and a tag joined): then ``missing_ok`` starts no fresh run."""
    parent, _, name = root.rstrip("/").rpartition("/")
    tag = name[: -len(PARTIAL_SUFFIX)] if name.endswith(PARTIAL_SUFFIX) else name
    joined = root.rstrip("/") + PARTIAL_SUFFIX
    for folder, what in (
        (root, "is itself a checkpoint folder"),
        (joined, f"joins a root and a tag ({joined} is one)"),
    ):
        try:
            state = probe_checkpoint(folder, storage_options).state
        except (OSError, CheckpointError):
            continue
        if state in ("legacy", "committed"):
            return (
                f"; {root} {what}: pass its parent as path and its name as tag "
                f"(resume_from_checkpoint({parent or '.'!r}, tag={tag!r}))"
            )
    return ""


def refuse_damaged_newest(ctx: DistContext, root: str, storage_options: Any) -> None:
    """(all ranks; a tag-less resume that found nothing committed) Refuse when ``newest`` names a folder that
    is there but damaged, unreadable or without its manifest: ``newest`` moves only after a commit, so that
    is the job's progress, broken -- no fresh start (``missing_ok``) and no "nothing committed"."""
    rec = ctx.on_coordinator(lambda: newest_record(root, storage_options))
    if rec is None or rec.state in ("committed", "missing", "removing", "legacy"):
        return
    errors = {"unreadable": CheckpointError, "unsafe": UnsafeCheckpoint}
    raise errors.get(rec.state, CheckpointCorrupt)(
        f"{root}/newest names {rec.tag!r}, which is {rec.state} ({rec.detail}) and no other checkpoint is "
        "committed: not starting fresh (missing_ok does not apply to a checkpoint that is there); "
        + (
            "retry the resume"
            if rec.state == "unreadable"
            else "restore it (a copy still syncing: wait), pass tag= to choose another, or remove it and newest"
        )
    )

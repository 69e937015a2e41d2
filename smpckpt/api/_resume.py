"""The steps of :meth:`smpckpt.Checkpointer.resume` over a :class:`ResumeRequest`: :func:`resolve_target`
(rank 0) -> :func:`resume_state` -> :func:`load_checkpoint` -> :func:`~smpckpt.api.options.check_groups` ->
:func:`skipped_keys` -> :func:`apply_state` -> :func:`summarize` (all ranks)."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import _get_fqns, set_model_state_dict, set_state_dict

from smpckpt._checks import refuse_clashing_new_state
from smpckpt.api._dist import (
    OPTIONS,
    PICKLED_KEY,
    CommonRequest,
    DistContext,
    RecordSlot,
    decode_user_content,
    get_rng_state,
    quiet_no_dist,
    refuse_pickled,
    set_rng_state,
    train_state,
    translate_dcp,
)
from smpckpt.api.options import ResumeOptions, aside
from smpckpt.catalog import root as catalog
from smpckpt.catalog._abandoned import lineage
from smpckpt.errors import CheckpointError, CheckpointNotFound, loaded_in_place
from smpckpt.model.layout import API_RECORD_V1, RESERVED, LayoutRecord, ParallelLayout
from smpckpt.planners import LoadReport, ParallelLoadPlanner, dtensor_layout, warn_skipped
from smpckpt.storage import FsspecStorageReader, Manifest, probe_checkpoint

__all__ = ["ResumeInfo", "ResumeRequest", "Target", "resolve_target", "resume_state"]
__all__ += ["load_checkpoint", "apply_state", "stateless_at_save", "InventedState"]
__all__ += ["init_missing_state", "drop_optimizer_state", "summarize", "skipped_keys", "in_place"]


log = logging.getLogger("smpckpt.api")


@dataclasses.dataclass(frozen=True)
class ResumeInfo:
    """What a :func:`~smpckpt.resume_from_checkpoint` did (same on every rank). ``path_taken``: ``"fast"``
    when every rank's pieces matched saved chunks exactly, else ``"reshard"``. RNG states are restored only
    under an unchanged layout (else ``rng_restored`` is empty, and a warning said so)."""

    path: str  #: checkpoint root
    tag: str
    checkpoint_url: str
    path_taken: Literal["fast", "reshard"]
    layout: ParallelLayout
    saved_layout: ParallelLayout | None
    layout_changed: bool  #: the layout, or the DTensors' meshes and placements (``LayoutRecord.dtensors``)
    fast_path_tensors: int  #: summed over ranks
    resharded_tensors: int  #: summed over ranks
    rng_restored: tuple[str, ...]  #: generators restored on this rank ("torch", "python", ...)
    fell_back: bool  #: ``newest`` was not taken (unusable, or a later tag committed); see the warning
    #: keys not loaded: missing (``strict=False`` only), and optimizer state of parameters stateless when saved
    skipped_keys: tuple[str, ...] = ()
    #: where it came from: ``"durable"`` (``path``) or ``"fast"`` (the fast tiers, ``local_path=``)
    tier: Literal["durable", "fast"] = "durable"
    #: fast tier: the parts a node lacked and fetched from a peer, as (file, from rank, to rank)
    from_peers: tuple[tuple[str, int, int], ...] = ()

    @property
    def resharded(self) -> bool:
        return self.path_taken == "reshard"


@dataclasses.dataclass(frozen=True)
class Target:
    """The committed checkpoint rank 0 chose (small and picklable: it is broadcast)."""

    tag: str
    url: str
    record: LayoutRecord | None
    api: str | None  #: the manifest's API record (how user_content is stored)
    has_rng: bool
    fell_back: bool
    #: this checkpoint's place in its root's order (``record_order``: sequence number, save time, save id)
    order: tuple[int, int, str] = (0, 0, "")
    #: the highest sequence number rank 0 saw choosing, and whether it listed the root: saves go on after it
    seen_seq: int = 0
    listed: bool = False
    pickled: bool = False  #: its user_content needs allow_pickle (the manifest says so; older ones do not)
    abandoned: tuple[tuple[int, int], ...] = ()  #: what its history abandoned (roll-backs, ``catalog.root``)
    said: str = ""  #: the fallback's warning, unsaid (``resolve_target(warn=False)``: the fast tier may load)
    runs: tuple[Any, Any] = (None, None)  #: ``extra["tier"]``'s "runs" and "passed", unread (``_tiers.runs_of``)
    #: (rank 0) the manifest it was chosen by: its reader reuses the parse (not broadcast: ``__getstate__``)
    manifest: Manifest | None = dataclasses.field(default=None, compare=False, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "manifest": None}

    @classmethod
    def of(cls, tag: str, url: str, manifest: Manifest | None, fell_back: bool) -> Target:
        extra = manifest.extra if manifest is not None else {}
        record, api, rng = LayoutRecord.from_manifest(manifest), extra.get("api"), bool(extra.get("rng"))
        order = catalog.record_order(manifest)
        pickled = extra.get(PICKLED_KEY) is True  # a save abandons only numbers below its own (catalog.root)
        abandoned = tuple(p for p in catalog.abandoned_of(extra) if p[1] < order[0])
        tier = extra.get("tier")  # a fast-tier save drained: its history goes on
        runs = (tier.get("runs"), tier.get("passed")) if isinstance(tier, Mapping) else (None, None)
        return cls(
            tag, url, record, api, rng, fell_back, order, order[0], False, pickled, abandoned, "", runs, manifest
        )

    def seen_by(self, counter: catalog.SequenceCounter) -> None:
        """The job's next saves are numbered after what choosing this target saw (a roll-back is marked only
        once its state is applied, ``SequenceCounter.resumed``: a failed resume is none)."""
        counter.saw(self.seen_seq, listed=self.listed)


@dataclasses.dataclass(frozen=True)
class ResumeRequest(CommonRequest):
    """Everything one resume needs, validated and identical on every rank."""

    tag: str | None
    opts: ResumeOptions


def resolve_target(root: str, tag: str | None, storage_options: Any, warn: bool = True) -> Target | None:
    """(rank 0) The committed checkpoint to resume, or ``None``. With ``tag=None``: the one ``newest`` names,
    unless unusable or a later one committed: then the newest of the job's history (none a roll-back abandoned),
    warned (``warn``; else in ``said``), its ``abandoned`` all the ranges that decided it (the root's copy's too)."""
    if tag is not None:
        url = catalog.partial_url(root, tag)
        found = probe_checkpoint(url, storage_options)
        if found.state == "missing":  # a folder stock dcp.save wrote under the tag's own name
            plain = catalog.join_url(root, tag)
            if (legacy := probe_checkpoint(plain, storage_options)).state == "legacy":
                url, found = plain, legacy
            if detail := found.detail or legacy.detail:  # a file where the folder would be (the root's own files)
                raise CheckpointNotFound(f"no checkpoint {tag!r}: {url if found.detail else plain} is {detail}")
        if found.manifest is None:
            if found.state == "missing":
                return None
            if found.state == "legacy":
                log.warning("%s was written by stock dcp.save: loading it without integrity checks", url)
                return Target(tag, url, None, None, False, False)
            raise CheckpointNotFound(
                f"checkpoint {tag!r} at {url} is {found.state}: it has no commit marker (a failed or running save)"
            )
        # no listing here: a roll-back's next save lists the root and numbers past everything in it
        return Target.of(tag, url, found.manifest, False)
    newest = catalog.read_newest(*catalog.open_root(root, storage_options))
    records = catalog.scan_root(root, storage_options=storage_options)
    committed = [r for r in records if r.committed]
    if not committed:
        return None
    latest = max(committed, key=lambda r: r.order)
    top = latest.order[0]  # the listing every later save numbers past
    shown = root.rstrip("/") or root  # spelled as lineage() spells the root's copy, in one message
    named = next((r for r in committed if r.tag == newest), None)
    if named is not None and named.order >= latest.order:
        return dataclasses.replace(Target.of(named.tag, named.url, named.manifest, False), seen_seq=top, listed=True)
    if named is not None:
        reason = (
            f"{shown}/newest names {newest!r}, but {latest.tag!r} was numbered after it (the job probably "
            "stopped between that commit and the update of 'newest', or two saves overlapped)"
        )
    elif newest is None:
        reason = f"{shown}/newest is missing or unreadable"
    else:
        named_record = next((r for r in records if r.tag == newest), None)
        state = named_record.state if named_record is not None else "missing"
        if named_record is not None and state == "unreadable":
            # an I/O error says nothing against it: a fallback would silently resume an older one
            raise CheckpointError(
                f"{shown}/newest names {newest!r}, which could not be read ({named_record.detail}); not falling back to "
                "an older checkpoint. Retry the resume, or pass tag= to choose one"
            )
        reason = f"{shown}/newest names {newest!r}, which is not a committed checkpoint ({state})"
    copy, history, dropped, by_copy = lineage(root, storage_options, committed)
    by_copy = f", as {by_copy} records" if by_copy else ""
    gone = f" (not {[r.tag for r in dropped]}: a roll-back abandoned them{by_copy})" if dropped else ""
    if not history:
        raise CheckpointNotFound(f"{reason}; every committed checkpoint was abandoned by a roll-back{gone}")
    latest = history[0]
    message = f"{reason}; resuming from the newest committed checkpoint {latest.tag!r} of the job's history{gone}"
    if warn:
        log.warning(message)
        warnings.warn(message, stacklevel=6)  # the caller's: below it resume, _resume, on_coordinator, its lambda
    target = Target.of(latest.tag, latest.url, latest.manifest, True)
    ranges = tuple(dict.fromkeys((*copy, *target.abandoned)))[:16]  # at most catalog.root's 16 are recorded
    return dataclasses.replace(target, seen_seq=top, listed=True, abandoned=ranges, said="" if warn else message)


def resume_state(
    req: ResumeRequest, target: Target, ctx: DistContext, depth: int = 0
) -> tuple[bool | None, dict[str, Any]]:
    """(all ranks, one agreement; two after a layout change) ``(restore RNG, the load's destinations)``: RNG only
    under the saved layout and DTensor placements (``None``: they changed), else warned in an agreement (a filter
    making it an error fails every rank alike); a user_content needing ``allow_pickle`` is refused first.
    ``depth``: the frames between the caller's and ``Checkpointer.resume`` (the warning names the caller's)."""
    saved = target.record.layout if target.record is not None else None
    recorded = target.record.dtensors if target.record is not None else None
    refuse_pickled(target.pickled, req.opts.allow_pickle, f"checkpoint {target.tag!r} ({target.url})")
    state: dict[str, Any] = {}

    def build() -> str:
        init_missing_state(req.optimizers, req.model)
        state.update(train_state(req.model, req.optimizers, destinations=True))
        layout = dtensor_layout(state.get(RESERVED.model))
        if callable(req.opts.translate_function):  # the model loads what the function returns: loaded aside
            state[RESERVED.model] = aside(state[RESERVED.model])
        state[RESERVED.user_content] = RecordSlot(b"")  # placeholder: the stored record lands here, undecoded
        return layout

    # every rank's DTensor layout comes back in the agreement's own collective: every rank decides alike
    layouts = ctx.all_ok_values(build)
    # no model, no DTensors to compare: its RNG states are what a resume(model=None) is for (rev63h F1)
    moved = recorded is not None and req.model is not None and LayoutRecord.world_dtensors(layouts) != recorded
    wanted, rng = req.opts.load_rng and target.has_rng, saved == req.layout and not moved
    if wanted and not rng:
        change = f"{saved} -> {req.layout}" if saved != req.layout else f"{saved}, its DTensor placements changed"
        said = f"the layout changed ({change}): RNG states are not restored (they do not map across layouts)"
        said += "; every rank keeps its current generators"  # below the caller's line: Checkpointer frames, all_ok
        ctx.all_ok(lambda: ctx.is_coordinator and warnings.warn(said, stacklevel=6 + depth))
    if wanted and rng:
        state[RESERVED.rng] = {RESERVED.rng_of(ctx.rank): get_rng_state()}
    return None if moved else wanted and rng, state


class InventedState:
    """(a resume) Records the parameters without optimizer state before the state is built
    (:attr:`stateless`); a resume failing before ``applied`` takes the invented state away again (after
    ``loaded``, its error says that the model holds the checkpoint's values)."""

    def __init__(self, model: Any, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.model, self.optimizers, self.applied, self.loaded = model, optimizers, False, False
        params = model.named_parameters(remove_duplicate=False) if model is not None and optimizers else ()
        #: the FQNs of the parameters no optimizer holds state for (an empty entry, a read of the defaultdict, is none)
        self.stateless = frozenset(
            f for name, p in params if not any(o.state.get(p) for o in optimizers) for f in _get_fqns(model, name)
        )

    def __enter__(self) -> InventedState:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None and not self.applied:
            drop_optimizer_state(self.model, self.optimizers, self.stateless)
        if exc is not None:  # refused after its load (check_groups, skipped_keys, apply_state, torch), or a Ctrl-C
            loaded_in_place(exc, self.loaded)


def init_missing_state(optimizers: Sequence[torch.optim.Optimizer], model: Any) -> None:
    """Give the parameters a live optimizer holds no state for the state DCP gives a fresh optimizer (a step
    at lr 0 with zero gradients, :func:`_step_at_lr0`; on a scratch optimizer of the same class for those of
    one with state): DCP initialises only an optimizer without any state, and no frozen parameter, so their
    saved state had no destination. Those the checkpoint holds nothing for lose it again
    (:func:`stateless_at_save`). A fresh optimizer whose step fails is refused by name; an optimizer class
    that cannot be built from its groups is left as is (a frozen parameter's saved state then refused, or
    skipped, by its keys). The state given is checked for keys DCP would flatten into one (``model`` names them)."""
    drop_optimizer_state(None, optimizers, frozenset())  # empty entries would make DCP take them for state
    for i, opt in enumerate(optimizers):
        fresh = not opt.state and all(p.grad is None for g in opt.param_groups for p in g["params"])
        if fresh:  # as DCP's own _init_optim_state (which leaves lr 0 and zero gradients behind a failed step)
            trained = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
            try:
                _step_at_lr0(opt, trained)
            except Exception as exc:
                raise RuntimeError(
                    f"optimizer {i} ({type(opt).__name__}) cannot be resumed fresh: the step at lr 0 with zero "
                    f"gradients that gives it the state to load into failed ({type(exc).__name__}: {exc}); its lr and "
                    "gradients are as they were. Leave it out of optimizer= and put its state_dict() in user_content"
                ) from exc
            refuse_clashing_new_state(model, i, opt, trained)
        groups = []
        for g in opt.param_groups:
            todo = [  # an integer one (a quantised weight) would fail the step: it has state only as _put_back gives it
                p
                for p in g["params"]
                if p not in opt.state and not (fresh and p.requires_grad) and (p.is_floating_point() or p.is_complex())
            ]
            if todo:
                groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": todo})
        if not groups:
            continue
        params = [p for g in groups for p in g["params"]]
        try:
            scratch = type(opt)(groups)  # type: ignore[call-arg]  # torch's optimizers take their groups alone
            _step_at_lr0(scratch, params)
        except Exception as exc:  # noqa: BLE001 - a class not built from its groups, a step needing more: as before
            if any(p.requires_grad for p in params):  # frozen ones alone: few hold saved state, refused by key
                log.warning(
                    "%s: %d parameter(s) without state could not be given fresh state (%s: %s); state the "
                    "checkpoint holds for them cannot be loaded into this optimizer (resume into a fresh one)",
                    *(type(opt).__name__, len(params), type(exc).__name__, exc),
                )
            continue
        for p in params:
            if p in scratch.state:
                opt.state[p] = scratch.state[p]
        refuse_clashing_new_state(model, i, opt, params)


def _step_at_lr0(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """``opt.step()`` at lr 0 with zero gradients on ``params`` (empty sparse ones for SparseAdam, which refuses
    dense ones); lr and gradients put back on every exit."""
    lrs = [(g, g["lr"]) for g in opt.param_groups if "lr" in g]
    grads = [p.grad for p in params]
    try:
        for g, lr in lrs:
            g["lr"] = torch.tensor(0.0) if isinstance(lr, torch.Tensor) else 0.0
        for p in params:
            p.grad = torch.zeros_like(p).to_sparse() if isinstance(opt, torch.optim.SparseAdam) else torch.zeros_like(p)
        opt.step()
    finally:
        for g, lr in lrs:
            g["lr"] = lr
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad


def load_checkpoint(
    common: CommonRequest,
    opts: ResumeOptions,
    url: str,
    state: dict[str, Any],
    reader: FsspecStorageReader | None = None,
    *,
    optional: tuple[str, ...] | None = None,
    what: str = "checkpoint",
    known: Manifest | None = None,
) -> ParallelLoadPlanner:
    """(all ranks) ``dcp.load`` in place, keys checked before any data is read; ``optional``: may be absent;
    ``known``: the manifest rank 0 chose it by (``Target.manifest``: parsed once)."""
    planner = ParallelLoadPlanner(
        **common.planner_args(),
        allow_dtype_cast=opts.allow_dtype_cast,
        allow_pickle=opts.allow_pickle,
        allow_partial_load=not opts.strict,
        optional=optional or RESERVED.optional(model=common.model is not None, optim=bool(common.optimizers)),
        keep_tied=opts.keep_tied,
    )
    reader = reader or FsspecStorageReader(
        url,
        storage_options=common.storage_options,
        verify_checksums=opts.verify_checksums,
        allow_pickle=opts.allow_pickle,
    )
    reader.known = known or reader.known
    try:
        with quiet_no_dist():
            dcp.load(state, storage_reader=reader, planner=planner, process_group=common.process_group)
    except CheckpointException as exc:
        md_error, group = reader.metadata_error, common.process_group
        err = translate_dcp(exc, f"loading {what} {url}", metadata_error=md_error, group=group)
        raise loaded_in_place(err, reader.reading and in_place(common, opts)) from exc
    except BaseException as exc:  # a peer lost during the read (gloo's error), a Ctrl-C (hunt69b F4)
        loaded_in_place(exc, reader.reading and in_place(common, opts))
        raise
    return planner


def in_place(common: CommonRequest, opts: ResumeOptions) -> bool:
    """Whether a load writes into the live model or optimizers: not a partial resume's with a translate_function
    and no optimizer (its model keys land aside, :func:`~smpckpt.api.options.aside`), nor one without a model."""
    aside_ = opts.partial and callable(opts.translate_function)
    return common.model is not None and (bool(common.optimizers) or not aside_)


def apply_state(
    req: ResumeRequest,
    target: Target | None,
    ctx: DistContext,
    state: dict[str, Any],
    report: LoadReport | None,
    restore_rng: bool,
    unsaved: frozenset[str] = frozenset(),
) -> tuple[Any, tuple[str, ...]]:
    """(all ranks, through ``ctx.all_ok``) Set model/optimizer state (the model's as
    :func:`check_groups` translated it), RNG; decode user_content once. ``unsaved``:
    :func:`stateless_at_save`'s parameters, left without optimizer state. Returns ``(user_content, RNG
    states restored)``. ``target=None``: a full artifact (``user_content`` pickled once)."""
    if req.model is not None:
        model_sd = state[RESERVED.model]
        opts = dataclasses.replace(OPTIONS, strict=req.opts.strict)
        try:
            if req.optimizers:
                # DCP loads no state into a frozen parameter (load_state_dict drops it): trainable for the load
                sd, can = state[RESERVED.optim], (torch.Tensor.is_floating_point, torch.Tensor.is_complex)  # not int8
                frozen = [p for o in req.optimizers for p in o.state if not p.requires_grad and any(f(p) for f in can)]
                ints = [(o, p) for o in req.optimizers for p in o.state if not any(f(p) for f in can)]
                # state saved in a dtype other than its parameter's, as loaded (torch's load_state_dict casts floating
                # state to its parameter's: fp32 moments of a bf16 model were rounded to bf16, hunt71d; nested too),
                # and live state the load left unfilled, as it was (strict=False's new parameters, rev71h M1)
                keep = (*report.own_dtype, *report.unfilled) if report else ()
                own = {id(sd.get(k.partition(".")[2])) for k in keep if k.startswith(f"{RESERVED.optim}.")} - {id(None)}
                filled = [(o, p, *leaf) for o in req.optimizers for p, s in o.state.items() for leaf in _leaves(s, own)]
                try:
                    for p in frozen:
                        p.requires_grad_(True)
                    set_state_dict(
                        req.model, req.optimizers, model_state_dict=model_sd, optim_state_dict=sd, options=opts
                    )
                finally:
                    for p in frozen:
                        p.requires_grad_(False)
                _put_back(req.model, ints, sd)
                for o, p, path, value in filled:  # the loaded tensor itself where the cast replaced it ("step": never)
                    now = o.state.get(p, {})
                    for part in path[:-1]:
                        now = now.get(part, {})
                    if isinstance(cast := now.get(path[-1]), torch.Tensor) and cast.dtype != value.dtype:
                        now[path[-1]] = value.to(device=cast.device)  # where torch put it (a no-op: it was there)
                drop_optimizer_state(req.model, req.optimizers, unsaved)
            else:
                set_model_state_dict(req.model, model_sd, options=opts)
        except Exception as exc:  # torch's helpers call load_state_dict(state_dict=..., strict=..., assign=...)
            owner, found, _ = str(exc).partition(".load_state_dict() got an unexpected keyword argument")
            if not found or not isinstance(exc, TypeError):  # the apply began: the model may hold some keys
                loaded_in_place(exc, True)
                raise
            err = TypeError(  # the class torch called: the model's, or an optimizer's
                f"{owner.rsplit('.', 1)[-1]}.load_state_dict does not take torch's keywords ({exc}): give the "
                "override torch's signature (a module's: load_state_dict(self, state_dict, strict=True, "
                "assign=False); an optimizer's: load_state_dict(self, state_dict))"
            )
            raise err from exc  # refused at binding: it wrote nothing (a load in place says so, InventedState)
    restored: tuple[str, ...] = ()
    if restore_rng:
        skipped = set(report.skipped_optional if report else ())
        mine = RESERVED.rng_of(ctx.rank)
        at = f"{RESERVED.rng}.{mine}."  # the checkpoint's keys of this rank's generators: restore those held whole
        whole = {c: s for c, s in state[RESERVED.rng][mine].items() if not any(k.startswith(at + c) for k in skipped)}
        restored = set_rng_state(whole)
    stored, nested = state[RESERVED.user_content], target is not None and target.api == API_RECORD_V1
    user_content = decode_user_content(stored if stored else None, allow_pickle=req.opts.allow_pickle, nested=nested)
    return user_content, restored


def _leaves(state: Mapping[str, Any], ids: set[int], at: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """The tensors among ``ids`` in one parameter's optimizer state, nested dicts included, with their paths."""
    found = [(at + (k,), v) for k, v in state.items() if id(v) in ids]
    return found + [x for k, v in state.items() if isinstance(v, Mapping) for x in _leaves(v, ids, at + (k,))]


def _put_back(model: Any, held: list[tuple[Any, torch.Tensor]], sd: Mapping[str, Any]) -> None:
    """(after ``set_state_dict``) The loaded optimizer state of integer parameters (quantised weights), which
    DCP skips as frozen and torch cannot make trainable for the load: set from the state dict (``held``:
    (optimizer, parameter) pairs holding state before the load; nested keys as nested dicts)."""
    if not held:
        return
    # one walk over the model and one over the state dict, whatever the number of parameters held (rev67a F7)
    owners = {f: p for name, p in model.named_parameters(remove_duplicate=False) for f in _get_fqns(model, name)}
    entries: dict[int, dict[str, Any]] = {id(p): {} for _, p in held}
    for key, value in sd.items():  # the longest FQN in front owns a key (layer.1 beside layer.1.x)
        if key.startswith("state.") and (owner := RESERVED.state_owner(key[6:], owners.keys())) is not None:
            if (at := entries.get(id(owners[owner]))) is not None:
                *path, last = key[7 + len(owner) :].split(".")
                for part in path:
                    at = at.setdefault(part, {})
                at[last] = value
    for opt, param in held:
        if entries[id(param)]:
            opt.state[param] = entries[id(param)]


def drop_optimizer_state(model: Any, optimizers: Sequence[Any], unsaved: frozenset[str]) -> None:
    """(after ``set_state_dict``, or a failed resume) Drop the optimizer state of ``unsaved`` and empty entries."""
    for opt in optimizers:
        for p in [p for p, v in opt.state.items() if not v]:
            del opt.state[p]
    if unsaved:
        for name, param in model.named_parameters(remove_duplicate=False):
            if _get_fqns(model, name) & unsaved:
                for opt in optimizers:
                    opt.state.pop(param, None)


def stateless_at_save(
    model: Any,
    optimizers: Sequence[Any],
    state: Mapping[str, Any],
    stateless: frozenset[str],
    planner: ParallelLoadPlanner,
    *,
    all_state_saved: bool = False,
) -> frozenset[str]:
    """(each rank) The parameters (FQNs) whose optimizer state keys are all absent from the checkpoint
    (missing under ``strict=False``, or skipped as optional) and that either had no state before the resume
    (``stateless``) or had none when saved (param groups say so, or ``all_state_saved``: a full artifact
    with optimizer state). Each was given state for the load; left so, its next ``step()`` would differ
    from the saved run's (Adam's bias correction). A parameter with live state merely missing from a
    checkpoint holding optimizer state keeps it, as ``strict=False`` promises; a partial checkpoint saved
    without optimizer leaves every parameter stateless, as saved (an in-process roll-back to it)."""
    report = planner.report
    if not optimizers or report is None:
        return frozenset()
    # strict: a missing key was refused before anything was read; optional ones (a full artifact's
    # optimizer state) are skipped, not missing
    saved_without = set(report.stateless_saved)  # the checkpoint says: no state when saved
    if all_state_saved:  # a full artifact holding optimizer state: what it skips had none when saved, unless its
        # parameter is not in the artifact either (new in the model: its live state is kept, rev71h2 M1)
        params, states = f"{RESERVED.model}.", f"{RESERVED.optim}.state."
        new = {k[len(params) :] for k in (*report.missing_keys, *report.skipped_optional) if k.startswith(params)}
        owner = RESERVED.state_owner
        saved_without |= {
            k for k in report.skipped_optional if k.startswith(states) and not owner(k[len(states) :], new)
        }
    gone_keys = (*report.missing_keys, *report.skipped_optional, *saved_without)
    if not gone_keys:
        return frozenset()
    optim_sd = state[RESERVED.optim]
    missing = {planner.entries[k].local_key if k in planner.entries else k for k in gone_keys}
    never = {planner.entries[k].local_key if k in planner.entries else k for k in saved_without}
    # the optimizers' parameters: the model's FQNs, and every one with param_groups keys here
    # (hyper-parameter names hold no dots; a full resume keeps only the optimizer's tensors)
    fqns = {key[len("param_groups.") :].rpartition(".")[0] for key in optim_sd if key.startswith("param_groups.")}
    if model is not None:
        fqns |= {f for name, _ in model.named_parameters(remove_duplicate=False) for f in _get_fqns(model, name)}
    absent: dict[str, bool] = {}  # fqn -> every one of its state keys missing
    saved_none: dict[str, bool] = {}  # fqn -> every one of them absent because it had no state when saved
    for key in optim_sd:
        if key.startswith("state."):
            fqn = RESERVED.state_owner(key[len("state.") :], fqns)
            if fqn is not None:
                absent[fqn] = absent.get(fqn, True) and f"{RESERVED.optim}.{key}" in missing
                saved_none[fqn] = saved_none.get(fqn, True) and f"{RESERVED.optim}.{key}" in never
    # a partial checkpoint saved without optimizer (strict=False: every key missing) had no state, as above; a
    # full artifact without it (its optimizer keys optional, skipped) leaves a live optimizer as it was
    lacking = {planner.entries[k].local_key if k in planner.entries else k for k in report.missing_keys}
    saved = planner.metadata.state_dict_metadata if planner.metadata is not None else {}
    no_optim = all(f"{RESERVED.optim}.{key}" in lacking for key in optim_sd) and not any(
        k.startswith(f"{RESERVED.optim}.")
        for k in saved  # not an optimizer over parameters new since the save
    )
    # stateless before the resume, or stateless when saved (a rollback: its live state is not the saved run's)
    return frozenset(f for f, gone in absent.items() if gone and (f in stateless or saved_none[f] or no_optim))


def skipped_keys(
    url: str, ctx: DistContext, planner: ParallelLoadPlanner, untranslated: tuple[str, ...] = (), full: bool = False
) -> tuple[int, int, tuple[str, ...]]:
    """(all ranks, after :func:`check_groups`, before :func:`apply_state`) Every rank's load summed: (tensors
    on the fast path, resharded, keys skipped). What ``strict=False`` skipped is warned in an agreement, so a
    warning made an error fails every rank alike before the state is applied. ``full``: of a full artifact."""
    report = planner.report
    missing = report.missing_keys if report else ()
    gone = (*missing, *untranslated, *(report.stateless_saved if report else ()))
    loaded = (report.fast_path, len(report.resharded)) if report else (0, 0)
    # each pipeline stage translates and loads its own keys
    counts = ctx.all_gather_object((*loaded, gone, missing, untranslated))
    unexpected = sorted(ctx.broadcast_object(report.unexpected_keys if report else ()))
    kept = sorted({k for c in counts for k in c[3]})
    dropped = sorted({k for c in counts for k in c[4]})
    if kept or unexpected or dropped:
        ctx.all_ok(lambda: warn_skipped(ctx.is_coordinator, url, kept, unexpected, dropped, full))
    skipped = sorted({k for c in counts for k in c[2]} | set(unexpected))
    return sum(c[0] for c in counts), sum(c[1] for c in counts), tuple(skipped)


def summarize(
    req: ResumeRequest,
    target: Target,
    planner_counts: tuple[int, int, tuple[str, ...]],
    restored: tuple[str, ...],
    rng: bool | None,
) -> ResumeInfo:
    """(all ranks) The :class:`ResumeInfo` of a load, logged (``rng``: :func:`resume_state`'s)."""
    fast, resharded, skipped = planner_counts
    saved = target.record.layout if target.record is not None else None
    info = ResumeInfo(
        path=req.root,
        tag=target.tag,
        checkpoint_url=target.url,
        path_taken="reshard" if resharded else "fast",
        layout=req.layout,
        saved_layout=saved,
        layout_changed=saved != req.layout or rng is None,
        fast_path_tensors=fast,
        resharded_tensors=resharded,
        rng_restored=restored,
        fell_back=target.fell_back,
        skipped_keys=skipped,
    )
    how = f"resharded {resharded} tensor(s) from {saved} to {req.layout} (fast path for {fast})"
    log.info("resumed %s: %s", target.url, how if resharded else f"fast path for all {fast} tensor(s) ({req.layout})")
    return info

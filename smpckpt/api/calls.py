"""smp's functions, as the thin face of a :class:`~smpckpt.Checkpointer`: :func:`save_checkpoint` and
:func:`resume_from_checkpoint` keep smp's parameters and a few of ours; every other option is a field of
an option object (``options=``).

Each call reuses the Checkpointer kept on ``model`` (an attribute that never enters a state_dict, copies or
pickles) when it was built from the same options, so staging buffers, planners, sequence counter and
lanes carry over; otherwise it builds a fresh one, waiting first for the one it replaces. Retention is no
such option (a save sets its own on the kept Checkpointer, a resume takes none). Keywords from before the
option objects still work for one release, with a ``DeprecationWarning`` (``_MOVED``).
"""

from __future__ import annotations

import concurrent.futures
import os
import types
import warnings
from collections.abc import Mapping
from typing import Any

from torch import nn

from smpckpt._checks import check_flag
from smpckpt.api._dist import DistContext
from smpckpt.api._save import PlannerCache
from smpckpt.api.checkpointer import Checkpointer, ResumeInfo, last_resume_info
from smpckpt.api.options import (
    AsyncOptions,
    ExportOptions,
    FastTier,
    Location,
    ResumeOptions,
    Retention,
    SaveOptions,
    Sharding,
)
from smpckpt.errors import CheckpointError
from smpckpt.model.layout import ParallelLayout, wrapped
from smpckpt.model.specs import SpecLike, SpecRules
from smpckpt.model.translation import Translation
from smpckpt.storage.backends._fs import location_key

__all__ = ["save_checkpoint", "resume_from_checkpoint", "last_resume_info", "ResumeInfo"]

#: a keyword the functions took before the option objects -> its home: (the class holding it in a partial
#: call, in a full one); ``None``: it does not apply to that mode
_MOVED: Mapping[str, tuple[type | None, type | None]] = types.MappingProxyType(
    {
        "storage_options": (Location, Location),
        "name_map": (Sharding, Sharding),
        "process_group": (Sharding, Sharding),
        **{name: (FastTier, None) for name in ("local_path", "replicas", "durable_every", "num_kept_local")},
        "remove_uncommitted_older_than": (Retention, None),
        **{name: (SaveOptions, None) for name in ("async_save", "wait_for_previous", "overwrite", "save_rng")},
        **{name: (SaveOptions, ExportOptions) for name in ("format", "sync_files", "freeze_gc", "verify_replicas")},
        **{name: (None, ExportOptions) for name in ("include_optimizer", "dtype", "hf_config", "max_shard_size")},
        **{
            name: (ResumeOptions, ResumeOptions)
            for name in ("missing_ok", "load_rng", "allow_pickle", "allow_dtype_cast", "verify_checksums", "keep_tied")
        },
    }
)
#: the moved keywords each function took
_SAVE_KEYWORDS = frozenset(n for n, (p, f) in _MOVED.items() if ResumeOptions not in (p, f))
_RESUME_KEYWORDS = frozenset({"storage_options", "name_map", "process_group", "local_path", "freeze_gc"}) | frozenset(
    n for n, (p, _) in _MOVED.items() if p is ResumeOptions
)
#: the option objects each function takes in ``options=`` (the call's own last)
_SAVE_OPTIONS = (Sharding, FastTier, Retention, AsyncOptions, SaveOptions, ExportOptions)
_RESUME_OPTIONS = (Sharding, FastTier, AsyncOptions, ResumeOptions)
#: the attribute of a model that keeps its Checkpointer; wrappers whose inner module (the attribute named) keeps it
_KEPT = "_smpckpt_checkpointer"


class _Kept:
    """A model's Checkpointer, as the smp face keeps it, with what it was built from (``key``: its options,
    the location however spelled); a copy or pickle of the model holds none."""

    __slots__ = ("checkpointer", "key")

    def __init__(self, checkpointer: Checkpointer | None = None, key: tuple[Any, ...] = ()) -> None:
        self.checkpointer, self.key = checkpointer, key

    def __copy__(self) -> _Kept:
        return _Kept()

    def __deepcopy__(self, memo: Any) -> _Kept:
        return _Kept()

    def __reduce__(self) -> tuple[type, tuple[()]]:
        # a plain object, not a _Kept: a pickled model must load where smpckpt is not installed (an
        # inference host); anything but a _Kept reads as "no Checkpointer kept"
        return (object, ())


def save_checkpoint(
    path: str | os.PathLike[str] | Location,
    tag: str,
    partial: bool = True,
    model: nn.Module | None = None,
    optimizer: Any = None,
    user_content: Any = None,
    num_kept_partial_checkpoints: int | None = None,
    translate_function: Translation | None = None,
    layout: ParallelLayout | None = None,
    specs: Mapping[str, SpecLike] | SpecRules | None = None,
    *,
    options: Any = None,
    **moved: Any,
) -> concurrent.futures.Future[None] | None:
    """smp's ``save_checkpoint``: :meth:`Checkpointer.save`, or, ``partial=False``, :meth:`Checkpointer.export`
    of the live state into ``{path}/{tag}/``. Every rank passes the same arguments.

    Args:
        path: the checkpoint root (a path or URL), or a :class:`Location`.
        num_kept_partial_checkpoints: :attr:`Retention.num_kept_partial_checkpoints` (accepted, and
            ignored, with ``partial=False``, as smp does).
        translate_function: ``partial=False`` only: :attr:`ExportOptions.translate_function`.
        layout, specs: the :class:`Sharding` (not with a ``Sharding`` in ``options``).
        options: an option object or a sequence of them, each class once.

    Returns ``None``, or a ``Future`` for an async save.
    """
    what = "save_checkpoint's arguments"
    ckpt, opts = _prepare(
        "save_checkpoint",
        path,
        model,
        partial,
        options,
        moved,
        {
            Sharding: _set(layout=layout, specs=specs),
            Retention: _set(num_kept_partial_checkpoints=num_kept_partial_checkpoints),
            ExportOptions if partial is False else None: _set(translate_function=translate_function),
        },
    )
    if partial:
        return ckpt._save(tag, model, optimizer, user_content, opts, what)
    ckpt._export(tag, None, model, optimizer, user_content, opts, what)
    return None


def resume_from_checkpoint(
    path: str | os.PathLike[str] | Location,
    tag: str | None = None,
    partial: bool = True,
    model: nn.Module | None = None,
    optimizer: Any = None,
    strict: bool = True,
    translate_function: Any = None,
    layout: ParallelLayout | None = None,
    specs: Mapping[str, SpecLike] | SpecRules | None = None,
    *,
    options: Any = None,
    **moved: Any,
) -> Any:
    """smp's ``resume_from_checkpoint``: :meth:`Checkpointer.resume` (``partial=False``: of the full artifact
    ``{path}/{tag}/``, or with ``tag=None`` ``path`` itself) into ``model`` and ``optimizer`` in place,
    resharding to ``layout``; returns ``user_content``. ``strict`` and ``translate_function`` are
    :class:`ResumeOptions`' (not with one in ``options``). What it did: :func:`last_resume_info`."""
    what = "resume_from_checkpoint's arguments"
    ckpt, opts = _prepare(
        "resume_from_checkpoint",
        path,
        model,
        partial,
        options,
        moved,
        {
            Sharding: _set(layout=layout, specs=specs),
            ResumeOptions: {
                **_set(translate_function=translate_function),
                **({} if strict is True else {"strict": strict}),
            },
        },
    )
    return ckpt._resume(tag, model, optimizer, opts, what)


def _set(**values: Any) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


def _fail_together(
    options: Any, moved: Mapping[str, Any], what: str, exc: Exception, saves: bool = False, model: Any = None
) -> None:
    """Arguments that failed their checks on this rank fail every rank, in the collective the others are in
    (``saves``: a partial save of ``model``: the others meet in its Checkpointer's join first)."""
    group = moved.get("process_group")
    for obj in options if isinstance(options, (list, tuple)) else (options,):
        group = obj.process_group if isinstance(obj, Sharding) else group
    try:
        ctx = DistContext(group)
    except TypeError:
        return  # not a process group: every rank fails alike, before any collective
    if ctx.active and ctx.world_size > 1:
        inner = wrapped(model)[-1]
        kept = inner.__dict__.get(_KEPT) if saves and isinstance(inner, nn.Module) else None
        # the others use it (a new one, or one over other ranks, rev67f F2: no join)
        if isinstance(kept, _Kept) and kept.checkpointer is not None and kept.checkpointer._groups.serves(group):
            try:
                kept.checkpointer._groups.join(ctx, kept.checkpointer.sharding.join_timeout, what)
            except Exception:  # noqa: BLE001 - the others are not in this save: this rank's own error alone
                return

        def failed() -> tuple[None, dict[str, Any]]:
            raise exc

        ctx.agreed(failed, what)


def _prepare(
    fn: str,
    path: Any,
    model: Any,
    partial: Any,
    options: Any,
    moved: Mapping[str, Any],
    keywords: dict[type | None, dict[str, Any]],
) -> tuple[Checkpointer, Any]:
    """(this rank, no collective) The Checkpointer for these arguments (the model's, or a fresh one kept on
    it) and the call's options. ``keywords``: the fields set by keyword, by class (``None``: not this mode)."""
    save = fn == "save_checkpoint"
    try:
        if save and partial is False and model is None:  # rev61h F2: the export's own refusal names out=, not ours
            raise ValueError(
                "save_checkpoint(partial=False) writes a full checkpoint of model=: pass it (a committed "
                "checkpoint is exported by `smpckpt consolidate` or Checkpointer.export(tag, out=...))"
            )
        check_flag("partial", partial)
        call = (SaveOptions if partial else ExportOptions) if save else ResumeOptions
        objects = _option_objects(options, _SAVE_OPTIONS if save else _RESUME_OPTIONS, call, partial)
        _route_keywords(fn, save, partial, moved, keywords)
        homes = {n: c.__name__ for c, fields in keywords.items() if c is not None for n in fields if n in moved}
        if Location in keywords:
            if isinstance(path, Location):
                raise ValueError("storage_options: pass them in the Location given as path, not as a keyword")
            path = Location(path, **keywords.pop(Location))
        built: dict[type, Any] = {}
        for cls in (Sharding, FastTier, Retention, AsyncOptions, call):
            kw = keywords.get(cls, {})
            if kw and cls in objects:
                raise ValueError(f"{', '.join(kw)}: pass options as keywords or as options=, not both")
            if cls is FastTier and kw and "local_path" not in kw:
                raise ValueError(f"{', '.join(kw)} apply only with local_path= (tiered checkpoints)")
            if cls is ResumeOptions and cls not in objects:
                kw = {**kw, "partial": partial}
            built[cls] = objects[cls] if cls in objects else cls(**kw) if kw or cls is call else None
        if not save and built[ResumeOptions].partial != partial:
            raise ValueError(
                f"partial={partial}{' (the default)' if partial else ''}, but options holds ResumeOptions(partial="
                f"{built[ResumeOptions].partial}): "
                + ("pass partial=False as well" if partial else "give it partial=False too (its default is True)")
            )
        location = path if isinstance(path, Location) else Location(path)
        if homes:
            shown = "; ".join(
                f"{n}= -> " + ("Location(path, storage_options=...) as path" if c == "Location" else f"{c}({n}=...)")
                for n, c in homes.items()
            )
            warnings.warn(
                f"{fn}'s keywords {', '.join(homes)} are deprecated: pass option objects in options= ({shown}); "
                "README, 'Coming from smp'",
                DeprecationWarning,
                stacklevel=3,
            )
        try:  # the location's identity (an s3:// without a bucket has none): a storage error, the location named
            where = (location_key(location.path, location.storage_options), location.storage_options)
        except OSError as exc:
            raise CheckpointError(f"{fn}: checkpoint location {location.path!r}: {type(exc).__name__}: {exc}") from exc
        return _checkpointer(model, location, where, built, save, save and partial is not False), built[call]
    except Exception as exc:  # failed on this rank: every rank fails, in the collective the others are in
        _fail_together(options, moved, f"{fn}'s arguments", exc, save and partial is not False, model)
        raise


def _checkpointer(
    model: Any, location: Location, where: tuple[Any, ...], built: dict[type, Any], save: bool, joins: bool = False
) -> Checkpointer:
    """The model's kept Checkpointer when it fits ``built``, else a fresh one, kept on the model (``joins``: a
    partial save, which meets in the kept one's join first, where a rank whose arguments failed waits for it)."""
    sharding, fast_tier, model = built[Sharding] or Sharding(), built[FastTier], wrapped(model)[-1]
    retention, async_options = built[Retention] or Retention(), built[AsyncOptions] or AsyncOptions()
    kept = model.__dict__.get(_KEPT) if isinstance(model, nn.Module) else None
    held, held_key = (kept.checkpointer, kept.key) if isinstance(kept, _Kept) else (None, ())
    if not save and built[AsyncOptions] is None and held is not None:
        async_options = held.async_options  # none given: they change nothing of a resume
    # no retention in the key: a save's is set on the kept Checkpointer below, a resume takes none
    key = (*where, sharding, fast_tier, async_options)
    # its gloo groups died with a process group destroyed since (an in-process restart): a new one (hunt69b F3)
    stale = held is not None and held._groups.stale()
    ckpt = held if held_key == key and not stale else None
    if ckpt is None and held is not None and not stale and held_key[:2] + held_key[3:] == (key[:2] + key[3:]):
        # only the sharding differs, often by identity alone (a name_map lambda written at the call)
        if _rebind_sharding(held, sharding):
            ckpt = held
            model.__dict__[_KEPT] = _Kept(ckpt, key)
    if ckpt is None:  # a new one in place of the one kept, which is waited for first; of the same root, it
        # carries its save numbers and a roll-back it resumed over
        if held is not None:
            try:
                held.wait()
            finally:  # a stale one may outlive this (a kept traceback holds it): its staging copy goes now (rev69g)
                held.free_staging_buffers() if stale else None
            if (
                joins and not stale and held._groups.serves(sharding.process_group)
            ):  # rev67d F1: else a hang (rev67f F2: same ranks)
                held._groups.join(
                    DistContext(held.sharding.process_group), held.sharding.join_timeout, "save_checkpoint"
                )
        ckpt = Checkpointer(location, sharding, fast_tier=fast_tier, retention=retention, async_options=async_options)
        if held is not None and (held._root_key, held_key[1]) == (ckpt._root_key, key[1]):  # a link's too
            ckpt._counter.adopt(held._counter)
            if ckpt._tier is not None and held._tier is not None:  # the history it goes on from (runs)
                ckpt._tier.state.adopt(held._tier.state)
        if isinstance(model, nn.Module):
            model.__dict__[_KEPT] = _Kept(ckpt, key)
    elif save and ckpt.retention != retention:
        ckpt.retention = retention  # the retention of the next saves, without a rebuild
        ckpt._compared = {**ckpt._compared, **retention.compared()}
    return ckpt


def _rebind_sharding(ckpt: Checkpointer, sharding: Sharding) -> bool:
    """Take ``sharding`` into ``ckpt`` when only what compares by identity differs (same process group and layout):
    a rebuild at every call would leave a gloo group, an exit hook and staging buffers behind. ``False``: it does
    not fit."""
    if sharding.process_group is not ckpt.sharding.process_group or sharding.join_timeout != ckpt.sharding.join_timeout:
        return False  # (a join_timeout other than the one its join group was made with: a rebuild)
    layout = sharding.layout if sharding.layout is not None else ParallelLayout(dp=ckpt._world)
    if layout != ckpt.layout:
        return False
    ckpt.wait()  # the save in flight used the old mapping; its failure is raised here, as a rebuild would
    ckpt.sharding = sharding
    ckpt._compared = {**ckpt._compared, **sharding.compared()}
    ckpt._planners = PlannerCache(ckpt._planners.workers)  # plans made under the old mapping are not reused
    return True


def _option_objects(options: Any, allowed: tuple[type, ...], call: type, partial: bool) -> dict[type, Any]:
    """``options=`` (one option object, a sequence of them, or ``None``) by class, each of ``allowed`` at
    most once, none that applies only to the other kind of checkpoint."""
    objects: dict[type, Any] = {}
    for obj in options if isinstance(options, (list, tuple)) else () if options is None else (options,):
        if type(obj) not in allowed:
            names = ", ".join(c.__name__ for c in allowed)
            raise TypeError(f"options must be a {names} or a sequence of them; got {type(obj).__name__}")
        if type(obj) in objects:
            raise ValueError(f"options holds two {type(obj).__name__}: pass each option object once")
        objects[type(obj)] = obj
    for cls in (SaveOptions, ExportOptions, FastTier):
        if cls in objects and cls is not call and (cls is not FastTier or not partial):
            kind = "full" if cls is ExportOptions else "partial"
            raise ValueError(f"{cls.__name__} applies only to {kind} checkpoints (partial={kind == 'partial'})")
    return objects


def _route_keywords(
    fn: str, save: bool, partial: bool, moved: Mapping[str, Any], keywords: dict[type | None, dict[str, Any]]
) -> None:
    """Each deprecated keyword in ``moved`` into ``keywords`` under the option class that now holds it;
    a keyword the function never took, or one that does not apply to this kind of checkpoint, refused."""
    unknown = sorted(set(moved) - (_SAVE_KEYWORDS if save else _RESUME_KEYWORDS))
    if unknown:
        raise TypeError(f"{fn}() got an unexpected keyword argument {unknown[0]!r}")
    for name, value in moved.items():
        home = _MOVED[name][0 if partial else 1]  # FastTier's are None in a full call: no fast tier there
        if not save and home in (SaveOptions, ExportOptions):
            home = ResumeOptions  # a resume's own options are all ResumeOptions'
        # the other mode's keyword at its default (a dataclass's class attribute; None where it has none, as
        # the old keywords had): nothing asked of this mode (as smp accepts it)
        if home is None and value == getattr(_MOVED[name][1 if partial else 0], name, None):
            continue
        keywords.setdefault(home, {})[name] = value
    wrong = list(keywords.pop(None, {}))
    if wrong:
        verb, kind = "applies" if len(wrong) == 1 else "apply", "full" if partial else "partial"
        raise ValueError(f"{', '.join(wrong)} {verb} only to {kind} checkpoints (partial={not partial})")

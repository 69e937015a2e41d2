"""What a Checkpointer's saves and resumes share (one module: a split would add one to each call's path,
``tests/test_call_paths.py``): the collectives, the request, and the state a save stores and a resume
restores.

The collectives (modelled on DCP's ``_DistWrapper``) run every step that can fail on some ranks through
:meth:`DistContext.all_ok` or :meth:`DistContext.on_coordinator`, so a failure on one rank is an error on
*every* rank, not a hang; without a process group each is the local call (rank 0 of a world of 1).

``user_content``: one ``torch.save`` record inside the checkpoint (an :class:`~smpckpt.planners.ObjectBuffer`: one copy),
checksummed and committed with the tensors; the manifest says whether it needs ``allow_pickle``
(:data:`PICKLED_KEY`), so a resume refuses it before the load. RNG states, per rank under ``rng.rank<r>.*``:
torch CPU, CUDA, ``random`` and NumPy's legacy generator, as weights-only-safe values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import pickle
import random
import sys
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import FrameType, MappingProxyType
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

import smpckpt.errors as _errors
from smpckpt._checks import check_process_group
from smpckpt.errors import LOADED_IN_PLACE, CheckpointCorrupt, CheckpointError, CheckpointNotFound, UnsafeCheckpoint
from smpckpt.model.layout import RESERVED, NameMap, ParallelLayout, wrap_name_map
from smpckpt.model.specs import SpecRules
from smpckpt.planners import ObjectBuffer, ObjectBytes
from smpckpt.storage.format._safe_pickle import record_file

__all__ = ["DistContext", "RankError", "digest", "OPTIONS", "CommonRequest", "check_state", "train_state"]
__all__ += ["encode_user_content", "decode_user_content", "describe_user_content", "refuse_pickled", "PICKLED_KEY"]
__all__ += ["get_rng_state", "set_rng_state", "RecordSlot"]


T = TypeVar("T")


# -- the collectives, and a failure on one rank made every rank's error ---------------------------------

# Builtin exception types re-raised as themselves on the other ranks (others become CheckpointError).
_BUILTINS: Mapping[str, type[Exception]] = MappingProxyType(
    {c.__name__: c for c in (ValueError, TypeError, KeyError, NotImplementedError, FileNotFoundError, PermissionError)}
    | {c.__name__: c for c in (OSError, RuntimeError)}
)


@dataclasses.dataclass(frozen=True)
class RankError:
    """A picklable description of one rank's failure (exceptions themselves may not pickle)."""

    rank: int
    type_name: str
    module: str
    message: str
    traceback: str

    @classmethod
    def capture(cls, rank: int, exc: BaseException) -> RankError:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(rank, type(exc).__name__, type(exc).__module__, str(exc), tb)

    def rebuild(self, others: int = 0) -> Exception:
        """The same smpckpt error class (or a whitelisted builtin) on a rank that did not fail itself."""
        more = f" (and {others} more rank(s) failed)" if others else ""
        text = f"rank {self.rank} failed: {self.message}{more}"
        cls: type[Exception] | None = None
        if self.module == _errors.__name__:
            found = getattr(_errors, self.type_name, None)
            if isinstance(found, type) and issubclass(found, CheckpointError):
                cls = found
        elif self.module == "builtins":
            cls = _BUILTINS.get(self.type_name)
        if cls is None:
            return CheckpointError(f"rank {self.rank} failed with {self.type_name}: {self.message}{more}")
        try:
            return cls(text)
        except TypeError:  # an exception class with a different constructor
            return CheckpointError(text)


def digest(values: Mapping[str, Any]) -> str:
    """One string for the values every rank must share (compared instead of the values themselves)."""
    return hashlib.blake2b(repr(sorted(values.items())).encode(), digest_size=16).hexdigest()


class DistContext:
    """This process's place in ``process_group`` (default: the default group), or a world of one."""

    def __init__(self, process_group: Any = None) -> None:
        check_process_group(process_group)
        self.pg = process_group
        self.active = dist.is_available() and dist.is_initialized()
        if self.active:
            self.rank = dist.get_rank(process_group)
            self.world_size = dist.get_world_size(process_group)
            self._src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        else:
            self.rank, self.world_size, self._src = 0, 1, 0

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    # -- raw collectives ---------------------------------------------------------------------------
    def all_gather_object(self, obj: T) -> list[T]:
        if not self.active or self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def broadcast_object(self, obj: T | None, src: int = 0) -> T:
        """Rank ``src``'s ``obj`` (group rank) on every rank (others pass anything, typically ``None``)."""
        if not self.active or self.world_size == 1:
            return obj  # type: ignore[return-value]
        box = [obj]
        source = self._src if src == 0 else dist.get_global_rank(self.pg, src) if self.pg is not None else src
        dist.broadcast_object_list(box, src=source, group=self.pg)
        return box[0]  # type: ignore[return-value]

    def _gather_step(self, step: str, obj: T) -> list[T]:
        """(all ranks) ``all_gather_object`` of ``obj``, labelled with ``step``: ranks given different
        arguments can meet in different steps; then every rank raises :class:`ValueError` naming them."""
        got = self.all_gather_object((step, obj))
        steps = [g[0] if isinstance(g, tuple) and len(g) == 2 else repr(g)[:60] for g in got]
        if any(s != step for s in steps):
            shown = ", ".join(f"rank {r}: {s}" for r, s in enumerate(steps[:8]))
            more = f", ... ({len(steps) - 8} more)" if len(steps) > 8 else ""
            raise ValueError(
                f"ranks reached different steps of one smpckpt call ({shown}{more}): they were called with "
                "different arguments (async_save, partial, tag, ...); every rank must pass the same ones"
            )
        return [g[1] for g in got]

    # -- failure-aware steps ---------------------------------------------------------------------
    def _agree(self, step: str, error: Exception | None, values: Any) -> list[Any]:
        """(all ranks) Gather every rank's failure and ``values`` of ``step``: a failure anywhere raises on
        every rank (the failing one its own ``error``, the others its class naming the rank)."""
        failure = RankError.capture(self.rank, error) if error is not None else None
        got = self._gather_step(step, (failure, values))
        failures = [f for f, _ in got if f is not None]
        if error is not None:
            raise error
        if failures:
            raise failures[0].rebuild(len(failures) - 1)
        return [v for _, v in got]

    def all_ok(self, fn: Callable[[], T]) -> T:
        """(all ranks) Run ``fn`` locally, then agree: if it raised anywhere, raise on every rank (:meth:`_agree`).
        ``fn`` runs one frame below this method (callers' warning ``stacklevel`` count on it)."""
        result: Any = None
        error: Exception | None = None
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error = exc
        self._agree("a checked step", error, None)
        return result

    def all_ok_values(self, fn: Callable[[], T]) -> list[T]:
        """(all ranks) :meth:`all_ok`, returning every rank's result (by group rank) in the same collective."""
        result: Any = None
        error: Exception | None = None
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error = exc
        return self._agree("a checked step", error, result)

    def on_coordinator(self, fn: Callable[[], T]) -> T:
        """(all ranks) Run ``fn`` on rank 0 only; its result, or its error, on every rank."""
        if not self.active or self.world_size == 1:
            return fn()
        payload: tuple[str, Any] | None = None
        error: Exception | None = None
        if self.is_coordinator:
            try:
                payload = ("ok", fn())
            except Exception as exc:  # noqa: BLE001 - broadcast to every rank below
                error, payload = exc, ("error", RankError.capture(self.rank, exc))
        status, value = self.broadcast_object(payload)
        if error is not None:
            raise error
        if status == "error":
            raise value.rebuild()
        return value

    def agreed(self, fn: Callable[[], tuple[T, Mapping[str, Any]]], what: str) -> T:
        """(all ranks) Run ``fn`` (local checks returning a result and the values every rank must share),
        then agree in one collective on a digest of those values: a failure anywhere raises on every rank;
        differing digests raise :class:`ValueError` on every rank naming each entry that differs."""
        result: Any = None
        values: dict[str, Any] = {}
        error: Exception | None = None
        try:
            result, shared = fn()
            values = dict(shared)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error = exc
        keys = self._agree(f"the comparison of {what}", error, digest(values))
        if len(set(keys)) == 1:
            return result
        seen = self.all_gather_object(values)
        names = sorted(set().union(*seen))
        differ = [k for k in names if any(v.get(k) != seen[0].get(k) for v in seen)]
        shown = "; ".join(
            f"{k}: " + ", ".join(f"rank {r}: {v.get(k)!r}" for r, v in enumerate(seen[:8])) for k in differ
        )
        more = f" ({len(seen) - 8} more ranks)" if len(seen) > 8 else ""
        raise ValueError(
            f"{what} differ between ranks in {', '.join(differ)} ({shown}{more}); every rank must pass the same"
        )


def translate_dcp(
    exc: CheckpointException, action: str, *, metadata_error: BaseException | None = None, group: Any = None
) -> BaseException:
    """DCP's ``CheckpointException`` (a BaseException) -> our error class of the first failed rank (raised
    ``from`` it); ``metadata_error``: the reader's own error, which DCP replaces with an ``AssertionError``.
    This rank's own Ctrl-C (any BaseException not an Exception; ``group``: DCP's) comes back as it is."""
    failures = exc.failures or {}
    own = failures.get(DistContext(group).rank, (None,))[0]
    if own is not None and not isinstance(own, Exception):
        return own
    if not failures:
        return CheckpointError(f"{action} failed: {exc}")
    ranks = sorted(failures)
    first = failures[ranks[0]][0]
    if isinstance(first, AssertionError) and metadata_error is not None:
        first = metadata_error
    where = f"rank {ranks[0]}" + (f" (and ranks {ranks[1:8]})" if len(ranks) > 1 else "")
    # The planners' refusals name their rank themselves: say it once.
    message = f"{action} failed on {where}: {str(first).removeprefix(f'rank {ranks[0]}: ')}"
    if isinstance(first, CheckpointError):
        try:
            return type(first)(message)
        except TypeError:
            return CheckpointError(message)
    if isinstance(first, FileNotFoundError):
        return CheckpointNotFound(message)
    return CheckpointError(f"{action} failed on {where}: {type(first).__name__}: {first}")


_PEER_FAILURE_MARKERS = ("gloo", "nccl", "connection reset", "connection closed", "broken pipe", "socket timeout")


@contextlib.contextmanager
def peer_failures(ctx: DistContext, action: str) -> Iterator[None]:
    """A collective failing because another rank died -> :class:`CheckpointError` naming this rank and the
    action; any other ``OSError`` (storage) -> :class:`CheckpointError` naming the action."""
    try:
        yield
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError(f"{action} failed: {type(exc).__name__}: {exc}") from exc
    except RuntimeError as exc:
        peer = isinstance(exc, getattr(torch.distributed, "DistError", ()))  # gloo's and nccl's, as torch types them
        peer = peer or any(marker in str(exc).lower() for marker in _PEER_FAILURE_MARKERS)
        if not ctx.active or ctx.world_size == 1 or not peer:
            raise
        text = str(exc).removesuffix(LOADED_IN_PLACE)  # a resume's note (its read had begun) ends the message
        # a hung peer (stopped, or a node gone without closing its connections) is a timeout, not a death (hunt69b F7)
        why = "did not answer within the group's timeout" if "timed out" in text.lower() else "died or was killed"
        raise CheckpointError(
            f"rank {ctx.rank} of {ctx.world_size}: {action} failed in a collective, most likely because another "
            f"rank {why} ({type(exc).__name__}: {text.splitlines()[0] if text else ''}); "
            f"what was committed before is intact -- check with `smpckpt ls`{str(exc)[len(text) :]}"
        ) from exc


@contextlib.contextmanager
def quiet_no_dist() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is exactly our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# -- the request and the state: what a save stores and a resume restores ------------------------------
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclasses.dataclass(frozen=True)
class CommonRequest:
    """What a save and a resume both need, validated: the base of their request types."""

    root: str
    model: nn.Module | None
    optimizers: tuple[torch.optim.Optimizer, ...]
    layout: ParallelLayout
    rules: SpecRules
    name_map: NameMap | None
    storage_options: Mapping[str, Any] | None
    process_group: Any
    held_by_some: tuple[str, ...]

    def planner_args(self) -> dict[str, Any]:
        return {
            "layout": self.layout,
            "specs": self.rules,
            "name_map": wrap_name_map(self.name_map),
            "process_group": self.process_group,
            "rank_local": RESERVED.rank_local,
            "held_by_some": self.held_by_some,
        }

    def fields(self) -> dict[str, Any]:
        """The common fields by name (shallow: models and optimizers are not copied)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(CommonRequest)}


def _fsdp_busy(model: nn.Module) -> tuple[list[str], bool]:
    """FSDP2 modules not IDLE (names, "the model" for the root), and whether their pass calls us now (a save
    from a hook: reading the state, or the reshard() below, frees the unsharded parameters the pass still
    uses, rev63i F3). The state alone is no proof: an exception escaping a pass leaves it FORWARD or
    PRE_BACKWARD for good (rev64a F2: an emergency save after it must go on), so a pass counts only with a
    module's call on this stack or a backward running. Private state, read leniently."""
    busy = []
    for name, module in model.named_modules():
        try:
            if hasattr(module, "_get_fsdp_state") and module._get_fsdp_state()._training_state.name != "IDLE":
                busy.append(name or "the model")
        except Exception:  # noqa: BLE001 - a module fully_shard left without state, another torch's fields
            continue
    if not busy or torch._C._current_autograd_node() is not None:
        return busy, bool(busy)
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:  # a forward (or its hook) of an FSDP2 module on this thread's stack
        if frame.f_code.co_name in ("_call_impl", "_wrapped_call_impl") and hasattr(
            frame.f_locals.get("self"), "_get_fsdp_state"
        ):
            return busy, True
        frame = frame.f_back
    return busy, False


def check_state(model: Any, optimizer: Any) -> tuple[nn.Module | None, tuple[torch.optim.Optimizer, ...]]:
    """(each call, every rank) The model and its optimizers (one, a sequence of them, or None), checked."""
    opts = tuple(optimizer) if isinstance(optimizer, Iterable) else () if optimizer is None else (optimizer,)
    if not all(isinstance(o, torch.optim.Optimizer) for o in opts):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or a sequence of them, got {type(optimizer).__name__}"
        )
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if model is None and opts:
        raise ValueError("optimizer state is keyed by the model's parameter names: pass model= with optimizer=")
    busy, running = _fsdp_busy(model) if model is not None else ([], False)
    if running:
        raise RuntimeError(
            f"{busy[0]} is inside an FSDP2 forward or backward: save or load a checkpoint outside the forward "
            "and backward (e.g. after optimizer.step()), not from a hook"
        )
    # DCP's get_state_dict fails with a bare `KeyError: 0` when an optimizer holds a parameter the model does
    # not own (an optimizer built over another model, or a parameter replaced after it)
    owned = {id(p) for p in model.parameters()} if model is not None and opts else set()
    if model is not None and any(id(p) not in owned for o in opts for g in o.param_groups for p in g["params"]):
        # FSDP2's root keeps a forward's unsharded parameters registered (an eval forward under no_grad): reshard()
        # registers the optimizer's sharded ones again, on this rank alone (rev63f F1: state_dict() is an FSDP1 collective)
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        owned = {id(p) for p in model.parameters()}
    held: dict[int, tuple[int, int]] = {}  # id(parameter) -> the first optimizer and param group holding it
    for i, opt in enumerate(opts):
        for g, group in enumerate(opt.param_groups):
            for j, p in enumerate(group["params"]):
                if id(p) not in owned and busy:  # reshard() declines mid-pass (a root not resharding after
                    # its forward, torch's default): the parameters the exception left unsharded stay (rev64d F1)
                    raise RuntimeError(
                        f"{busy[0]} was left inside an FSDP2 forward or backward by an exception (its parameters "
                        "unsharded): call reset_iter_state() on the root FSDP module (torch's recovery) first"
                    )
                if id(p) not in owned:
                    raise ValueError(
                        f"optimizer {i}, param_groups[{g}]['params'][{j}] (shape {list(p.shape)}, "
                        f"{p.dtype}) is not a parameter of the model: build the optimizer over "
                        "model.parameters() of the model you pass"
                    )
                k, h = held.setdefault(id(p), (i, g))  # one optimizer passed twice, a tie listed twice in one: one
                if opts[k] is not opt or h != g:  # DCP keys state and groups by name: theirs would overwrite
                    name, two = next(n for n, q in model.named_parameters() if q is p), f"optimizers {k} and {i}"
                    where = two if opts[k] is not opt else f"param_groups {h} and {g} of optimizer {i}"
                    raise ValueError(f"parameter {name!r} is in {where}: pass optimizers over disjoint parameters")
    return model, opts


def train_state(
    model: nn.Module | None,
    optimizers: tuple[torch.optim.Optimizer, ...],
    *,
    destinations: bool = False,
    group: Any = None,
) -> dict[str, Any]:
    """``{model: ..., optim: ...}`` through DCP's state_dict API (FQN-keyed optimizer state). DCP steps a fresh
    optimizer once at lr 0 to give it state: a resume (``destinations``) wants that; a save does not (it changed
    the run's next step), so it takes a fresh optimizer as it is (:func:`_taken_as_is`), and DDP's buffers
    (BatchNorm's statistics) as its next forward will, rank 0's: a collective on DDP's group, so only when every
    rank of it takes part in this save (over ``group``; a rank saving alone hung there, rev67d F4)."""
    if model is None:
        return {}
    ddp = getattr(model, "_orig_mod", model)  # torch.compile's wrapper around DDP, too
    if not destinations and isinstance(ddp, nn.parallel.DistributedDataParallel) and ddp._check_sync_bufs_pre_fwd():
        if group is None or set(dist.get_process_group_ranks(ddp.process_group)) <= set(
            dist.get_process_group_ranks(group)
        ):
            ddp._sync_buffers()  # its next forward's rank 0 buffers, not this rank's last batch's statistics (hunt67 F1)
    if not optimizers:
        return {RESERVED.model: get_model_state_dict(model, options=OPTIONS)}
    with contextlib.nullcontext() if destinations else _taken_as_is(optimizers):
        model_sd, optim_sd = get_state_dict(model, optimizers, options=OPTIONS)
    return {RESERVED.model: model_sd, RESERVED.optim: optim_sd}


@contextlib.contextmanager
def _taken_as_is(optimizers: tuple[torch.optim.Optimizer, ...]) -> Iterator[None]:
    """A zero gradient on the smallest parameter of each fresh optimizer, for the call, keeps DCP from stepping it."""
    lent: list[torch.Tensor] = []
    for opt in optimizers:
        params = [p for group in opt.param_groups for p in group["params"]]
        if opt.state or not params or any(p.grad is not None for p in params):
            continue
        smallest = min(params, key=lambda p: p.numel())
        smallest.grad = torch.zeros_like(smallest)
        lent.append(smallest)
    try:
        yield
    finally:
        for p in lent:
            p.grad = None


# -- user_content and RNG states: the rest of the state a save stores and a resume restores -----------


def encode_user_content(user_content: Any, *, stacklevel: int = 1) -> tuple[ObjectBuffer, bool]:
    """``(torch.save bytes, loads weights-only)``, the bytes in the buffer torch.save wrote (one copy of a large
    user_content, read in place after); a warning now, not at the resume, when it will not load
    weights-only (``stacklevel``: 1 is this function's caller)."""
    buf = ObjectBuffer()
    try:
        torch.save(user_content, buf)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise TypeError(f"user_content cannot be serialised with torch.save: {exc}") from exc
    weights_only = _loads_weights_only(buf)
    if not weights_only:
        warnings.warn(
            "user_content holds objects weights-only loading rejects; resuming it will need allow_pickle=True. "
            "Prefer dicts of tensors, numbers, strings and lists.",
            stacklevel=stacklevel + 1,
        )
    return buf, weights_only


PICKLED_KEY = "user_content_pickle"  #: the manifest's flag: user_content needs allow_pickle (absent: saved before it)


def refuse_pickled(pickled: bool, allow_pickle: bool, what: str) -> None:
    """(every rank alike) Refuse, before the load, a checkpoint whose user_content needs ``allow_pickle``."""
    if pickled and not allow_pickle:
        raise UnsafeCheckpoint(
            f"{what}: its user_content holds objects weights-only loading rejects (its save warned); nothing "
            "was loaded. Pass allow_pickle=True only if you trust this checkpoint"
        )


class RecordSlot(ObjectBytes):
    """A resume's user_content placeholder: the record comes back as the bytes read (no copy: fix68b)."""

    as_read = True


def describe_user_content(user_content: Any, pickled: bool) -> dict[str, Any]:
    """What the manifest records of ``user_content`` (``smpckpt inspect`` shows it without loading it)."""
    keys = [str(k) for k in user_content] if isinstance(user_content, Mapping) else None
    return {"user_content_type": type(user_content).__name__, "user_content_keys": keys, PICKLED_KEY: pickled}


def _loads_weights_only(buf: io.BytesIO) -> bool:
    """The resume's own check, run on the saved bytes (tensors land on ``meta``: no copy of their data)."""
    try:
        buf.seek(0)
        torch.load(buf, weights_only=True, map_location="meta")
    except pickle.UnpicklingError:
        return False
    except Exception:  # noqa: BLE001 - a tensor kind meta cannot hold: try it as the resume loads it
        try:
            buf.seek(0)
            torch.load(buf, weights_only=True, map_location="cpu")
        except pickle.UnpicklingError:
            return False
    return True


def decode_user_content(data: Any, *, allow_pickle: bool, nested: bool = False) -> Any:
    """The one deserialisation on resume; ``nested``: ``save_checkpoint/1`` records, pickled twice."""
    if data is None or (isinstance(data, (bytes, bytearray, memoryview)) and len(data) == 0):
        return None
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CheckpointCorrupt(f"user_content is stored as {type(data).__name__}, expected bytes")
    try:
        value = torch.load(record_file(data), weights_only=not allow_pickle, map_location="cpu")
        if nested:
            return decode_user_content(value, allow_pickle=allow_pickle)
        return value
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpoint(
            f"user_content needs arbitrary code to unpickle ({exc}); pass allow_pickle=True only if you trust "
            "this checkpoint"
        ) from exc


_np: Any
try:  # NumPy is optional
    import numpy as _np
except ImportError:  # pragma: no cover - depends on the environment
    _np = None


def get_rng_state() -> dict[str, Any]:
    """This process's generator states: ``{"torch": ..., "python": ..., ["numpy": ...], ["cuda": ...]}``."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": int(version), "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
    }
    if _np is not None:
        np_state = _np.random.get_state(legacy=False)
        state["numpy"] = {
            "bit_generator": str(np_state["bit_generator"]),
            "key": torch.from_numpy(np_state["state"]["key"].astype("int64")),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        }
    if torch.cuda.is_available():
        # a dict, not a list: DCP flattens dicts by key, and device indices stay explicit
        state["cuda"] = {str(i): s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    return state


def set_rng_state(state: Mapping[str, Any]) -> tuple[str, ...]:
    """Restore the generators in ``state`` (CUDA: visible devices); returns those restored."""
    restored: list[str] = []
    if "torch" in state:
        torch.set_rng_state(state["torch"].to(torch.uint8))
        restored.append("torch")
    if "python" in state:
        py = state["python"]
        random.setstate((int(py["version"]), tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
        restored.append("python")
    if "numpy" in state and _np is not None:
        np_state = state["numpy"]
        _np.random.set_state(
            {
                "bit_generator": np_state["bit_generator"],
                "state": {"key": np_state["key"].numpy().astype("uint32"), "pos": int(np_state["pos"])},
                "has_gauss": int(np_state["has_gauss"]),
                "gauss": float(np_state["gauss"]),
            }
        )
        restored.append("numpy")
    if "cuda" in state and torch.cuda.is_available():
        for index, s in state["cuda"].items():
            if int(index) < torch.cuda.device_count():
                torch.cuda.set_rng_state(s.to(torch.uint8), int(index))
        restored.append("cuda")
    return tuple(restored)

"""What a Checkpointer's saves and resumes share: the request both build, the model and optimizer
checked, state dicts, error translation. Internal: the public names live in :mod:`smpckpt.api.checkpointer`."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

from smpckpt.api._dist import DistContext
from smpckpt.errors import CheckpointError, CheckpointNotFound
from smpckpt.model.keys import RESERVED
from smpckpt.model.layout import ParallelLayout
from smpckpt.model.naming import NameMap
from smpckpt.model.specs import SpecLike, SpecRules

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

__all__ = ["OPTIONS", "CommonRequest", "check_state"]


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

    def planner_args(self) -> dict[str, Any]:
        """The layout arguments both planners take, as the API passes them."""
        return {
            "layout": self.layout,
            "specs": self.rules,
            "name_map": wrap_name_map(self.name_map),
            "process_group": self.process_group,
            "rank_local": RESERVED.rank_local,
        }

    def fields(self) -> dict[str, Any]:
        """The common fields by name (shallow: models and optimizers are not copied)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(CommonRequest)}


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
    # DCP's get_state_dict fails with a bare `KeyError: 0` when an optimizer holds a parameter the model does
    # not own (an optimizer built over another model, or a parameter replaced after it)
    owned = {id(p) for p in model.parameters()} if model is not None and opts else set()
    for i, opt in enumerate(opts):
        for g, group in enumerate(opt.param_groups):
            for j, p in enumerate(group["params"]):
                if id(p) not in owned:
                    raise ValueError(
                        f"optimizer {i}, param_groups[{g}]['params'][{j}] (shape {list(p.shape)}, "
                        f"{p.dtype}) is not a parameter of the model: build the optimizer over "
                        "model.parameters() of the model you pass"
                    )
    return model, opts


def wrap_name_map(name_map: NameMap | None) -> NameMap | None:
    """The user's map sees model/optimizer keys only; our own keys (rng, user_content) pass through."""
    if name_map is None:
        return None
    own = (f"{RESERVED.rng}.", RESERVED.user_content)

    def mapped(key: str) -> str:
        if key.startswith(own[0]) or key == own[1]:
            return key
        return name_map(key)

    return mapped


def spec_rules(specs: Mapping[str, SpecLike] | SpecRules | None) -> SpecRules:
    """The API's rules: each matches a stored key (``model.transformer.h.0.attn.qkv.weight``) or the
    model's own name for it (``transformer.h.0.attn.qkv.weight``, as ``tp_specs`` writes rules)."""
    if specs is not None and not isinstance(specs, (Mapping, SpecRules)):
        raise TypeError(f"specs must be a mapping of glob -> ShardSpec, got {type(specs).__name__}")
    return SpecRules.of(specs, also_under=(RESERVED.model,))


def train_state(model: nn.Module | None, optimizers: tuple[torch.optim.Optimizer, ...]) -> dict[str, Any]:
    """``{model: ..., optim: ...}`` (:data:`RESERVED`'s keys) through DCP's state_dict API (FQN-keyed
    optimizer state)."""
    if model is None:
        return {}
    if not optimizers:
        return {RESERVED.model: get_model_state_dict(model, options=OPTIONS)}
    model_sd, optim_sd = get_state_dict(model, optimizers, options=OPTIONS)
    return {RESERVED.model: model_sd, RESERVED.optim: optim_sd}


def translate_dcp(
    exc: CheckpointException, action: str, *, metadata_error: BaseException | None = None
) -> CheckpointError:
    """DCP's ``CheckpointException`` (a BaseException) -> our error class of the first failed rank.

    ``metadata_error`` is the reader's own exception from ``read_metadata``: DCP replaces it with an
    ``AssertionError("metadata is None; ...")``, and the caller deserves the real one
    (:class:`~smpckpt.errors.UnsafeCheckpoint`, :class:`~smpckpt.errors.CheckpointCorrupt`, ...).
    """
    failures = exc.failures or {}
    if not failures:
        err: CheckpointError = CheckpointError(f"{action} failed: {exc}")
    else:
        ranks = sorted(failures)
        first = failures[ranks[0]][0]
        if isinstance(first, AssertionError) and metadata_error is not None:
            first = metadata_error
        where = f"rank {ranks[0]}" + (f" (and ranks {ranks[1:8]})" if len(ranks) > 1 else "")
        message = f"{action} failed on {where}: {first}"
        if isinstance(first, CheckpointError):
            try:
                err = type(first)(message)
            except TypeError:
                err = CheckpointError(message)
        elif isinstance(first, FileNotFoundError):
            err = CheckpointNotFound(message)
        else:
            err = CheckpointError(f"{action} failed on {where}: {type(first).__name__}: {first}")
    err.__cause__ = exc
    return err


_PEER_FAILURE_MARKERS = ("gloo", "nccl", "connection reset", "connection closed", "broken pipe", "socket timeout")


def _is_peer_failure(exc: RuntimeError) -> bool:
    dist_error = getattr(torch.distributed, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    text = str(exc).lower()
    return any(marker in text for marker in _PEER_FAILURE_MARKERS)


@contextlib.contextmanager
def peer_failures(ctx: DistContext, action: str) -> Iterator[None]:
    """A collective that fails because another rank died (gloo: ``Connection reset by peer``; any
    ``DistBackendError``) -> :class:`CheckpointError` naming this rank and what it was doing; any other
    ``OSError`` (storage) -> :class:`CheckpointError` naming the action and, in its text, the object."""
    try:
        yield
    except CheckpointError:
        raise
    except OSError as exc:
        # an I/O error outside dcp.save/dcp.load (listing tags, reading newest, a probe) reaches the
        # caller as ours too, its object named (an S3 endpoint that died mid-resume gave a bare OSError)
        raise CheckpointError(f"{action} failed: {type(exc).__name__}: {exc}") from exc
    except RuntimeError as exc:
        if not ctx.active or ctx.world_size == 1 or not _is_peer_failure(exc):
            raise
        raise CheckpointError(
            f"rank {ctx.rank} of {ctx.world_size}: {action} failed in a collective, most likely because another "
            f"rank died or was killed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            "what was committed before is intact -- check with `smpckpt ls`"
        ) from exc


@contextlib.contextmanager
def quiet_no_dist() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is exactly our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield

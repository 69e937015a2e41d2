"""Collective helpers for the API layer that also work with no process group (world of one).

Modelled on DCP's ``_DistWrapper``: every step that can fail on some ranks runs through
:meth:`DistContext.all_ok` or :meth:`DistContext.on_coordinator`, which exchange an ok/error record so a
failure on one rank becomes an error on *every* rank instead of a hang at the next collective.

Without an initialised process group (a notebook, a conversion script) every method degenerates to
the local call: rank 0 of a world of 1, no communication.
"""

from __future__ import annotations

import dataclasses
import hashlib
import traceback
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

import torch.distributed as dist

import smpckpt.errors as _errors
from smpckpt._checks import check_process_group
from smpckpt.errors import CheckpointError

__all__ = ["DistContext", "RankError", "digest"]

T = TypeVar("T")

# Builtin exception types re-raised as themselves on the other ranks (others become CheckpointError).
_BUILTINS: Mapping[str, type[Exception]] = MappingProxyType(
    {
        cls.__name__: cls
        for cls in (
            ValueError,
            TypeError,
            KeyError,
            NotImplementedError,
            FileNotFoundError,
            PermissionError,
            OSError,
            RuntimeError,
        )
    }
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
    """This process's place in ``process_group`` (the default group when ``None``), or a world of one.

    Attributes: ``active`` (a process group is initialised), ``rank`` / ``world_size`` (in the group),
    ``is_coordinator`` (group rank 0, the only rank that reads ``newest``, lists tags, writes
    ``newest`` and applies retention).
    """

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
        """Rank ``src``'s ``obj`` (group rank; default 0) on every rank (others pass anything, typically
        ``None``)."""
        if not self.active or self.world_size == 1:
            return obj  # type: ignore[return-value]
        box = [obj]
        source = self._src if src == 0 else dist.get_global_rank(self.pg, src) if self.pg is not None else src
        dist.broadcast_object_list(box, src=source, group=self.pg)
        return box[0]  # type: ignore[return-value]

    def _gather_step(self, step: str, obj: T) -> list[T]:
        """(all ranks) ``all_gather_object`` of ``obj``, labelled with ``step``. Ranks given different
        arguments can take different paths (``async_save`` on some ranks: one step more) and meet in
        different steps; unlabelled, one step would read the other's payload as its own and fail
        obscurely. Then every rank raises :class:`ValueError` naming the steps the ranks were in."""
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
        """(all ranks) Gather every rank's failure (``error``) and ``values`` of ``step``: if a step raised
        anywhere, raise on every rank -- the failing rank its own ``error`` (original traceback), the
        others the same smpckpt error class naming the failed rank. Every rank's values."""
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
        """(all ranks) Run ``fn`` on rank 0 only and return its result on every rank, or raise its
        error on every rank."""
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
        """(all ranks) Run ``fn`` -- local checks that return a result and the values every rank must
        share -- then agree in one collective on a digest of those values: if ``fn`` raised anywhere,
        raise on every rank (as :meth:`all_ok`); else, unless all ranks' digests are equal, gather the values
        themselves and raise :class:`ValueError` on every rank naming each entry that differs and its
        value on the first ranks. A check that fails on one rank only (a bad option there) fails every rank
        instead of leaving the others in the next collective."""
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

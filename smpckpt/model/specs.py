"""Shard specs: how a plain local tensor is a piece of a global tensor (:class:`ShardSpec`), and the glob
rules attaching them to keys (:class:`SpecRules`; the README's "Spec rules" and "How rules meet keys").

The pairing of optimizer state with its own parameter lives here too, beside the rules it feeds: which parameter a
state key belongs to, under a user's ``name_map`` as well (:func:`state_params`, :func:`nested_state`), and whether a
parameter's missing state is state it never had when saved (:func:`stateless_when_saved`). A map may rename anything:
move ``model.``/``optim.``, add a suffix (``k + ".v1"``), rename state names (``.exp_avg`` -> ``.m``); so these are
judged on the destination's names (before the map) beside the checkpoint keys read for them, never by parsing the
checkpoint's names, which may name another parameter or carry dotted parts a hyper-parameter's name would pass for
(rev72p, rev73a). (Here rather than a module of their own: every resume that misses a parameter's state, a frozen or
never-routed one, asks :func:`stateless_when_saved`, and one more module would put it past 25 on its call path.)"""

from __future__ import annotations

import bisect
import dataclasses
import fnmatch
import functools
import itertools
import math
import operator
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, Union

import torch

from smpckpt.errors import SpecError
from smpckpt.model.layout import OPTIM_STATE_PREFIX, RESERVED, RankCoords

__all__ = ["ShardSpec", "SpecRules", "SpecLike", "ShardGeometry", "shard_geometry", "OPTIMIZER_STATE_PREFIXES"]
__all__ += ["spec_rules", "state_params", "nested_state", "stateless_when_saved"]

#: Key prefixes under which torch's FQN-keyed optimizer state lives (``get_state_dict`` with
#: ``flatten_optimizer_state_dict=True`` gives ``optim.state.<param>.<name>``). A key under one of
#: these inherits the spec of the parameter named after the prefix.
OPTIMIZER_STATE_PREFIXES = (OPTIM_STATE_PREFIX, "optimizer.state.", "state.")


_UNKNOWN: Any = object()  # a cache's "not looked up yet" (None is a result: no rule matches)


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """How a local tensor is one rank's piece of a global tensor.

    Args:
        dim: the sharded dimension, indexing ``view`` when given, else the local tensor's shape.
        axis: the parallel axis the tensor is split over: ``"tp"`` (tensor parallel) or ``"dp"``
            (ZeRO-style sharded optimizer state).
        view: the shape the local tensor is viewed as before sharding applies, e.g. a fused QKV
            weight stored as ``[3*h/tp, d]`` declared as ``[3, h/tp, d]`` with ``dim=1``. The
            checkpoint stores the tensor under its global *view* shape (``[3, h, d]``), so q, k and v
            rows reshard correctly under any TP degree. One ``-1`` is allowed.
        sizes: every rank's extent along ``dim`` in the current layout, one entry per rank of
            ``axis`` (uneven splits, vocabulary padding). ``None`` means an even split."""

    dim: int
    axis: str = "tp"
    view: tuple[int, ...] | None = None
    sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.axis not in ("tp", "dp"):
            raise SpecError(f"ShardSpec.axis must be 'tp' or 'dp', got {self.axis!r}")
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise SpecError(f"ShardSpec.dim must be an int, got {self.dim!r}")
        if self.view is not None:
            view = _extents("view", self.view)
            if sum(1 for v in view if v == -1) > 1 or any(v < -1 for v in view):
                raise SpecError(f"ShardSpec.view {view} may hold at most one -1 and no other negatives")
            object.__setattr__(self, "view", view)
        if self.sizes is not None:
            sizes = _extents("sizes", self.sizes)
            if not sizes or any(s < 0 for s in sizes):
                raise SpecError(f"ShardSpec.sizes must be non-negative extents, got {self.sizes!r}")
            object.__setattr__(self, "sizes", sizes)

    @functools.cached_property
    def _starts(self) -> tuple[int, ...]:
        """Offsets of every rank's piece along ``dim`` plus the total (``sizes`` given): computed once
        per spec, so placing one rank's piece costs O(1) however many ranks the axis has."""
        return (0, *itertools.accumulate(self.sizes or ()))


def _extents(name: str, values: Any) -> tuple[int, ...]:
    """``ShardSpec.view``/``sizes`` as ints: int() truncated 2.5 and read the string "12" as (1, 2) (hunt73c F3)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise SpecError(f"ShardSpec.{name} must be a sequence of ints, got {values!r}")
    out = tuple(values)
    try:  # operator.index: ints of any kind (numpy's too), never a float
        if any(isinstance(v, bool) for v in out):
            raise TypeError("a bool")
        return tuple(operator.index(v) for v in out)
    except TypeError:
        raise SpecError(f"ShardSpec.{name} must hold ints (not bools or floats), got {values!r}") from None


#: A rule's value: one spec, or several (outermost split first) for a tensor split over TP and DP.
SpecLike = Union[ShardSpec, Sequence[ShardSpec]]


def _as_tuple(spec: SpecLike, pattern: str = "?") -> tuple[ShardSpec, ...]:
    if isinstance(spec, ShardSpec):
        specs: tuple[Any, ...] = (spec,)
    elif isinstance(spec, (list, tuple)):
        specs = tuple(spec)
    else:
        specs = ()
    if not specs or not all(isinstance(s, ShardSpec) for s in specs):
        raise SpecError(
            f"spec rule {pattern!r}: needs a ShardSpec or a tuple of them (outermost first), got "
            f"{type(spec).__name__} {spec!r}"
        )
    if len({s.axis for s in specs}) != len(specs):
        raise SpecError(f"a tensor can be split once per axis; got {specs}")
    views = {s.view for s in specs if s.view is not None}
    if len(views) > 1:
        raise SpecError(f"specs combined on one tensor must agree on view; got {sorted(views)}")
    return specs


class SpecRules:
    """Ordered glob rules mapping flattened keys to shard specs; first match wins.

    Patterns use :mod:`fnmatch` syntax (``*`` also crosses dots). A key under an optimizer-state
    prefix (``optim.state.<param>.<name>``) that matches no rule itself inherits ``<param>``'s spec.

    Args:
        rules: glob -> spec (or tuple of specs, outermost first), in the order they are tried.
        also_under: top-level names (``("model",)``, as :func:`smpckpt.save_checkpoint` and
            :func:`smpckpt.resume_from_checkpoint` pass) under which every rule also matches, so rules
            written against the model's own names (``tp_specs``) match ``model.<name>``; each rule tries
            the key as given, then under each name, before the next rule is tried."""

    def __init__(self, rules: Mapping[str, SpecLike] | None = None, *, also_under: Sequence[str] = ()) -> None:
        self._rules: list[tuple[str, re.Pattern[str], tuple[ShardSpec, ...]]] = []
        self.also_under: tuple[str, ...] = tuple(also_under)
        for name in self.also_under:
            if not isinstance(name, str) or not name or "." in name:
                raise SpecError(f"also_under names are top-level keys without dots, got {name!r}")
        for pattern, spec in (rules or {}).items():
            if not isinstance(pattern, str):
                raise SpecError(f"spec rule keys are glob strings, got {type(pattern).__name__} {pattern!r}")
            glob = fnmatch.translate(pattern)
            alternatives = [glob, *(re.escape(name + ".") + glob for name in self.also_under)]
            self._rules.append((pattern, re.compile("|".join(alternatives)), _as_tuple(spec, pattern)))
        # Every rank resolves every key at every save: one regex over all rules instead of one per rule.
        # Each rule is a named alternative, tried in order, so the first rule matching wins as before;
        # its group encloses any the glob makes, so it is the match's last closed group (``lastgroup``).
        self._any = (
            re.compile("|".join(f"(?P<_r{i}>{rx.pattern})" for i, (_, rx, _) in enumerate(self._rules)))
            if self._rules
            else None
        )
        self._by_group = {f"_r{i}": specs for i, (_, _, specs) in enumerate(self._rules)}
        self._cache: dict[tuple[str, tuple[str, ...]], tuple[tuple[ShardSpec, ...], str | None] | None] = {}
        # a parameter's own match, looked up again by each of its optimizer-state keys
        self._direct: dict[str, tuple[ShardSpec, ...] | None] = {}

    @classmethod
    def of(cls, rules: Mapping[str, SpecLike] | SpecRules | None, *, also_under: Sequence[str] = ()) -> SpecRules:
        """``rules`` as :class:`SpecRules`. Equal rule mappings share one instance, and with it the
        per-key match caches, so planners built afresh for every save match each key once per process
        (``benchmarks/RESULTS.md``). Given a :class:`SpecRules`, ``also_under`` names are added to its own."""
        also = tuple(also_under)
        if isinstance(rules, SpecRules):
            if all(name in rules.also_under for name in also):
                return rules
            also = rules.also_under + tuple(n for n in also if n not in rules.also_under)
            rules = {p: s for p, _, s in rules._rules}
        items = tuple((rules or {}).items())
        try:
            hash(items)
        except TypeError:  # a list of specs: not shared (rare; correct either way)
            return cls(rules, also_under=also)
        return _shared_rules(items, also)

    def __bool__(self) -> bool:
        return bool(self._rules)

    def __repr__(self) -> str:
        also = f", also_under={self.also_under}" if self.also_under else ""
        return f"SpecRules({ {p: s for p, _, s in self._rules} }{also})"

    def match(
        self,
        key: str,
        prefixes: Iterable[str] = (),
        local_key: str | None = None,
        to_global: Callable[[str], str] | None = None,
        param: str | None = None,
    ) -> tuple[tuple[ShardSpec, ...], str | None] | None:
        """Specs for ``key`` (a flattened, global key), or ``None`` when it is replicated.

        Returns ``(specs, inherited_from)``: ``inherited_from`` is the parameter key whose spec an
        optimizer-state key inherited, else ``None``. ``prefixes`` are the top-level names under
        which parameters live in the same state dict (``"model"``), tried in front of the parameter
        name an optimizer key carries (``optim.state.layers.0.w.exp_avg`` -> ``model.layers.0.w``).
        Under a name map (``to_global``, the key's name before it ``local_key``) such a key is also
        recognised by its local name, its parameter's key mapped alike (a map may move ``optim.``, rev72l M3).
        ``param``: the global key of the optimizer-state key's own parameter where the state dict holds it (under a
        name map, :func:`state_params`): inherited from it alone, matched as that parameter is."""
        prefixes = prefixes if isinstance(prefixes, tuple) else tuple(prefixes)
        if param is not None:
            # its own parameter, found by the destination's names (:func:`state_params`): the global key's pairing
            # may name another one (a map moving `model.` and not `optim.`, rev72q), and names before the map tried
            # as global ones meet bare rules of another parameter or a strict map's KeyError (rev72r)
            if (direct := self._match_direct(key)) is not None:
                return direct, None
            own = self._match_direct(param)
            return None if own is None else (own, param)
        found = self._match(key, prefixes)
        if found is None and to_global is not None and local_key is not None and self._rules:
            param = _optimizer_param(local_key)
            for candidate in () if param is None else (param, *(f"{p}.{param}" for p in prefixes)):
                if (inherited := self._match_direct(mapped := to_global(candidate))) is not None:
                    return inherited, mapped
        return found

    def _match(self, key: str, prefixes: tuple[str, ...]) -> tuple[tuple[ShardSpec, ...], str | None] | None:
        cache_key = (key, prefixes)
        found = self._cache.get(cache_key, _UNKNOWN)
        if found is not _UNKNOWN:
            return found
        direct = self._match_direct(key)
        if direct is not None:
            found = (direct, None)
        else:
            found = None
            param = _optimizer_param(key) if key.startswith(OPTIMIZER_STATE_PREFIXES) else None
            if param is not None:
                for candidate in (param, *(f"{p}.{param}" for p in prefixes)):
                    inherited = self._match_direct(candidate)
                    if inherited is not None:
                        found = (inherited, candidate)
                        break
        self._cache[cache_key] = found
        return found

    def _match_direct(self, key: str) -> tuple[ShardSpec, ...] | None:
        known = self._direct.get(key, _UNKNOWN)
        if known is not _UNKNOWN:
            return known
        m = self._any.fullmatch(key) if self._any is not None else None
        found = self._by_group[m.lastgroup] if m is not None and m.lastgroup is not None else None
        self._direct[key] = found
        return found

    def check_matched(self, matched: bool) -> None:
        """(save coordinator) Rules of which no rank ``matched`` a single key are a mistake, never a choice:
        every TP shard they were meant for would be saved as a replica -- one rank's piece kept as the
        whole tensor (rules written for another key scheme, such as a missing ``model.`` prefix)."""
        if not self._rules or matched:
            return
        shown = ", ".join(repr(p) for p, _, _ in self._rules[:5])
        more = f" (and {len(self._rules) - 5} more)" if len(self._rules) > 5 else ""
        raise SpecError(
            f"none of the {len(self._rules)} spec rules matches a tensor of any rank: {shown}{more}. Rules are "
            "matched against the flattened keys (for save_checkpoint: 'model.<parameter name>' or the parameter "
            "name itself; 'optim.state.<parameter name>.<state>') of plain tensors: DTensors (fully_shard, "
            "parallelize_module) carry their placements and are never matched; a rule that matches nothing would "
            "save every TP shard it was meant for as a replica"
        )

    def to_records(self) -> list[dict[str, Any]]:
        """JSON-able description of the rules, for the checkpoint's record of the partition."""
        also = {"also_under": list(self.also_under)} if self.also_under else {}
        return [{"pattern": p, "specs": [dataclasses.asdict(s) for s in specs], **also} for p, _, specs in self._rules]


@functools.lru_cache(maxsize=16)
def _shared_rules(items: tuple[tuple[str, SpecLike], ...], also_under: tuple[str, ...] = ()) -> SpecRules:
    return SpecRules(dict(items), also_under=also_under)


def state_params(
    local_keys: Collection[str], tops: Sequence[str], nested_only: bool = False
) -> dict[str, tuple[str, str]]:
    """Each optimizer-state key of ``local_keys`` (a state dict's own names, before any name map) -> (its parameter's
    FQN, that parameter's key in ``local_keys``: ``<fqn>`` or ``<top>.<fqn>``, ``tops`` tried in order). The state's
    parameter is the longest FQN in front of its last name (``layer.1`` and ``layer.1.x`` may both be parameters)
    that is a key here; a state key whose parameter is not here is left out. Judged once on the destination's
    names: through a map the keys read may name another parameter, or add dotted parts (``k + ".v1"``) a
    hyper-parameter's name would pass for a parameter's under (rev72p, rev72q). ``nested_only``: (without a map) the
    keys whose parameter is not the FQN in front of their last name alone, :func:`nested_state`'s, found cheaply."""
    out: dict[str, tuple[str, str]] = {}
    for key in local_keys:
        if not key.startswith(OPTIMIZER_STATE_PREFIXES):
            continue
        prefix = next(p for p in OPTIMIZER_STATE_PREFIXES if key.startswith(p))
        if nested_only and _first_is_param(key[len(prefix) :].rpartition(".")[0], local_keys, tops):
            continue
        parts = key[len(prefix) :].split(".")
        for i in range(len(parts) - 1, 0, -1):
            fqn = ".".join(parts[:i])
            candidates = (fqn, *(f"{t}.{fqn}" for t in tops))
            at = next((c for c in candidates if c in local_keys and not c.startswith(OPTIMIZER_STATE_PREFIXES)), None)
            if at is not None:
                out[key] = (fqn, at)
                break
    return out


def _first_is_param(head: str, local_keys: Collection[str], tops: Sequence[str]) -> bool:
    """Whether ``head`` (a state key's names in front of its last) is a parameter's key here, as :func:`state_params`'s
    first candidate: without a map such a key keeps its pairing by rules (a lookup or two, where the loop costs more)."""
    candidates = (head, *(f"{t}.{head}" for t in tops))
    return any(c in local_keys and not c.startswith(OPTIMIZER_STATE_PREFIXES) for c in candidates)


def nested_state(key: str, fqn: str) -> bool:
    """Whether optimizer-state ``key`` of the parameter ``fqn`` (:func:`state_params`) is nested (``<fqn>.nest.a``).
    Without a map such a key is paired with its parameter this way only: by its front names (``w.nest``), which name
    no parameter, a TP-sharded parameter's nested state was refused as a replica while an identity map saved it
    (rev73a 3); other keys keep the pairing by their front names (:meth:`SpecRules.match`), as before."""
    return key.rpartition(".")[0][-len(fqn) - 1 :] != "." + fqn


def _optimizer_param(key: str) -> str | None:
    for prefix in OPTIMIZER_STATE_PREFIXES:
        if key.startswith(prefix):
            rest = key[len(prefix) :]
            head, sep, _name = rest.rpartition(".")
            return head if sep else None
    return None


@dataclasses.dataclass(frozen=True)
class ShardGeometry:
    """Where one rank's piece sits in the global tensor (all in *view* coordinates)."""

    view_shape: torch.Size  #: shape of the local tensor as viewed (== local shape without a view)
    global_shape: torch.Size  #: shape the checkpoint stores
    offsets: torch.Size  #: offset of the local piece in the global tensor
    sharded_axes: frozenset[str]  #: axes the tensor is split over (its replicas differ along the rest)


def _resolve_view(view: tuple[int, ...], numel: int, key: str, shape: torch.Size) -> torch.Size:
    known = math.prod(v for v in view if v != -1)
    if -1 in view:
        if known == 0 or numel % known:
            raise SpecError(f"{key}: local shape {tuple(shape)} cannot be viewed as {view}")
        view = tuple(numel // known if v == -1 else v for v in view)
    if math.prod(view) != numel:
        raise SpecError(
            f"{key}: local shape {tuple(shape)} ({numel} elements) cannot be viewed as {view} "
            f"({math.prod(view)} elements)"
        )
    return torch.Size(view)


def shard_geometry(
    key: str,
    local_shape: Sequence[int],
    specs: Iterable[ShardSpec],
    coords: RankCoords,
    degrees: Mapping[str, int],
) -> ShardGeometry:
    """Global shape and offsets of this rank's local tensor under ``specs`` (given outermost first,
    applied innermost first, each growing the extent along its dim to the enclosing level's piece)."""
    specs = _as_tuple(tuple(specs))
    shape = torch.Size(local_shape)
    view = next((s.view for s in specs if s.view is not None), None)
    view_shape = _resolve_view(view, math.prod(shape), key, shape) if view is not None else shape
    extents = list(view_shape)
    offsets = [0] * len(extents)
    for spec in reversed(specs):
        ndim = len(extents)
        if not -ndim <= spec.dim < ndim:
            raise SpecError(f"{key}: spec dim {spec.dim} is out of range for shape {tuple(view_shape)}")
        dim = spec.dim % ndim
        degree = degrees[spec.axis]
        axis_rank = getattr(coords, spec.axis)
        local_extent = extents[dim]
        if spec.sizes is None:
            offsets[dim] += axis_rank * local_extent
            extents[dim] = local_extent * degree
        else:
            if len(spec.sizes) != degree:
                raise SpecError(
                    f"{key}: spec sizes {spec.sizes} has {len(spec.sizes)} entries but the {spec.axis} "
                    f"degree is {degree}"
                )
            if spec.sizes[axis_rank] != local_extent:
                raise SpecError(
                    f"{key}: {spec.axis} rank {axis_rank} holds extent {local_extent} along dim {dim} "
                    f"(shape {tuple(view_shape)}) but the spec's sizes say {spec.sizes[axis_rank]}"
                )
            offsets[dim] += spec._starts[axis_rank]
            extents[dim] = spec._starts[-1]
    return ShardGeometry(
        view_shape=view_shape,
        global_shape=torch.Size(extents),
        offsets=torch.Size(offsets),
        sharded_axes=frozenset(s.axis for s in specs),
    )


def spec_rules(specs: Mapping[str, SpecLike] | SpecRules | None) -> SpecRules:
    """The API's rules: each matches a stored key (``model.h.0.qkv.weight``) or the model's own name for it."""
    if specs is not None and not isinstance(specs, (Mapping, SpecRules)):
        raise TypeError(f"specs must be a mapping of glob -> ShardSpec, got {type(specs).__name__}")
    return SpecRules.of(specs, also_under=(RESERVED.model,))


def stateless_when_saved(
    missing: Sequence[str],
    keys: Mapping[str, str],
    saved: Sequence[str],
    owners: Mapping[str, str] = {},
    name_map: Callable[[str], str] | None = None,
) -> list[str]:
    """The ``missing`` keys that are optimizer state of a parameter the checkpoint holds param groups
    but no state at all for: it had none when saved (no gradient yet: an unused branch, an expert
    never routed to), so a strict resume is right to leave it without, not to refuse. Judged on the
    destination's side alone (rev72p): keys are its own (``optim.state.<fqn>.<name>``, before any name_map),
    each key's parameter ``owners``' FQN (the spec's pairing, ``specs.state_params``) or else the longest FQN
    in front among its param groups' keys; ``keys``: each destination key -> the checkpoint key read for it
    (a map may move either prefix and add a suffix, fix72j, fix72m); ``saved``: the checkpoint's keys, sorted.
    The parameter's saved state is looked for under the key read up to where the key's ``.<name>`` is in it
    (:func:`_read_prefix`; else :func:`_probed_prefix`, rev73a); neither: never judged stateless (refused)."""
    state, groups = OPTIM_STATE_PREFIX, f"{RESERVED.optim}.param_groups."

    def has(key: str) -> bool:
        i = bisect.bisect_left(saved, key)
        return i < len(saved) and saved[i] == key

    # the parameters whose param groups the checkpoint holds, of those a missing key may be state of (rev72l
    # L2: a bisect for each of them alone); hyper-parameter names hold no dots: in the destination's names
    # (never the checkpoint's, which a map may have given dotted suffixes, rev72p) what is in front of the
    # last one is the parameter's FQN
    maybe: set[str] = set()
    for parts in (k[len(state) :].split(".") for k in missing if k.startswith(state)):
        maybe.update(".".join(parts[:i]) for i in range(1, len(parts)))
    held = {
        f
        for k, r in keys.items()
        if k.startswith(groups) and (f := k[len(groups) :].rpartition(".")[0]) in maybe and has(r)
    }
    out = []
    for key in missing:
        if not key.startswith(state):
            continue
        fqn = owners.get(key) or RESERVED.state_owner(key[len(state) :], held)
        if fqn is not None and fqn in held:
            tail = key[len(state) + len(fqn) :]  # ".<name>[.<inner>]"
            prefix = _read_prefix(read := keys.get(key, key), tail)
            if prefix is None and name_map is not None:
                prefix = _probed_prefix(name_map, key[: len(state) + len(fqn)], read)
            if prefix is not None:
                i = bisect.bisect_left(saved, prefix)
                if i == len(saved) or not saved[i].startswith(prefix):
                    out.append(key)
    return out


def _read_prefix(read: str, tail: str) -> str | None:
    """The part of ``read`` (a checkpoint key) in front of ``tail`` (a state key's ``.<name>``), and a dot: where a map
    put that parameter's state. Its first place followed by no name character (its end, or a suffix: ``.v1``, ``@v1``):
    a name also in the map's own part gives a shorter prefix (refused, never skipped; state ``v1``, rev73a)."""
    i = read.find(tail)
    while i >= 0:
        after = read[i + len(tail) : i + len(tail) + 1]
        if not (after.isalnum() or after == "_"):
            return read[:i] + "."
        i = read.find(tail, i + 1)
    return None


def _probed_prefix(name_map: Callable[[str], str], at: str, read: str) -> str | None:
    """Where a map renaming state names (``.exp_avg`` -> ``.m``) puts the state of the parameter at ``at``: a probe
    ``<at>.\\x00`` mapped, up to that (as ``_saved_state_keys``), if ``read`` is under it too; else ``None``: refused."""
    try:
        probe = name_map(at + ".\x00")
    except LookupError:  # a strict map (a dict's)
        return None
    return pre if (pre := probe[: probe.find(".\x00") + 1]) and read.startswith(pre) else None

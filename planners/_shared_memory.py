"""Loads into destinations that share memory without being one view (:class:`SharedMemoryLoads`)."""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Callable, Collection, Mapping, Set
from typing import Any

import torch
from torch.distributed.checkpoint.planner import ReadItem

from smpckpt.errors import LayoutMismatch, SpecError
from smpckpt.model.layout import RESERVED
from smpckpt.planners._entries import Entry

__all__ = ["SharedMemoryLoads", "TiedLoads", "check_destination"]


def check_destination(key: str, value: torch.Tensor, stored: bool) -> None:
    """A destination a load can fill: allocated, and (``stored``: the checkpoint holds its key, so it is
    read) no two of its elements one memory location (an expanded view: torch refused the copy, naming no key)."""
    if value.device.type == "meta":
        raise SpecError(f"{key}: destination is on the meta device; allocate it before loading")
    strides = value.stride()
    if stored and 0 in strides and value.numel() > 0 and any(st == 0 and n > 1 for n, st in zip(value.shape, strides)):
        raise SpecError(
            f"{key}: the destination (shape {tuple(value.shape)}, strides {strides}) is an expanded view: "
            "several of its elements are one memory location, which a load cannot give different values; load "
            "into a tensor of its own (.clone(), or .contiguous()) and expand that"
        )


def _extent_end(v: torch.Tensor) -> int:
    """The address one past a non-empty tensor's last byte (strides are never negative: the extent ends
    at the last element's end)."""
    if v.is_contiguous():
        return v.data_ptr() + v.nbytes
    return v.data_ptr() + (sum((n - 1) * st for n, st in zip(v.shape, v.stride())) + 1) * v.element_size()


class SharedMemoryLoads:
    """One load's destinations that share memory without being one view (tied keys, the same view, are
    :class:`TiedLoads`'): each read into scratch, copied in state-dict order once all of a group are in, each
    then holding its own value (the README's "Tied parameters" ends on why)."""

    def __init__(self) -> None:
        #: key of a destination in such a group -> that destination (its entry reads into scratch)
        self.dest: dict[str, torch.Tensor] = {}
        self._scratch: dict[str, torch.Tensor] = {}
        self._groups: list[list[str]] = []
        self._pending: dict[str, int] = {}  # elements of each key still to be read
        self._read: set[str] = set()  # keys with reads (the others keep their values)

    def plan(self, entries: Mapping[str, Entry], skip: Set[str]) -> None:
        """Find the groups among ``entries`` (less ``skip``: tied keys loaded through another key, or
        compared in scratch) by a sweep over their byte extents, addresses rather than storages (two
        storages over one memory are found too; interleaved views whose extents overlap though no
        element does take the scratch path needlessly but correctly)."""
        self.dest, self._scratch, self._groups, self._pending = {}, {}, [], {}
        spans: list[tuple[int, int, str]] = []
        for e in entries.values():
            if e.kind == "object" or e.chunk is None or e.key in skip:
                continue
            v = e.value
            if not v.numel():
                continue
            start, stop = v.data_ptr(), _extent_end(v)
            if start and stop > start:  # address 0: no storage (meta, ZeroTensor), which nothing shares
                spans.append((start, stop, e.key))
        order = {key: i for i, key in enumerate(entries)}
        for group in _overlapping(spans):
            # the same addresses on two devices are no shared memory: each device's keys swept apart
            by_device: dict[torch.device, list[tuple[int, int, str]]] = {}
            for span in group:
                by_device.setdefault(entries[span[2]].value.device, []).append(span)
            for row in by_device.values():
                for found in _overlapping(row) if len(by_device) > 1 else [row]:
                    self._groups.append(sorted((key for _, _, key in found), key=order.__getitem__))
        self.dest = {key: entries[key].value for group in self._groups for key in group}

    def scratch(self, entry: Entry) -> Entry:
        """The entry of a key in a group, reading into a scratch tensor of its shape instead."""
        value = self._scratch[entry.key] = torch.empty_like(entry.value)
        return dataclasses.replace(entry, value=value)

    def count(self, items: list[ReadItem]) -> None:
        """(after the local plan) The elements each key waits for. A key nothing is read for (missing
        from the checkpoint, optional) keeps its value: its scratch holds that, to be checked too."""
        self._pending = dict.fromkeys(self.dest, 0)
        for item in items:
            if item.dest_index.fqn in self._pending:
                self._pending[item.dest_index.fqn] += math.prod(item.lengths)
        self._read = {key for key, left in self._pending.items() if left}
        for key, left in self._pending.items():
            if not left:
                self._scratch.setdefault(key, torch.empty_like(self.dest[key])).copy_(self.dest[key])

    def _covered(self, group: list[str]) -> set[str]:
        """The keys of ``group`` not read whose every byte a read key writes (a buffer viewing part of a
        weight, resumed from a checkpoint saved before the buffer existed): they have no saved value and
        cannot keep their old one, so they follow the memory they view, as a view does."""
        unread = [k for k in group if k not in self._read]
        if not unread:
            return set()
        views = [self.dest[k] for k in group]
        lo, hi = min(v.data_ptr() for v in views), max(_extent_end(v) for v in views)
        written = torch.zeros(hi - lo, dtype=torch.uint8, device=views[0].device)

        def bytes_of(v: torch.Tensor) -> torch.Tensor:
            size = v.element_size()
            return written.as_strided((*v.shape, size), (*(st * size for st in v.stride()), 1), v.data_ptr() - lo)

        for key in group:
            if key in self._read:
                bytes_of(self.dest[key]).fill_(1)
        return {k for k in unread if bool(bytes_of(self.dest[k]).all())}

    def committed(self, item: ReadItem, entries: Mapping[str, Entry], rank: int) -> None:
        """(reader) One read is in: write and check each group whose reads are all in."""
        fqn = item.dest_index.fqn
        if fqn not in self._pending:
            return
        self._pending[fqn] -= math.prod(item.lengths)
        if self._pending[fqn]:
            return
        for group in self._groups:
            if fqn not in group or any(self._pending[k] for k in group):
                continue
            for key in group:
                if key in self._read:  # a key not read keeps its value: its scratch is only to check
                    self.dest[key].copy_(self._scratch[key])
            covered = self._covered(group)  # keys not read that read keys overwrite whole: views of them
            bad = [k for k in group if k not in covered and not same_bits(self.dest[k], self._scratch[k])]
            if bad:
                unread = [k for k in group if k not in self._read]
                raise LayoutMismatch(
                    f"rank {rank}: {', '.join(map(repr, group))} are destinations that share memory (overlapping "
                    "views of one storage, not the same view), but their saved values disagree where they "
                    f"overlap: once all are written, {', '.join(map(repr, bad))} would not hold "
                    + ("its" if len(bad) == 1 else "their")
                    + " saved value"
                    + (f" ({', '.join(map(repr, unread))}: not in the checkpoint, so its value kept)" if unread else "")
                    + ". Load them into tensors of their own, or from a checkpoint saved from a model whose "
                    "views share this memory"
                )


def _overlapping(spans: list[tuple[int, int, str]]) -> list[list[tuple[int, int, str]]]:
    """The groups of two or more byte extents ``[start, stop)`` (key last) that overlap, by a sweep in
    address order: an extent starting before every extent so far has ended joins their group."""
    groups: list[list[tuple[int, int, str]]] = []
    group: list[tuple[int, int, str]] = []
    end = -1
    for span in sorted(spans):
        if span[0] < end:
            group.append(span)
            end = max(end, span[1])
            continue
        if len(group) > 1:
            groups.append(group)
        group, end = [span], span[1]
    if len(group) > 1:
        groups.append(group)
    return groups


def _conjugate_twin(entries: Mapping[str, Entry], key: str, first: str) -> bool:
    """Whether destination ``key``, which the checkpoint records as a tie of ``first``, is the conjugate or
    negated view of ``first``'s destination (the same memory, other bits): smpckpt before c4a7f4e recorded such
    a pair as a tie and stored ``first`` alone. ``key`` is then left out of the load (``first``'s memory holds
    its values: it loads as it did then), with a warning naming both; reading it too would refuse the pair as
    memory holding two values (rev69f F1)."""
    a, b = entries[key], entries.get(first)
    if b is None or a.kind == "object" or b.kind == "object" or a.chunk is None or b.chunk is None:
        return False
    u, v = a.value, b.value
    if not u.numel() or (u.is_conj(), u.is_neg()) == (v.is_conj(), v.is_neg()):
        return False
    if (u.device, u.data_ptr(), u.dtype, u.shape, u.stride()) != (v.device, v.data_ptr(), v.dtype, v.shape, v.stride()):
        return False
    warnings.warn(
        f"{key}: the checkpoint records it as a tie of {first} (saved by smpckpt before conjugate and negated views "
        f"were told apart), and its destination is a conjugate or negated view of {first}'s memory: {first} alone "
        f"is loaded, {key} showing it through its view as when it was saved; save again to store both",
        stacklevel=2,
    )
    return True


#: the keys of a parameter's optimizer state: ``optim.state.<parameter>.<name>`` and its param group's
_STATE_PREFIXES = (f"{RESERVED.optim}.state.", f"{RESERVED.optim}.param_groups.")


def _local_names(entries: Mapping[str, Entry], name_map: Callable[[str], str] | None) -> dict[str, str]:
    """Each entry's key -> its name before ``name_map`` (its key itself without one: a pipeline stage's layers
    renumbered alike for ``model.`` and ``optim.``)."""
    return {k: e.local_key for k, e in entries.items()} if name_map is not None else dict(zip(entries, entries))


def _saved_state_keys(
    md_all: Mapping[str, Any],
    starts: tuple[str, ...],
    split: Callable[[str], tuple[str, str, str] | None],
    names: Mapping[str, Any],
    name_map: Callable[[str], str] | None,
    local_keys: Collection[str] = (),
) -> list[tuple[str, tuple[str, str, str]]]:
    """The checkpoint keys (``md_all``) that are the optimizer state of a parameter in ``names`` (destination names,
    before ``name_map``; ``starts``: their state's prefixes), each with its (prefix, parameter name, rest). Under
    a map: found by each name's mapped prefix, every one checked by mapping it back (a map that moves no prefix
    finds none)."""
    if name_map is None:
        return [(key, found) for key in md_all if key.startswith(starts) and (found := split(key)) is not None]
    mapped, whole = {}, []
    for p in _STATE_PREFIXES:
        for name in names:
            if (probe := _mapped(name_map, p + name + ".\x00")) is not None and probe.endswith(".\x00"):
                mapped[probe[:-1]] = (p, name)
            else:
                whole.append((p, name))  # no prefix to find them by
    by_length = tuple(sorted(mapped, key=len, reverse=True))
    saved = []
    for key in [k for k in md_all if k.startswith(by_length)]:
        for pre in (q for q in by_length if key.startswith(q)):
            p, name = mapped[pre]
            if _mapped(name_map, p + name + (rest := key[len(pre) - 1 :])) == key:
                saved.append((key, (p, name, rest)))
                break
    hit = {(p, n) for _, (p, n, _) in saved}
    whole += [pn for pn in mapped.values() if pn not in hit]  # a probe the map left as it was: a map of whole keys
    if whole:  # (a dict's): each state name the destination's keys hold, mapped whole (rev72q: a healthy tie refused)
        rests = sorted({t for k in local_keys for p in _STATE_PREFIXES if k.startswith(p) for t in _tails(k, names, p)})
        known = ((_mapped(name_map, p + n + r), (p, n, r)) for p, n in whole for r in rests)
        saved += [(key, found) for key, found in known if key is not None and key in md_all]
    return saved


def _mapped(name_map: Callable[[str], str], key: str) -> str | None:
    """``name_map(key)`` for a name the state dict may not hold (a probe, a copy's key the tie holds as one), ``None``
    where the map does not know it: a strict map (a dict's ``__getitem__``) raises ``KeyError`` there, which ended the
    resume of a healthy tie held apart (fix73a); such a name is then not found, as one the map leaves out."""
    try:
        return name_map(key)
    except LookupError:
        return None


def _tails(key: str, names: Mapping[str, Any], prefix: str) -> list[str]:
    """``key``'s part after ``prefix`` and one of ``names`` (``.<state name>``), for each that it starts with."""
    return [key[len(prefix + n) :] for n in names if key.startswith(prefix + n + ".")]


class TiedLoads:
    """One load's tied keys: where each is read from, and the comparisons of values held apart."""

    def __init__(self, keep: re.Pattern[str] | None) -> None:
        self.keep = keep
        #: destination key -> the checkpoint key read for it
        self.sources: dict[str, str] = {}
        #: skipped destination key (the tensor of another) -> the key that loads it
        self.through: dict[str, str] = {}
        #: checkpoint keys such a skipped key covers (loaded through the other key of the same tensor)
        self.covered: list[str] = []
        #: a tied key the checkpoint holds apart, read into scratch -> the key loaded it must equal
        self.compare: dict[str, str] = {}
        self._pending: dict[str, int] = {}  # elements of each compared key still to be read
        self._objects: dict[str, Any] = {}  # values read of compared keys (tensors; objects: an lr, a Python step)
        self._keep: dict[str, tuple[str, str]] = {}  # a compared optimizer key -> its parameters' keys

    def plan(
        self,
        entries: dict[str, Entry],
        dest_tied: Mapping[str, str],
        saved_tied: Mapping[str, str],
        md_all: Mapping[str, Any],
        rank: int,
        name_map: Callable[[str], str] | None = None,
    ) -> None:
        """Decide, for ``rank``'s destination ``entries``, from the checkpoint's keys ``md_all``.

        Per tensor the destination ties (``dest_tied``: its keys, the first first), a key's *stored* tensor is
        the checkpoint key holding it (the key, or the first key of a saved tie listing it); the *reader* is
        the first stored key a ``keep_tied`` glob matches, else the first stored key, else the first key.
        Each other key of the tensor:

        ===================================================  ===============================================
        the key                                              planned
        ===================================================  ===============================================
        not stored, or stored as the reader's (saved tied)   ``through`` the reader, its saved keys covered
        stored apart, no glob: the first of its tensor       ``compare``: into scratch, equal to the reader's
        stored apart, matched beside the reader by globs     ``compare``; differing: refused as the globs'
        that pick two stored tensors                         ambiguity
        stored apart otherwise (globs pick one tensor, or    ``through``, unread (covered)
        it is a later key of a tensor compared already)
        ===================================================  ===============================================

        The optimizer state follows the tensor read where copies are apart or the reader is not the first
        key (a head declared first: ``_optimizer_state``). A destination key the checkpoint lacks but lists
        as an alias of a tie it saved reads the tie's stored tensor (``sources``)."""

        def stored(key: str) -> str | None:
            first = saved_tied.get(key)  # an alias the checkpoint lists is still its first key's tensor
            if first is not None and first in md_all:
                return first
            return key if key in md_all else None

        model = f"{RESERVED.model}."
        names: dict[str, tuple[str, bool]] = {}  # name of a key held apart -> (name loaded, compare the others)
        groups: dict[str, list[str]] = {}
        for alias, first in dest_tied.items():
            groups.setdefault(first, [first]).append(alias)
        self.sources, self.through, self.covered, self.compare, self._pending, self._keep = {}, {}, [], {}, {}, {}
        self._objects = {}
        for keys in groups.values():
            # each key's stored tensor (a key the checkpoint ties to another is that one), and those a
            # keep_tied match selects: a matching alias selects its stored tensor (rev62e R1)
            src = {k: s for k in keys if (s := stored(k)) is not None}
            picked = [k for k in keys if k in src and self.keep is not None and self.keep.fullmatch(k)]
            reader = next(iter(picked), next(iter(src), keys[0]))
            # compared with the reader: one key per other stored tensor, or per other one picked (equal
            # copies are no choice to make: a glob matching two loads them, differing ones are refused)
            seen, kept = {src.get(reader)}, len({src[k] for k in picked}) == 1
            for key in keys:
                if key == reader:
                    continue
                if key in src and src[key] not in seen and not kept and (not picked or key in picked):
                    seen.add(src[key])
                    self.compare[key] = reader  # two values for one tensor: read both, compare
                    if picked:
                        self._keep[key] = ("", "")  # refused as the glob's ambiguity
                    continue
                self.through[key] = reader
                self.covered += [k for k in dict.fromkeys((key, src.get(key))) if k is not None and k in md_all]
            # the optimizer state follows the stored tensor read: held apart, or stored under another key than
            # the destination's first (a head declared first, rev62h F5); compared only for a key that holds
            # its own copy (an alias's state lies under its stored key, rev62i F1)
            # Named by the destination's keys before a name_map (which may move ``model.``/``optim.``, rev72l
            # H1), the checkpoint's keys built from them through the map (``_optimizer_state``)
            local = {k: entries[k].local_key if name_map is not None and k in entries else k for k in keys}
            kept_as = next((local[k] for k in keys if k == src.get(reader)), None if name_map else src.get(reader))
            if (
                (len(set(src.values())) > 1 or src.get(reader, reader) != keys[0])
                and kept_as is not None
                and all(n.startswith(model) for n in (kept_as, *local.values()))
            ):
                names.update(
                    (local[k][len(model) :], (kept_as[len(model) :], src.get(k) == k and k in seen - {src[reader]}))
                    for k in keys
                )
        # a key absent from the checkpoint is read from another only as an alias it lists: those looked up,
        # not every key (rev62k F2)
        for key in saved_tied:
            if key in entries and key not in self.through:
                if _conjugate_twin(entries, key, saved_tied[key]):  # an old checkpoint's conj "tie": as loaded then
                    self.through[key] = saved_tied[key]
                    self.covered += [key] if key in md_all else []
                elif key not in md_all and (source := stored(key)) is not None:
                    self.sources[key] = source
        if names:
            self._optimizer_state(names, entries, md_all, rank, name_map)

    def _optimizer_state(
        self,
        names: dict[str, tuple[str, bool]],
        entries: dict[str, Entry],
        md_all: Mapping[str, Any],
        rank: int,
        name_map: Callable[[str], str] | None = None,
    ) -> None:
        """The optimizer state of a tied parameter the checkpoint holds apart (pipeline stages each held a
        copy; ``names``: each copy's parameter name -> the name loaded, and whether to compare) follows its
        weights: read from the key loaded, each other copy's state compared with it (objects too: an lr, a
        Python step, rev62g F5), never one key's weights with the other's moments (hunt62a). Adds the
        compared entries (an object's with no path: read, compared by ``object_read``, set nowhere)."""
        prefixes = _STATE_PREFIXES

        def split(key: str) -> tuple[str, str, str] | None:  # (prefix, parameter name, rest) of such a key
            for p in prefixes:
                if key.startswith(p) and (name := RESERVED.state_owner(key[len(p) :], names.keys())) is not None:
                    return p, name, key[len(p) + len(name) :]
            return None

        # ``names`` are the destination's (before a name_map), the checkpoint's keys theirs through the map
        # (rev72l H1: a map moving ``model.``/``optim.`` lost the state's tie, or loaded the other copy's)
        glob_ = name_map if name_map is not None else str
        # only keys under such a name's prefixes are split (a C-level filter, rev62k F2: splitting every key
        # of a large model cost seconds per resume)
        starts = tuple(p + name + "." for p in prefixes for name in names)
        asked = False  # whether this load asks for such a parameter's optimizer state (a model-only one: not)
        named = _local_names(entries, name_map)
        for key in [k for k, n in named.items() if n.startswith(starts) and k not in self.sources]:
            found = split(named[key])
            if found is not None and (source := glob_(found[0] + names[found[1]][0] + found[2])) != key:
                self.sources[key] = source  # the dest's name (its first key) may be the copy not loaded
            asked = asked or found is not None
        back: dict[str, list[str]] = {}
        for key, source in self.sources.items():
            back.setdefault(source, []).append(key)

        def loaded(source: str) -> str | None:  # the destination key reading ``source``
            readers = back.get(source, []) + ([source] if source in entries and source not in self.sources else [])
            if len(readers) > 1:  # read by two: the later destination's (rare: then looked for in order)
                return next(k for k in reversed(entries) if self.sources.get(k, k) == source)
            return next(iter(readers), None)

        saved = _saved_state_keys(md_all, starts, split, names, name_map, named.values())
        held: dict[str, set[tuple[str, str]]] = {}  # each copy's name -> its saved keys (prefix, rest)
        for _, (prefix, name, rest) in saved:
            held.setdefault(name, set()).add((prefix, rest))
        model = f"{RESERVED.model}."
        for name, (kept, compared) in names.items():
            one, other = held.get(name, set()), held.get(kept, set())
            if compared and asked and one != other:  # one copy saved without state (frozen): nothing to compare
                odd = sorted(
                    {glob_(p + name + r) for p, r in one - other} | {glob_(p + kept + r) for p, r in other - one}
                )
                first, second = glob_(model + name), glob_(model + kept)
                raise LayoutMismatch(
                    f"rank {rank}: '{first}' and '{second}' are one tensor in the model (tied), but the checkpoint "
                    f"holds them apart with different optimizer state: only one holds {', '.join(odd[:6])}. Pass "
                    f"keep_tied=['{second}'] (or ['{first}']) to load that one and ignore the other"
                )
        for key, found in saved:
            if names[found[1]][0] == found[1]:
                continue
            # the cheap checks first: ``loaded`` may walk the entries (rev63b F3)
            if (
                not names[found[1]][1]
                or key in entries
                or (dest := loaded(glob_(found[0] + names[found[1]][0] + found[2]))) is None
            ):
                self.covered.append(key)
            else:  # read into scratch like the dest, compared with it once both are in
                entries[key] = dataclasses.replace(entries[dest], key=key, local_key=key, path=())
                self.compare[key] = dest
                self._keep[key] = (glob_(f"{model}{names[found[1]][0]}"), glob_(f"{model}{found[1]}"))

    def count(self, items: list[ReadItem]) -> None:
        """(after the local plan) The reads (tensor pieces, or an object) each compared key and its loaded key
        wait for: one copy may be read as a tensor, the other as an object (a ``step`` one stage saved as
        a 0-d tensor, the other as a number, rev62i F2), so both kinds are counted alike."""
        watched = set(self.compare) | set(self.compare.values())
        self._pending = dict.fromkeys(watched, 0)
        for item in items:
            if item.dest_index.fqn in watched:
                self._pending[item.dest_index.fqn] += 1

    def committed(self, item: ReadItem, entries: Mapping[str, Entry], rank: int) -> None:
        """(reader) One tensor read is in (``commit_tensor``)."""
        if item.dest_index.fqn in self._pending:
            self._arrived(item.dest_index.fqn, entries[item.dest_index.fqn].value, rank)

    def object_read(self, key: str, obj: Any, rank: int) -> None:
        """(reader) An object is in (``load_bytes``)."""
        if key in self._pending:
            self._arrived(key, obj, rank)

    def _arrived(self, key: str, value: Any, rank: int) -> None:
        """One read of ``key`` is in; once all are (``value``: the key's tensor or object), compare each
        pair of it whose other key is in too."""
        self._pending[key] -= 1
        if self._pending[key]:
            return
        self._objects[key] = value
        for alias, reader in self.compare.items():
            if key in (alias, reader) and alias in self._objects and reader in self._objects:
                if not _same_object(self._objects[alias], self._objects[reader]):
                    self._refuse(alias, reader, rank)

    def _refuse(self, alias: str, reader: str, rank: int) -> None:
        keep = self._keep.get(alias, (reader, alias))
        if not keep[0]:
            raise LayoutMismatch(
                f"rank {rank}: keep_tied matches both {' and '.join(sorted((repr(alias), repr(reader))))}, "
                "one tensor the checkpoint holds apart, and the two differ: name one"
            )
        raise LayoutMismatch(
            f"rank {rank}: {alias!r} and {reader!r} are "
            + ("one tensor" if keep == (reader, alias) else "the optimizer state of one tensor")
            + " in the model (tied), but the checkpoint holds them apart with different values, and a tied model "
            f"holds one. Pass keep_tied=[{keep[0]!r}] (or [{keep[1]!r}]) to load that one and ignore the other, "
            "or untie them in the model (give the head its own parameter) to load both"
        )


def _same_object(a: Any, b: Any) -> bool:
    """Two objects read for one value (a tensor's bits; numbers by value, NaN equal to NaN, a bool only to a
    bool; ``repr`` when ``==`` fails or says no)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return same_bits(a, b)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):  # a number one copy saved as a 0-d tensor
        t, n = (a, b) if isinstance(a, torch.Tensor) else (b, a)
        if t.dim() != 0 or type(n) not in (int, float, bool):
            return False
        a, b = t.item(), n
    if type(a) in (int, float, bool) and type(b) in (int, float, bool):  # a step saved as 2 by one, 2.0 by the other
        return (type(a) is bool) == (type(b) is bool) and (a == b or (a != a and b != b))
    try:
        if type(a) is type(b) and bool(a == b):
            return True
    except (RuntimeError, TypeError, ValueError):  # containers of tensors: compared as printed
        pass
    return type(a) is type(b) and repr(a) == repr(b)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (a NaN equals itself, -0.0 is not +0.0): one tensor written twice is the same bytes."""
    if a.numel() != b.numel() or a.dtype != b.dtype:
        return False
    # the values a conjugate or negated view shows (a view as integers refuses the negative bit)
    a, b = a.reshape(-1).resolve_conj().resolve_neg(), b.reshape(-1).resolve_conj().resolve_neg()
    if a.dtype.is_floating_point:
        as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return bool(torch.equal(a.view(as_int), b.view(as_int)))
    return bool(torch.equal(a, b))

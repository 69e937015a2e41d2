"""What a user's ``name_map`` (``Sharding(name_map=...)``: a stage-local key -> its global name) does to our
judgements of a resume.

A map may rename anything: move ``model.``/``optim.``, add a suffix (``k + ".v1"``), rename optimizer state names
(``.exp_avg`` -> ``.m``). So a judgement about a parameter's optimizer state is made on the destination's names
(before the map) beside the checkpoint keys read for them, never by parsing the checkpoint's names, which may
name another parameter or carry dotted parts a hyper-parameter's name would pass for (rev72p, rev73a).

:func:`stateless_when_saved`: the missing optimizer state of a parameter saved without any (no gradient yet), which
a strict resume leaves as it is instead of refusing; ``planners/load.py`` asks it for its missing keys (with a map
or without: without one the key read is the key). Where a map put a parameter's state is read off the key read
(:func:`_read_prefix`) or else found by mapping a probe (:func:`_probed_prefix`); where neither tells, the key is
refused, never skipped (skipping it wrongly would resume a parameter without its moments, silently).

Elsewhere under a map: the spec's pairing of a state key with its parameter is ``specs.state_params`` (beside the
spec rules it feeds), the tied copies' state is found by ``planners/_shared_memory._saved_state_keys``, and
``layout.wrap_name_map`` keeps our own keys (rng, user_content) out of the map: beside the reserved keys it names,
on every save and resume under a map (a module of its own there is one more on their call paths, test_call_paths)."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence

from smpckpt.model.layout import OPTIM_STATE_PREFIX, RESERVED

__all__ = ["stateless_when_saved"]


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

"""Whether a :class:`~smpckpt.model.translation.Translation` fits the tensors it is given.

A translation maps only the keys its rules name and keeps every other key as it is, so the wrong one
changes nothing and fails nowhere: a GPT-J checkpoint exported with GPT-Neo's rules keeps its fused
``attn.qkv_proj.weight`` under that name, which ``from_pretrained`` then ignores, initialising q, k
and v at random. :func:`check_translates` refuses what no right translation would leave:

* none of the tensors is one the rules take (on export always; on import -- a Hugging Face folder --
  when another family's rules take some: a folder may hold only untranslated tensors, an embedding);
* a tensor the rules leave as it is that another translation's rules take (``others``: the other
  families of :mod:`smpckpt.hf`). On import only rules that fuse several artifact tensors count here: a
  renamed key of one family (GPT-2's ``mlp.c_fc.weight``) may be another's own (GPT-Neo's);
* a tensor the rules leave as it is although they take it without a prefix (``module.`` of a wrapper).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

from smpckpt.errors import SpecError
from smpckpt.model.translation import Translation

__all__ = ["check_translates"]

_SHOW = 5


def _show(keys: Sequence[str]) -> str:
    return ", ".join(repr(k) for k in keys[:_SHOW]) + (f" and {len(keys) - _SHOW} more" if len(keys) > _SHOW else "")


def _prefixed(translation: Translation, key: str, side: str) -> tuple[str, str] | None:
    """``(prefix, rule template)`` when a dotted tail of ``key`` is one the rules take whole."""
    pos = 0
    while (pos := key.find(".", pos) + 1) > 0:
        tail = key[pos:]
        for rule in translation.rules:
            if (rule.match_ours(tail) if side == "ours" else rule.match_artifact(tail)) is not None:
                return key[:pos], rule.ours if side == "ours" else next(iter(rule.artifact))
    return None


def check_translates(
    translation: Translation,
    shapes: Mapping[str, Sequence[int]],
    side: Literal["ours", "artifact"],
    others: Iterable[Translation] = (),
) -> None:
    """Raise :class:`~smpckpt.errors.SpecError` when ``translation`` does not fit the tensors of
    ``shapes`` on ``side`` (``"ours"``: exporting our tensors; ``"artifact"``: importing a Hugging Face
    folder's), naming the keys and what would fit."""
    if not translation.rules or not shapes:
        return
    keys = [k for k in shapes if side == "ours" or not translation.is_ignored(k)]
    kept = [k for k in keys if translation.rule_of(k, shapes, side) is None]
    theirs: dict[str, list[str]] = {}  # another translation -> the kept keys it takes
    fused: dict[str, list[str]] = {}  # of those, the ones it fuses from several artifact tensors
    for other in others:
        if other is translation or other.name == translation.name:
            continue
        for key in kept:
            rule = other.rule_of(key, shapes, side)
            if rule is not None:
                theirs.setdefault(other.name, []).append(key)
                if side == "ours" or len(rule.artifact) > 1:
                    fused.setdefault(other.name, []).append(key)
    what = "tensors" if side == "ours" else "Hugging Face tensors"
    if len(kept) == len(keys) and (side == "ours" or theirs):
        prefixed = next((p for k in kept if (p := _prefixed(translation, k, side)) is not None), None)
        if theirs:
            # a family whose rules fuse the tensors names it surest (GPT-2's renames are GPT-Neo's keys);
            # families sharing rules (Llama, Mistral, Qwen2) are named together
            name, found = max((fused or theirs).items(), key=lambda item: len(item[1]))
            names = " or ".join(f"{n}'s" for n, f in (fused or theirs).items() if f == found)
            hint = f"they are {names} ({_show(found)}): use its translation, smpckpt.hf.translation_for({name!r})"
        elif side == "ours" and any(translation.rule_of(k, shapes, "artifact") is not None for k in kept):
            hint = "they already have the artifact's (Hugging Face) names: save without a translation"
        elif prefixed is not None:
            hint = f"some are its {prefixed[1]!r} under the prefix {prefixed[0]!r}: strip the prefix"
        else:
            hint = f"is the model of its family ({translation.architecture or translation.name})?"
        raise SpecError(
            f"translation {translation.name!r} takes none of the {len(keys)} {what} ({_show(kept)}), so it "
            f"would change nothing: {hint}"
        )
    for found in fused.values():
        names = " or ".join(f"{n}'s" for n, f in fused.items() if f == found)
        raise SpecError(
            f"translation {translation.name!r} leaves {_show(found)} as they are, but they are {names} "
            f"{'fused tensors' if side == 'ours' else 'tensors to fuse'}: use the translation of the model's family"
        )
    prefixed_keys = [k for k in kept if _prefixed(translation, k, side) is not None]
    if prefixed_keys:
        prefix, template = _prefixed(translation, prefixed_keys[0], side) or ("", "")
        raise SpecError(
            f"translation {translation.name!r} leaves {_show(prefixed_keys)} as they are, but without the prefix "
            f"{prefix!r} they are its {template!r}: save the model without its wrapper (or strip the prefix)"
        )

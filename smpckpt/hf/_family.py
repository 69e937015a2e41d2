"""Whose names these are: smpckpt's families (:data:`TRANSLATIONS`) and the one rule for tensors or a config of
another family than a translation's (README, "Loading full artifacts", "A translation must fit the tensors"), asked
by a full reader of an untranslated artifact (:func:`as_is_judge`, whose judge words the load planner's refusal), by
the import of a Hugging Face folder or state dict (:func:`check_translation`) and an export's ``hf_config``."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from smpckpt.errors import LayoutMismatch, SpecError
from smpckpt.hf import bert, gpt2, gptj, gptneo, llama, mistral, qwen2, roberta
from smpckpt.model.translation import Leaf, Translation, check_translates, expr_keys

__all__ = ["TRANSLATIONS", "translation_for", "check_translation", "check_config", "as_is_judge"]

#: HF ``config.model_type`` -> translation.
TRANSLATIONS: Mapping[str, Translation] = MappingProxyType(
    {mod.TRANSLATION.name: mod.TRANSLATION for mod in (gpt2, bert, roberta, gptj, gptneo, llama, qwen2, mistral)}
)
#: module names that differ from the model_type (smp's import path is ``...huggingface.gptneo``)
_MODULE_NAMES = MappingProxyType({"gptneo": "gpt_neo"})
#: what may follow a family's class prefix in ``architectures`` (``GPTJ`` + ``ForCausalLM``)
_HEADS = re.compile(r"(For[A-Z]\w*|LMHeadModel|DoubleHeadsModel|Model|PreTrainedModel)")
_SHOWN = 20  #: keys a load's refusal names at most (as the load planner's own)
Hits = dict[str, list[tuple[bool, str, str]]]
Judge = Callable[[Sequence[str], Mapping[str, Any], Any], str]  #: a full reader's for the load planner: _judge


def translation_for(name: str) -> Translation:
    """The translation of a family by ``config.model_type`` (``"gpt_neo"``) or module name (``"gptneo"``)."""
    if (found := TRANSLATIONS.get(_MODULE_NAMES.get(name, name))) is None:
        raise KeyError(f"no Hugging Face translation for {name!r}; known: {sorted(TRANSLATIONS)}")
    return found


def _layer(key: str) -> str | None:
    """The key up to and with its first numbered field (``transformer.h.0.``): its layer; ``None``: none."""
    return key[: found.end()] if (found := re.search(r"\.\d+\.", key)) else None


def _others(
    translation: Translation,
    keys: Iterable[str],
    sides: Sequence[str],
    fused: bool = False,
    among: Iterable[str] | None = None,
    first: bool = False,
) -> Hits:
    """Family -> ``(fused, side, key)`` of the ``keys`` the rules of smpckpt's other families take (``fused``:
    their fused rules only, several Hugging Face tensors; ``among``: those families only; ``first``: the first
    key found, all that a "whether" needs), by side and key (the templates' tails tested first)."""
    wanted = None if among is None else set(among)
    others = (o for o in TRANSLATIONS.values() if o.name != translation.name)
    hits: Hits = {o.name: [] for o in others if wanted is None or o.name in wanted}
    for side in sides:
        rules = {o.name: [r for r in o.rules if len(r.artifact) > 1 or not fused] for o in TRANSLATIONS.values()}
        tails = {
            n: [(t.rpartition("}")[2], r) for r in rules[n] for t in ((r.ours,) if side == "ours" else r.artifact)]
            for n in hits
        }
        every = tuple({t for found in tails.values() for t, _ in found})
        for k in (k for k in keys if k.endswith(every)):
            for name, found in tails.items():
                rule = next((r for t, r in found if k.endswith(t) and r.match(k, side) is not None), None)
                if rule is not None:
                    hits[name].append((len(rule.artifact) > 1, side, k))
                    if first:
                        return {name: hits[name]}
    return {n: h for n, h in hits.items() if h}


def check_translation(translation: Translation, shapes: Mapping[str, Sequence[int]], side: str) -> None:
    """Refuse a translation not fitting the tensors ``shapes`` (``side``: ``"ours"`` exporting ours, ``"artifact"``
    importing a Hugging Face folder's), as :func:`~smpckpt.model.translation.check_translates` says against every
    family here; importing, also a family's leaving another family's fused tensor in our names (GPT-Neo's
    ``attn.attention.qkv_proj``) in a layer whose other tensors it takes as its Hugging Face names (GPT-Neo's
    ``mlp.c_fc``, GPT-2's transposed ``Conv1D``). A module beside the model (no layer shared) is read as it is."""
    check_translates(translation, shapes, "ours" if side == "ours" else "artifact", TRANSLATIONS.values())
    if side == "ours" or TRANSLATIONS.get(translation.name) is None:
        return
    taken: set[str | None] = set()  # the layers whose tensors the rules take, found once a key needs them
    found: dict[str, list[str]] = {}
    for name, hits in _others(translation, shapes, ("ours",), fused=True).items():
        for _, _, key in hits:
            if translation.rule_of(key, shapes, "ours") is None:  # not Llama's own, shared by Mistral, Qwen2
                taken = taken or {_layer(k) for k in shapes if translation.rule_of(k, shapes, "artifact")} - {None}
                found.setdefault(name, []).extend([key] if _layer(key) in taken else [])
    if keys := max(found.values(), key=len, default=[]):
        names = [n for n, ks in found.items() if ks == keys]
        raise SpecError(
            f"translation {translation.name!r} takes some of the tensors as Hugging Face names but leaves "
            f"{', '.join(repr(k) for k in keys[:3])}{' ...' if len(keys) > 3 else ''}, which are "
            + " or ".join(f"{n}'s" for n in names)
            + " fused tensors in our names: the tensors are that family's model in our names, read as they are with "
            f"its translation, smpckpt.hf.translation_for({names[0]!r}), into a model of that family"
        )


def as_is_judge(
    translation: Translation, shapes: Mapping[str, Any], url: str, prefix: str
) -> tuple[Judge | None, frozenset[str]]:
    """(a full reader) Of an untranslated artifact's model tensors ``shapes`` read through ``translation``: the
    judge of the model keys under ``prefix`` a load misses (:func:`_judge`), and our keys its rules make. No judge
    when a rule takes a key inside a layer (read through the rules: the import check judges the family) or does
    not fit. Rules taking keys outside layers only (a head one's own translation renames) leave the layers read as
    they are (ours, saved from our model; another family's; no family's), so they are judged as if no rule took a
    key (rev73c 1: a rename of ``head.weight`` hid GPT-2's names in layers read into GPT-Neo's, transposed)."""
    try:
        made = {k: expr for k, (expr, _) in translation.from_artifact(shapes).items() if expr != Leaf(k)}
    except ValueError:
        return None, frozenset()  # in part: the import check names what does not fit
    if any(_layer(k) is not None or any(_layer(s) is not None for s in expr_keys(e)) for k, e in made.items()):
        return None, frozenset(made)
    return functools.partial(_judge, translation, url, prefix, frozenset(made)), frozenset(made)


def _holds_made(translation: Translation, shapes: Mapping[str, Any], renamed: frozenset[str]) -> bool:
    """Whether ``shapes`` hold a key, not ``renamed``, that a rule of ``translation`` makes on our side (read as
    ours). Asked of the keys ending with a rule's literal tail alone (``rule_of`` per key is the cost at 300k keys),
    which, with no key renamed, answers as ``rule_of`` over every key: one taken whole ends with its rule's tail,
    and one taken as a parameter's state (``...qkv_proj.weight.exp_avg``, ending with none) only beside that
    parameter, of its shape, which does (rev73c 5; tests/hf/test_hf_as_is.py checks it over state suffixes)."""
    tails = tuple({r.ours.rpartition("}")[2] for r in translation.rules})
    return any(translation.rule_of(k, shapes, "ours") for k in shapes if k.endswith(tails) and k not in renamed)


def _judge(
    translation: Translation,
    url: str,
    prefix: str,
    renamed: frozenset[str],
    missing: Sequence[str],
    saved: Mapping[str, Any],
    asked: Any,
) -> str:
    """(error path) Refuse model keys ``missing`` from the artifact (``saved``: its metadata) that this rank loads
    (``asked``), naming the family whose names the artifact's are, when one is a key a rule of the translation makes
    on our side (one it renames) and other families' rules take the artifact's keys this rank does not ask for (those
    it asks are ours; fused rules name a family surest, either side: GPT-2's renamed mlp.c_fc is GPT-Neo's own key);
    with no family's, the words of a note for the strict refusal. ``""`` (missing as any key is): no key a rule makes
    nor any other family's (a new head, a stage's cut); the translation taking the names as ours; no key the rank does not ask for; renamed
    keys simply absent (rev71c3 L1): the keys asked (the rank's; in the load planner's global plan every rank's, its
    ``judge_job``) are found in part, among them that family's names (the model is in them; or none is any family's
    and every missing key is a renamed one outside layers: a stage of ln_f and a head, which its rank alone cannot
    tell, so the job's keys are judged again: rev72k), and nothing
    of the artifact lies in the layer (outside layers, the module; a dotless key, itself) of a renamed key, of its
    sources or of a missing key another family's rules take (GPT-Neo's q_proj beside GPT-2's shared mlp.c_fc). With
    no key a rule makes, the same judgement when the missing keys are other families' names and none of those
    families is the one named (a middle stage in GPT-Neo's names reading GPT-2's: fix73c). ``renamed``: our keys
    its rules made of keys outside layers (``saved`` holds them renamed), not the artifact's own names."""
    ours = [k for k in missing if k.startswith(prefix)]
    made = {k: r for k in (k[len(prefix) :] for k in ours) if (r := translation.rule_of(k, {k: ()}, "ours"))}
    sides = ("artifact", "ours")
    # no key renamed: judged only when missing keys are other families' names (a GPT-Neo-named stage's q_proj), and
    # then refused only where no such family's names are the artifact's too (below: GPT-2's c_attn beside it)
    theirs = {} if made else _others(translation, [k[len(prefix) :] for k in ours], sides)
    if not made and not theirs:
        return ""
    sizes = ((k[len(prefix) :], md) for k, md in saved.items() if k.startswith(prefix))
    shapes = {k: tuple(md.size) for k, md in sizes if isinstance(md, TensorStorageMetadata)}
    unasked = [k for k in shapes if prefix + k not in asked]
    if not unasked or _holds_made(translation, shapes, renamed):
        return ""
    hits = _others(translation, unasked, ("artifact", "ours"))
    score = {n: (sum(f for f, _, _ in h), len(h)) for n, h in hits.items()}
    named = [n for n, s in score.items() if s == max(score.values())]
    if not made and (not named or not theirs.keys().isdisjoint(named)):  # fix73c: the names may be one family's
        return ""
    kept = [k for k in shapes if prefix + k in asked]
    made_of = [n for k, r in made.items() for n in (k, *(t.format(**r.match(k, "ours") or {}) for t in r.artifact))]
    made_of += [
        k for h in (theirs or _others(translation, [k[len(prefix) :] for k in ours], sides)).values() for *_, k in h
    ]
    places = tuple({_layer(n) or (n[: n.rfind(".") + 1] if "." in n else n) for n in made_of})
    # a stage finding no family's key (ln_f and a head) whose missing keys are all renamed ones outside layers: its
    # rank alone cannot tell the job's names (waived per rank alone, another rank's layers were read transposed:
    # rev72k M1); the load planner's global plan judges again over every rank's keys, where the waiver holds only
    # if no rank finds a family's key and every missing key is such a one (a RoBERTa lm_head.dense missing beside
    # GPT-J's shared lm_head.bias is not: rev72k M2)
    # (whether any key found is a named family's, or any family's: the first one tells; a job's found keys are
    # every rank's, so no list of them all)
    alike = bool(named) and bool(_others(translation, kept, sides, among=named, first=True))
    if not alike and all(k[len(prefix) :] in made and _layer(k) is None for k in ours):
        alike = not _others(translation, kept, sides, first=True)  # layerless
    if kept and alike and not any(k.startswith(places) for k in shapes):
        return ""
    head = f"{url}: the artifact's names do not match translation {translation.name!r} (it takes none of its"
    head += f" {len(shapes)} model keys" + (f" but {len(renamed)} it renames outside layers" if renamed else "")
    if not named:
        why = "nor are they any family's of smpckpt.hf: resume without translate_function into a model in its names"
        return f". {head}, {next(iter(shapes))!r}, ..., as Hugging Face names or ours); {why}"
    _, side, key = sorted(hits[named[0]], key=lambda h: not h[0])[0]
    what = "Hugging Face names" if side == "artifact" else "names in ours (as its translation presents them)"
    more = f", ... ({len(ours) - _SHOWN} more)" if len(ours) > _SHOWN else ""
    raise LayoutMismatch(
        f"{head}): they are {' or '.join(named)}'s {what} ({key!r}): resume with that family's, smpckpt.hf."
        f"translation_for({named[0]!r}), into a model of that family; {len(ours)} of our model keys are not in it: "
        f"{', '.join(ours[:_SHOWN])}{more}"
    )


def check_config(translation: Translation, config: Any) -> None:
    """Refuse a ``config.json`` of another family than ``translation`` (one of ours): its
    ``model_type`` must be the translation's and each of its ``architectures`` a class of that family
    (``from_pretrained`` builds the model they name, over tensors laid out for the translation's)."""
    if translation.name not in TRANSLATIONS or config is None:
        return  # a translation of the user's own: its family is theirs to know
    get = config.get if isinstance(config, Mapping) else lambda name: getattr(config, name, None)
    model_type = get("model_type")
    if model_type and model_type != translation.name:
        raise ValueError(
            f"hf_config is a {model_type!r} config but the translation is for {translation.name!r}: use "
            f"smpckpt.hf.translation_for({model_type!r}) if the model is a {model_type}, or the config of its family"
        )
    prefix = re.sub(r"(For[A-Z]\w*|LMHeadModel)$", "", translation.architecture or "")
    wrong = [a for a in get("architectures") or () if not re.fullmatch(re.escape(prefix) + _HEADS.pattern, str(a))]
    if prefix and wrong:
        raise ValueError(
            f"hf_config names the architectures {wrong}, which are not {translation.name!r} models (the "
            f"translation writes {translation.architecture}'s tensors): give the config of the model's family"
        )

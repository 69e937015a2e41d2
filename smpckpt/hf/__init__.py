"""Hugging Face interop: translation between HF state dicts and our tensor-parallel layouts.

One module per family (gpt2, bert, roberta, gptj, gptneo: the five smp translated, with smp's function
names as aliases; llama, qwen2, mistral), each with ``TRANSLATION``, the eager
``translate_hf_state_dict_to_smpckpt`` / ``translate_state_dict_to_hf`` and ``tp_specs(tp, config,
prefix="")``, as the README's "Hugging Face families" describes them (tied heads, dropped buffers, fused
tensors in a view that reshards). :data:`TRANSLATIONS` maps HF's ``config.model_type`` to each family's
translation. Nothing here imports transformers: configs are read by attribute or dict key."""

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from smpckpt.errors import SpecError
from smpckpt.hf import bert, gpt2, gptj, gptneo, llama, mistral, qwen2, roberta
from smpckpt.model.translation import Translation, _stranded, _template_regex, check_translates, refuse_adapters

__all__ = ["gpt2", "bert", "roberta", "gptj", "gptneo", "llama", "qwen2", "mistral", "TRANSLATIONS", "translation_for"]
__all__ += ["check_translation", "check_config", "check_config_tensors"]

#: HF ``config.model_type`` -> translation.
TRANSLATIONS: Mapping[str, Translation] = MappingProxyType(
    {mod.TRANSLATION.name: mod.TRANSLATION for mod in (gpt2, bert, roberta, gptj, gptneo, llama, qwen2, mistral)}
)

#: module names that differ from the model_type (smp's import path is ``...huggingface.gptneo``)
_MODULE_NAMES = MappingProxyType({"gptneo": "gpt_neo"})


def translation_for(name: str) -> Translation:
    """The translation of a family by ``config.model_type`` (``"gpt_neo"``) or module name (``"gptneo"``)."""
    found = TRANSLATIONS.get(_MODULE_NAMES.get(name, name))
    if found is None:
        raise KeyError(f"no Hugging Face translation for {name!r}; known: {sorted(TRANSLATIONS)}")
    return found


def check_translation(translation: Translation, shapes: Mapping[str, Sequence[int]], side: str) -> None:
    """Refuse a translation that does not fit the tensors ``shapes`` (``side``: ``"ours"`` when
    exporting ours, ``"artifact"`` when importing a Hugging Face folder's), as
    :func:`smpckpt.model.translation.check_translates` says, against every family here."""
    check_translates(translation, shapes, "ours" if side == "ours" else "artifact", TRANSLATIONS.values())
    if side != "ours":
        _refuse_fused_ours(translation, shapes)


def _refuse_fused_ours(translation: Translation, shapes: Mapping[str, Sequence[int]]) -> None:
    """(import) Refuse tensors holding another family's fused tensor in our names (GPT-Neo's
    ``attn.attention.qkv_proj``) that a family's ``translation`` leaves while taking others: that family's model
    in our names, of which the rules take what they read as their Hugging Face names (GPT-Neo's ``mlp.c_fc``,
    transposed as GPT-2's ``Conv1D``). A user's own translation (a GPT-Neo in our names with a head it renames)
    knows its tensors; names no rule takes are read as they are (not here)."""
    if TRANSLATIONS.get(translation.name) is None:
        return
    templates: dict[str, list[str]] = {}  # our template of another family's fused rule -> the families
    for other in TRANSLATIONS.values():
        for rule in other.rules if other.name != translation.name else ():
            if len(rule.artifact) > 1 and other.name not in templates.setdefault(rule.ours, []):
                templates[rule.ours].append(other.name)
    tails = [(t.rpartition("}")[2], t, names) for t, names in templates.items()]  # a cheap test before the regex
    found: dict[str, list[str]] = {}
    for key in shapes:
        hit = next((n for tail, t, n in tails if key.endswith(tail) and _template_regex(t).fullmatch(key)), None)
        if hit is not None and translation.rule_of(key, shapes, "ours") is None:  # Llama's, Mistral's, Qwen2's
            found.setdefault(" or ".join(f"{n}'s" for n in hit), []).append(key)
    if not found:
        return
    # only a leftover in a layer whose other tensors the rules take: that layer is another family's in our names;
    # a module of its own beside the model (a draft model in CodeGen's names) is read as it is (rev71c3 M1)
    taken = {_layer(k) for k in shapes if translation.rule_of(k, shapes, "artifact") is not None} - {None}
    found = {n: kept for n, ks in found.items() if (kept := [k for k in ks if _layer(k) in taken])}
    if not found:
        return
    names, keys = max(found.items(), key=lambda item: len(item[1]))
    raise SpecError(
        f"translation {translation.name!r} takes some of the tensors as Hugging Face names but leaves "
        f"{', '.join(repr(k) for k in keys[:3])}{' ...' if len(keys) > 3 else ''}, which are {names} fused tensors "
        f"in our names: the tensors are that family's model in our names, read as they are with its translation, "
        f"smpckpt.hf.translation_for({names.partition(chr(39))[0]!r}), into a model of that family"
    )


def _layer(key: str) -> str | None:
    """The key up to and with its first numbered field (``transformer.h.0.``): its layer; ``None``: none."""
    found = _LAYER_FIELD.search(key)
    return key[: found.end()] if found else None


_LAYER_FIELD = re.compile(r"\.\d+\.")
#: what may follow a family's class prefix in ``architectures`` (``GPTJ`` + ``ForCausalLM``)
_HEADS = re.compile(r"(For[A-Z]\w*|LMHeadModel|DoubleHeadsModel|Model|PreTrainedModel)")


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
    wrong = [
        a
        for a in get("architectures") or ()
        if not (prefix and str(a).startswith(prefix) and _HEADS.fullmatch(str(a)[len(prefix) :]))
    ]
    if prefix and wrong:
        raise ValueError(
            f"hf_config names the architectures {wrong}, which are not {translation.name!r} models (the "
            f"translation writes {translation.architecture}'s tensors): give the config of the model's family"
        )


def check_config_tensors(translation: Translation | None, config: Any, artifact_keys: Iterable[str]) -> None:
    """Refuse a Llama-family export whose tensors are not the biases of the model ``from_pretrained`` builds
    from them: it would drop the biases written, or initialise the ones not written afresh. The family is
    the translation's by name, else (tensors already under Hugging Face's names) ``config``'s ``model_type``.
    Llama: :data:`smpckpt.hf.llama.BIAS_FIELDS` as ``config`` sets them (a field it lacks is transformers'
    default, off); Qwen2: :data:`smpckpt.hf.qwen2.BIASES`, always; no family holds its translation's
    ``absent`` tensors (checked here too for an export without a translation), nor an adapter's state (a
    translation refuses it itself; without one, a ``config`` makes the artifact a Hugging Face folder)."""
    get = config.get if isinstance(config, Mapping) else lambda name: getattr(config, name, None)
    name = translation.name if translation is not None else (str(get("model_type")) if config is not None else "")
    family = TRANSLATIONS.get(name)
    keys = dict.fromkeys(artifact_keys)  # a set in the order written, for messages
    known = family if family is not None else TRANSLATIONS.get(str(get("model_type"))) if config is not None else None
    if known is not None:
        # adapter state under any module: a family smpckpt knows has no such modules. A model of one's own may
        # build PEFT's in its __init__ (Phi-4-multimodal) and read them back: its family is its own (rev70b M1)
        who = (
            f"translation {name!r}: "
            if translation is not None
            else "hf_config makes the artifact a Hugging Face folder, but "
        )
        refuse_adapters(keys, who)
    layers = sorted({int(m.group(1)) for k in keys if (m := re.match(r"model\.layers\.(\d+)\.", k))})
    if family is None:
        return
    if layers:
        _check_llama_family(translation, family, name, get if config is not None else None, layers, keys)
    absent = [k for k in keys if family.is_absent(k)]
    if translation is None and absent:  # a translation refuses them itself (check_translates)
        raise SpecError(
            f"hf_config is a {name!r} config, but a {family.architecture} has no tensors {_show(absent)}: "
            "from_pretrained would drop them. Is the model of another family (a Llama with attention_bias or "
            "mlp_bias is 'llama')? Otherwise leave them out"
        )


def _check_llama_family(
    translation: Translation | None,
    family: Translation,
    name: str,
    get: Callable[[str], Any] | None,
    layers: Sequence[int],
    keys: Mapping[str, None],
) -> None:
    """:func:`check_config_tensors`' part for the Llama family's layers (``get``: the config's fields, or
    ``None`` without a config)."""
    fused = list(_stranded(family, list(keys), {}, "ours")) if translation is None else []
    if fused:  # our fused names under a config of the family: the translation was forgotten (rev69h M1)
        raise SpecError(
            f"the tensors written hold {_show(fused)}, smpckpt's fused names, which a {family.architecture} has "
            f"no module for (from_pretrained would initialise those weights afresh): export with translation="
            f"smpckpt.hf.{name}.TRANSLATION"
        )
    # (what says so, the modules of each layer with a bias, whether they have one, what to do)
    wanted: list[tuple[str, tuple[str, ...], bool, str]] = []
    if name == "llama" and get is not None:
        for field, modules in llama.BIAS_FIELDS.items():
            on = bool(get(field))
            wanted.append(
                (f"hf_config has {field}={on}", modules, on, f"Pass the model's own config ({field}={not on})")
            )
    elif name == "qwen2":
        llama_hint = "A model without them is a Llama: export it with smpckpt.hf.llama's translation and its config"
        wanted.append((f"a {family.architecture} always has q/k/v biases", qwen2.BIASES, True, llama_hint))
    for why, modules, on, hint in wanted:
        wrong = [f"model.layers.{i}.{m}.bias" for i in layers for m in modules]
        wrong = [k for k in wrong if (k in keys) is not on]
        if wrong:
            raise SpecError(
                f"{why}, but the tensors written {'lack' if on else 'hold'} {_show(wrong)}: from_pretrained would "
                f"{'initialise them afresh' if on else 'drop them'}. {hint}"
            )


def _show(keys: Sequence[str]) -> str:
    """The first keys of ``keys`` by name, and how many more."""
    return ", ".join(repr(k) for k in keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")

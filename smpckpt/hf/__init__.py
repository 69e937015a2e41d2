"""Hugging Face interop: translation between HF state dicts and our tensor-parallel layouts.

One module per family (gpt2, bert, roberta, gptj, gptneo: the five smp translated, with smp's function
names as aliases; llama, qwen2, mistral), each with ``TRANSLATION``, the eager
``translate_hf_state_dict_to_smpckpt`` / ``translate_state_dict_to_hf`` and ``tp_specs(tp, config,
prefix="")``, as the README's "Hugging Face families" describes them (tied heads, dropped buffers, fused
tensors in a view that reshards); :data:`TRANSLATIONS` and the wrong-family rule: :mod:`smpckpt.hf._family`.
Nothing here imports transformers: configs are read by attribute or dict key."""

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from smpckpt.errors import SpecError
from smpckpt.hf import bert, gpt2, gptj, gptneo, llama, mistral, qwen2, roberta
from smpckpt.hf._family import TRANSLATIONS, as_is_judge, check_config, check_translation, translation_for
from smpckpt.model.translation import Translation, _stranded, refuse_adapters

__all__ = ["gpt2", "bert", "roberta", "gptj", "gptneo", "llama", "qwen2", "mistral", "TRANSLATIONS", "translation_for"]
__all__ += ["check_translation", "check_config", "check_config_tensors", "as_is_judge"]


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

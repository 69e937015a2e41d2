"""Hugging Face interop: translation between HF state dicts and our tensor-parallel layouts.

One module per model family -- :mod:`~smpckpt.hf.gpt2`, :mod:`~smpckpt.hf.bert`,
:mod:`~smpckpt.hf.roberta`, :mod:`~smpckpt.hf.gptj`, :mod:`~smpckpt.hf.gptneo` (the five SageMaker smp
translated), :mod:`~smpckpt.hf.llama`, :mod:`~smpckpt.hf.qwen2` and :mod:`~smpckpt.hf.mistral` -- each with:

* ``TRANSLATION`` -- a :class:`smpckpt.model.translation.Translation` (lazy region-mapping rules, for reading
  a rank's shard straight out of an HF file or writing HF-shaped tensors from each rank's chunk; it names
  the family's tied heads and its transformers class);
* ``translate_hf_state_dict_to_smpckpt(state_dict)`` / ``translate_state_dict_to_hf(state_dict)`` --
  eager, bit-exact translation of whole (unsharded) state dicts;
* ``tp_specs(tp, config, prefix="")`` -- glob -> :class:`smpckpt.model.specs.ShardSpec` rules of our layout
  (written against the model's own names; the API also matches them under ``model.``);
* for the smp families, smp's own function names as aliases (``translate_state_dict_to_hf_gpt2``,
  ``translate_hf_state_dict_to_smdistributed_gpt2``, ...): a migration changes only the import.

:data:`TRANSLATIONS` maps HF's ``config.model_type`` to each family's translation. Nothing here imports
transformers: configs are read by attribute or dict key.
"""

from smpckpt.hf import bert, gpt2, gptj, gptneo, llama, mistral, qwen2, roberta
from smpckpt.model.translation import Translation

__all__ = ["gpt2", "bert", "roberta", "gptj", "gptneo", "llama", "qwen2", "mistral", "TRANSLATIONS", "translation_for"]

#: HF ``config.model_type`` -> translation.
TRANSLATIONS: dict[str, Translation] = {
    mod.TRANSLATION.name: mod.TRANSLATION for mod in (gpt2, bert, roberta, gptj, gptneo, llama, qwen2, mistral)
}

#: module names that differ from the model_type (smp's import path is ``...huggingface.gptneo``)
_MODULE_NAMES = {"gptneo": "gpt_neo"}


def translation_for(name: str) -> Translation:
    """The translation of a family by ``config.model_type`` (``"gpt_neo"``) or module name (``"gptneo"``)."""
    found = TRANSLATIONS.get(_MODULE_NAMES.get(name, name))
    if found is None:
        raise KeyError(f"no Hugging Face translation for {name!r}; known: {sorted(TRANSLATIONS)}")
    return found

"""Hugging Face interop: translation between HF state dicts and our tensor-parallel layouts.

One module per model family (:mod:`~smpckpt.hf.gpt2`, :mod:`~smpckpt.hf.llama`, :mod:`~smpckpt.hf.qwen2`),
each with:

* ``TRANSLATION`` -- a :class:`smpckpt.translation.Translation` (lazy region-mapping rules, for reading
  a rank's shard straight out of an HF file or writing HF-shaped tensors from each rank's chunk);
* ``translate_hf_state_dict_to_smpckpt(state_dict)`` / ``translate_state_dict_to_hf(state_dict)`` --
  eager, bit-exact translation of whole (unsharded) state dicts;
* ``tp_specs(tp, config)`` -- glob -> :class:`smpckpt.specs.ShardSpec` rules of our layout.

Nothing here imports transformers: configs are read by attribute or dict key.
"""

from smpckpt.hf import gpt2, llama, qwen2
from smpckpt.translation import Translation

__all__ = ["gpt2", "llama", "qwen2", "TRANSLATIONS"]

#: HF ``config.model_type`` -> translation.
TRANSLATIONS: dict[str, Translation] = {
    "gpt2": gpt2.TRANSLATION,
    "llama": llama.TRANSLATION,
    "qwen2": qwen2.TRANSLATION,
}

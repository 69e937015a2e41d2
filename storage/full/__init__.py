"""The full artifact: one consolidated, Hugging Face-shaped safetensors (or torch.save) checkpoint, gathered
from every rank's shards; its options, layout, gather, writers, commit marker and reader
(``FullArtifactWriter``, ``FullArtifactReader``).

May import: ``smpckpt.storage.format``, ``smpckpt.storage.backends``, ``smpckpt.storage.write`` (the writer base
and failed-save clean-up both writers share), ``smpckpt.model``, ``smpckpt.errors``.
"""

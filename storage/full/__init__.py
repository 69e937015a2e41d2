"""The full artifact: one consolidated, Hugging Face-shaped safetensors (or torch.save) checkpoint, gathered
from every rank's shards; its options, layout, gather, writers, commit marker and reader.

May import: ``smpckpt.storage.format``, ``smpckpt.storage.backends``, ``smpckpt.storage.write`` (the shared
failed-save clean-up), ``smpckpt.model``, ``smpckpt.errors``.
"""

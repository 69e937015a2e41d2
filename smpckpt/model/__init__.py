"""The model layer: how ranks hold tensors and what the checkpoint calls them.

Layouts (``layout``), shard specs (``specs``), pipeline renaming (``naming``), the layout record stored in
every checkpoint (``record``), reserved keys (``keys``) and Hugging Face translation rules
(``translation``). Pure data and arithmetic: may import ``smpckpt.errors`` only, never storage or I/O.
"""

"""The model layer: how ranks hold tensors and what the checkpoint calls them.

Layouts, pipeline renaming, the layout record stored in every checkpoint and reserved keys (``layout``),
shard specs and optimizer state's pairing with its parameter, under a name_map too (``specs``), and Hugging Face
translation rules (``translation``). Pure data and arithmetic: may import ``smpckpt.errors`` only, never
storage or I/O."""

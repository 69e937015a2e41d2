"""The model layer: how ranks hold tensors and what the checkpoint calls them.

Layouts, pipeline renaming, the layout record stored in every checkpoint and reserved keys (``layout``),
shard specs (``specs``), what a name_map does to a resume's judgements (``_name_map``) and Hugging Face
translation rules (``translation``). Pure data and arithmetic: may import ``smpckpt.errors`` only, never
storage or I/O."""

"""The partial storage plugin's read side: ``FsspecStorageReader`` -- planned ranged reads with checksum
verification, and ``verify``'s read plan.

May import: ``smpckpt.storage.format``, ``smpckpt.storage.backends``, ``smpckpt.storage.full`` (to read
a full artifact), ``smpckpt.model``, ``smpckpt.errors``.
"""

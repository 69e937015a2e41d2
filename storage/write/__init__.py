"""The partial storage plugin's write side: ``FsspecStorageWriter`` -- every rank writes its own shards
into its own data files; the coordinator commits the manifest.

May import: ``smpckpt.storage.format``, ``smpckpt.storage.backends``, ``smpckpt.errors``.
"""

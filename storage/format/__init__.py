"""The on-disk format both products share: file names, the commit manifest, ``.metadata`` (de)serialisation,
checksums over blocks, tensor bytes and byte ranges, reading a folder's committed state, and staging: the
device stage every save and load copies tensor bytes through (``_staging``).

May import: ``smpckpt.errors``, ``smpckpt.model.layout``, ``smpckpt.storage.backends``.
"""

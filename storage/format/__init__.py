"""The on-disk format both products share: file names, the commit manifest, ``.metadata`` (de)serialisation,
checksums over blocks, tensor bytes and byte ranges, and reading a folder's committed state.

May import: ``smpckpt.errors``, ``smpckpt.model.layout``, ``smpckpt.storage.backends``.
"""

"""Offline tools over committed checkpoints: the ``smpckpt`` CLI, ``consolidate`` and ``convert``.

May import every other room; nothing imports it except ``smpckpt/__init__`` and ``__main__``.
"""

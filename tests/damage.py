"""Damage a file in place, as a bad disk or a partial overwrite would (shared by the corruption tests)."""

from __future__ import annotations

import os

__all__ = ["flip_byte"]


def flip_byte(path: str | os.PathLike[str], offset: int, mask: int = 0x40) -> None:
    """XOR the byte at ``offset`` of ``path`` with ``mask`` (never 0: the byte must change)."""
    if not mask & 0xFF:
        raise ValueError("mask must change the byte")
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        if len(b) != 1:
            raise ValueError(f"{path}: no byte at offset {offset}")
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))

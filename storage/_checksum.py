"""Block checksums of data files (xxh3-64 from the C-accelerated ``xxhash`` package).

Files are cut into blocks so a ranged read verifies only the blocks it touches. Block boundaries are
recorded explicitly (as block end offsets) because a new block starts at the beginning of every large
item: an item's byte range then starts on a block boundary, and the dim-0 slices a resharding load
reads usually end on one too, so verification adds little or nothing to the bytes read.
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash

__all__ = ["ALGORITHM", "DEFAULT_BLOCK_SIZE", "BlockHasher", "hash_bytes", "hash_parts"]

#: The checksum algorithm's name as the manifest records it (and names its digest fields after).
ALGORITHM = "xxh3_64"
DEFAULT_BLOCK_SIZE = 1 << 20


def hash_bytes(data: bytes | bytearray | memoryview) -> int:
    """xxh3-64 of ``data`` (the GIL is released for large buffers, so this overlaps with I/O)."""
    return xxhash.xxh3_64_intdigest(data)


def hash_parts(parts: Iterable[bytes | bytearray | memoryview]) -> int:
    """xxh3-64 of the concatenation of ``parts`` (equal to :func:`hash_bytes` of the joined bytes)."""
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return h.intdigest()


class BlockHasher:
    """Streams a file's bytes into fixed-size blocks and records (end offset, digest) per block.

    Not thread-safe: feed one file's bytes in order from one thread.
    """

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.ends: list[int] = []
        self.digests: list[int] = []
        self._pos = 0
        self._fill = 0
        self._h = xxhash.xxh3_64()

    def start_item(self, nbytes: int) -> None:
        """Called before an item's bytes: an item of at least one block starts a fresh block."""
        if nbytes >= self.block_size and self._fill:
            self._cut()

    def update(self, data: memoryview) -> None:
        mv = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        i, n = 0, len(mv)
        while i < n:
            take = min(self.block_size - self._fill, n - i)
            if take == self.block_size:
                # whole block: one-shot digest, no streaming state
                self.digests.append(xxhash.xxh3_64_intdigest(mv[i : i + take]))
                self._pos += take
                self.ends.append(self._pos)
            else:
                self._h.update(mv[i : i + take])
                self._fill += take
                self._pos += take
                if self._fill == self.block_size:
                    self._cut()
            i += take

    def _cut(self) -> None:
        self.digests.append(self._h.intdigest())
        self.ends.append(self._pos)
        self._h.reset()
        self._fill = 0

    def finish(self) -> tuple[list[int], list[int]]:
        """Close the last partial block; returns (block end offsets, digests)."""
        if self._fill:
            self._cut()
        return self.ends, self.digests

"""Where a storage writer or reader points: the part of DCP's storage protocol both share."""

from __future__ import annotations

import os
from typing import Any

from smpckpt.storage.backends._fs import open_fs, supports_url

__all__ = ["FsspecLocation"]


class FsspecLocation:
    """A checkpoint folder as URL, fsspec filesystem and path. ``reset`` re-points it (keeping the
    ``storage_options``) and calls ``_open`` so the subclass forgets its per-checkpoint state."""

    storage_options: dict[str, Any]
    url: str
    fs: Any
    path: str

    def _open(self, path: str | os.PathLike[str]) -> None:
        self.url = os.fspath(path)
        self.fs, self.path = open_fs(self.url, self.storage_options)

    @property
    def checkpoint_id(self) -> str:
        return self.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return supports_url(checkpoint_id)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """(all ranks) Point at ``checkpoint_id`` (keeping storage_options) and forget the last save/load."""
        self._open(checkpoint_id if checkpoint_id else self.url)

"""Key prefixes for data files: where inside the checkpoint folder each data file goes.

Object stores scale request rates per key prefix (S3: about 3,500 writes / 5,500 reads per second per
partitioned prefix). A large save -- thousands of ranks, several files each, all under one folder --
would concentrate on one prefix until the store splits it. A prefix strategy puts each data file one
folder level down, ``<folder>/<prefix>/<name>``, with prefixes that differ in their *first* character
between neighbouring files, so the save starts out spread.

The checkpoint stays self-describing: the prefix is part of the file's recorded name (``relative_path``
in the metadata, ``name`` in the manifest), so readers, ``verify_checkpoint``, ``remove_checkpoint``,
overwrite clean-up and consolidation follow the recorded names and need no strategy. Every object stays
under the checkpoint's folder (design notes 5: entropy right after the folder, never before it).

The numeric strategies compute the same prefixes as s3torchconnector's ``HexPrefixStrategy`` /
``BinaryPrefixStrategy`` (the index written in base 16 or 2, zero-padded, digits reversed so the
fastest-changing digit comes first; tests/storage/test_storage_prefixes.py checks them against the
installed s3torchconnector). They are ours rather than theirs because:

* s3torchconnector is not a dependency (the test extra installs it): it brings its Rust S3 client,
  and smpckpt reaches S3 through s3fs; a strategy is the one piece we would use from it.
* Theirs name a *rank's* files (``<prefix>/__<rank>_``, with the prefix count taken from
  ``torch.distributed`` when built); ours place each of a rank's several data files by its index in
  the whole save, are picklable and compared by value (the coordinator's instance travels with the
  plan), and check that a prefix is one plain folder name. Key names already written keep loading:
  readers follow the names recorded in the checkpoint, never a strategy.
"""

from __future__ import annotations

import abc
import re
from typing import Any, Literal

__all__ = [
    "PrefixStrategy",
    "PrefixOption",
    "FlatLayout",
    "NumericPrefixes",
    "HexPrefixes",
    "BinaryPrefixes",
    "resolve",
    "check_prefix",
]

# A prefix is one plain folder name: what _names.check_member_name accepts for a folder component.
_PREFIX_RE = re.compile(r"^[0-9A-Za-z_-]{1,64}$")


def check_prefix(prefix: str) -> str:
    """``prefix`` when it is ``""`` (no folder) or one plain folder name, else ``ValueError``."""
    if prefix and not (isinstance(prefix, str) and _PREFIX_RE.fullmatch(prefix)):
        raise ValueError(f"prefix {prefix!r} must be 1-64 characters of [0-9A-Za-z_-] (one folder level) or ''")
    return prefix


class PrefixStrategy(abc.ABC):
    """Decides the folder (``""``: none) of each data file of a save.

    Called on every rank, for each of its data files, with the file's index among all the save's files
    (``rank * files_per_rank + n``) and their count (``world_size * files_per_rank``). The coordinator's
    instance is sent to every rank with its plan, so all ranks use one configuration. Must be
    picklable and deterministic.
    """

    @abc.abstractmethod
    def prefix(self, file_index: int, file_count: int) -> str:
        """The folder name for file ``file_index`` of ``file_count`` (``""`` for none)."""

    def __call__(self, file_index: int, file_count: int) -> str:
        return check_prefix(self.prefix(file_index, file_count))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(vars(self).items()))))


class FlatLayout(PrefixStrategy):
    """Every data file directly in the checkpoint folder (the local-disk default). Their names still
    start with four hex characters of a hash, so keys differ right after the folder."""

    def prefix(self, file_index: int, file_count: int) -> str:
        return ""


class NumericPrefixes(PrefixStrategy):
    """``file_index % count`` in ``base``, zero-padded to the digits ``count`` needs (at least
    ``min_length``), digits reversed: neighbouring files differ in the first character.

    ``count=None`` gives every file of the save its own prefix (``file_count`` of them); a fixed
    ``count`` bounds the number of prefixes whatever the world size.
    """

    def __init__(self, base: int, count: int | None = None, *, min_length: int = 1) -> None:
        if base not in (2, 16):
            raise ValueError(f"base must be 2 or 16, got {base}")
        if count is not None and (not isinstance(count, int) or count < 1):
            raise ValueError(f"count must be a positive integer or None, got {count!r}")
        if not 1 <= min_length <= 64:
            raise ValueError(f"min_length must be 1..64, got {min_length}")
        self.base = base
        self.count = count
        self.min_length = min_length

    def prefix(self, file_index: int, file_count: int) -> str:
        count = self.count or max(1, file_count)
        spec = "b" if self.base == 2 else "x"
        width = max(len(format(count - 1, spec)), self.min_length)  # the digits the largest index needs
        return format(file_index % count, f"0{width}{spec}")[::-1]


class HexPrefixes(NumericPrefixes):
    """Hexadecimal prefixes (``0``..``f`` first): 16 prefixes per character."""

    def __init__(self, count: int | None = None, *, min_length: int = 1) -> None:
        super().__init__(16, count, min_length=min_length)


class BinaryPrefixes(NumericPrefixes):
    """Binary prefixes (``0``/``1`` per character), as s3torchconnector's ``BinaryPrefixStrategy``."""

    def __init__(self, count: int | None = None, *, min_length: int = 1) -> None:
        super().__init__(2, count, min_length=min_length)


PrefixOption = Literal["auto", "flat", "hex", "binary"] | PrefixStrategy


def resolve(option: Any, *, local: bool) -> PrefixStrategy:
    """The strategy for a writer's ``prefix_strategy`` option. ``"auto"``: flat on local/POSIX paths
    (the layout shared filesystems and tools expect), hex prefixes on object stores."""
    if isinstance(option, PrefixStrategy):
        return option
    named = {
        "auto": FlatLayout if local else HexPrefixes,
        "flat": FlatLayout,
        "hex": HexPrefixes,
        "binary": BinaryPrefixes,
    }
    if not isinstance(option, str) or option not in named:
        raise ValueError(f"prefix_strategy must be 'auto', 'flat', 'hex', 'binary' or a PrefixStrategy, got {option!r}")
    return named[option]()

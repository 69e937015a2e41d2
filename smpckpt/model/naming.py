"""Pipeline-parallel key renaming: stage-local keys to global (checkpoint) keys.

Renaming happens only when the layout records a partition (``pp_layers``) or a ``name_map`` is
given. The default rule rewrites the integer after a ``layers.`` path segment by the stage's layer
offset (``layers.<i>.`` -> ``layers.<i + offset>.``) and checks that ``i`` is one of the stage's
layers. Without a partition or a map, keys are taken as already global (torchtitan-style PP).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from smpckpt.errors import SpecError
from smpckpt.model.layout import ParallelLayout

__all__ = ["KeyMapper", "NameMap"]

NameMap = Callable[[str], str]

_LAYER = re.compile(r"(?:(?<=^)|(?<=\.))layers\.(\d+)(?=\.|$)")


class KeyMapper:
    """Maps one rank's local keys to global keys (and flatten paths alike)."""

    def __init__(self, layout: ParallelLayout, pp_rank: int, name_map: NameMap | None = None) -> None:
        self.layout = layout
        self.pp_rank = pp_rank
        self.name_map = name_map
        self.active = name_map is not None or layout.pp_layers is not None
        self._offset = layout.layer_offset(pp_rank)
        self._count = layout.pp_layers[pp_rank] if layout.pp_layers is not None else None

    def to_global(self, key: str) -> str:
        if not self.active:
            return key
        if self.name_map is not None:
            mapped = self.name_map(key)
            if not isinstance(mapped, str) or not mapped:
                raise SpecError(f"name_map returned {mapped!r} for key {key!r}; it must return a non-empty str")
            return mapped
        return _LAYER.sub(self._shift, key)

    def _shift(self, match: re.Match[str]) -> str:
        local = int(match.group(1))
        if self._count is not None and local >= self._count:
            raise SpecError(
                f"stage {self.pp_rank} holds {self._count} layers (pp_layers={self.layout.pp_layers}) "
                f"but the state dict has stage-local layer {local} ({match.string!r})"
            )
        return f"layers.{local + self._offset}"

    def global_path(self, local_path: tuple[object, ...], local_key: str, global_key: str) -> tuple[object, ...]:
        """Flatten path for ``global_key``: the elements both keys share, then the renamed rest.

        DCP records ``key -> path`` so tools can re-nest a flat checkpoint (``dcp_to_torch_save``).
        A renamed key keeps its unchanged leading path elements and holds the rest as one string.
        """
        if global_key == local_key:
            return local_path
        prefix: list[object] = []
        text = ""
        for element in local_path:
            candidate = f"{text}{element}."
            if global_key.startswith(candidate) and local_key.startswith(candidate):
                prefix.append(element)
                text = candidate
            else:
                break
        return (*prefix, global_key[len(text) :])

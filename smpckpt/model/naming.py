"""Pipeline-parallel key renaming: stage-local keys to global (checkpoint) keys.

Renaming happens only when the layout records a partition (``pp_layers``) or a ``name_map`` is
given. The default rule rewrites the integer after a ``layers.`` path segment by the stage's layer
offset (``layers.<i>.`` -> ``layers.<i + offset>.``) and checks that ``i`` is one of the stage's
layers. Without a partition or a map, keys are taken as already global (torchtitan-style PP).

The top-level keys :func:`~smpckpt.save_checkpoint` reserves in a checkpoint -- named here only.

Adding a reserved key means adding it here: the API builds its state dict, its rank-local globs and
its optional-key globs from this one object.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from types import MappingProxyType

from smpckpt._formats import API_RECORD, API_RECORD_V1, FULL_API_RECORD  # noqa: F401 - named here too (their old home)
from smpckpt.errors import SpecError
from smpckpt.model.layout import ParallelLayout

__all__ = [
    "KeyMapper",
    "NameMap",
    "ReservedKeys",
    "RESERVED",
    "OPTIM_STATE_PREFIX",
    "FULL_ARTIFACTS",
    "API_RECORD",
    "API_RECORD_V1",
    "FULL_API_RECORD",
]


@dataclasses.dataclass(frozen=True)
class ReservedKeys:
    model: str = "model"  #: model state (``model.<fqn>``)
    optim: str = "optim"  #: FQN-keyed optimizer state (``optim.state.<fqn>.<name>``)
    rng: str = "rng"  #: per-rank RNG states (``rng.rank<r>.<generator>``)
    user_content: str = "user_content"  #: rank 0's user_content, one weights-only object

    def rng_of(self, rank: int) -> str:
        """The sub-key holding ``rank``'s RNG states (under :attr:`rng`)."""
        return f"rank{rank}"

    @property
    def rank_local(self) -> tuple[str, ...]:
        """Globs of keys one rank holds for itself (never treated as replicas)."""
        return (f"{self.rng}.*", self.user_content)

    def optional(self, *, model: bool, optim: bool) -> tuple[str, ...]:
        """Globs of keys a load may skip: RNG states and user_content always; ``model``/``optim``
        parts when the caller passed no model or no optimizer."""
        globs = [f"{self.rng}.*", self.user_content]
        if not model:
            globs.append(f"{self.model}.*")
        if not optim:
            globs.append(f"{self.optim}.*")
        return tuple(globs)


RESERVED = ReservedKeys()
#: where FQN-keyed optimizer state lives (``get_state_dict`` with ``flatten_optimizer_state_dict=True``)
OPTIM_STATE_PREFIX = f"{RESERVED.optim}.state."
#: a full artifact's files: flattened-key prefix -> file stem, as Hugging Face names them
FULL_ARTIFACTS = MappingProxyType({f"{RESERVED.model}.": "model", OPTIM_STATE_PREFIX: "optimizer"})


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

"""The top-level keys :func:`~smpckpt.save_checkpoint` reserves in a checkpoint -- named here only.

Adding a reserved key means adding it here: the API builds its state dict, its rank-local globs and
its optional-key globs from this one object.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from smpckpt._formats import API_RECORD, API_RECORD_V1, FULL_API_RECORD  # noqa: F401 - named here too (their old home)

__all__ = ["ReservedKeys", "RESERVED", "OPTIM_STATE_PREFIX", "FULL_ARTIFACTS"]
__all__ += ["API_RECORD", "API_RECORD_V1", "FULL_API_RECORD"]


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

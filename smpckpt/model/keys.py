"""The top-level keys :func:`~smpckpt.save_checkpoint` reserves in a checkpoint -- named here only.

Adding a reserved key means adding it here: the API builds its state dict, its rank-local globs and
its optional-key globs from this one object.
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "ReservedKeys",
    "RESERVED",
    "API_RECORD",
    "API_RECORD_V1",
    "FULL_API_RECORD",
    "OPTIM_STATE_PREFIX",
    "FULL_ARTIFACTS",
]

#: ``manifest.extra["api"]`` of checkpoints written by :func:`smpckpt.save_checkpoint`. Version 2 stores
#: user_content as one ``torch.save`` record; version 1 (smpckpt 0.1.0) wrapped those bytes in a second
#: pickle, which resume still unwraps.
API_RECORD = "smpckpt.save_checkpoint/2"
API_RECORD_V1 = "smpckpt.save_checkpoint/1"
#: ``manifest.extra["api"]`` of full checkpoints (``save_checkpoint(partial=False)``). A format tag: it
#: does not follow module moves (``tests/test_golden.py`` pins every tag).
FULL_API_RECORD = "smpckpt.api.full/1"


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
FULL_ARTIFACTS = {f"{RESERVED.model}.": "model", OPTIM_STATE_PREFIX: "optimizer"}

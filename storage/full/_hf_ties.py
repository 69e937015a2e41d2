"""Tied heads of a plain Hugging Face folder: which keys ``save_pretrained`` left out because they are
another key's tensor (``lm_head.weight`` is ``transformer.wte.weight`` in GPT-2).

A model that holds the head apart (a pipeline's last stage; a TP layout built by hand) needs its values
from the embedding's bytes; a model that ties them in memory loads the embedding once either way
(:class:`~smpckpt.planners.ParallelLoadPlanner`). Which keys are tied comes from the translation the
load uses, else from the folder's ``config.json`` (its ``model_type`` names a family of
:mod:`smpckpt.hf`); a config that says ``"tie_word_embeddings": false`` ties nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

from smpckpt.model.translation import Translation
from smpckpt.storage.backends._fs import join

__all__ = ["hf_folder_ties"]

log = logging.getLogger(__name__)

#: a config.json larger than this is not read for its ties (real ones are a few KiB)
_MAX_CONFIG_BYTES = 1 << 20


def _config(fs: Any, path: str) -> dict[str, Any]:
    where = join(path, "config.json")
    try:
        raw = bytes(fs.cat_file(where, start=0, end=_MAX_CONFIG_BYTES + 1))
        if len(raw) > _MAX_CONFIG_BYTES:
            raise ValueError(f"over {_MAX_CONFIG_BYTES} bytes")
        found = json.loads(raw)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as exc:
        log.info("%s: not read for tied weights (%s)", where, exc)
        return {}
    return found if isinstance(found, dict) else {}


def hf_folder_ties(fs: Any, path: str, keys: Iterable[str], translation: Translation | None) -> dict[str, str]:
    """Head -> embedding key for each tied head the folder's tensors (``keys``) lack but whose
    embedding they hold; keys as the artifact names them (tied keys are never renamed)."""
    config = _config(fs, path)
    if config.get("tie_word_embeddings") is False:
        return {}
    if translation is None:
        from smpckpt.hf import TRANSLATIONS  # lazily: only folders with a config of a known family

        translation = TRANSLATIONS.get(str(config.get("model_type")))
        if translation is None:
            return {}
    return translation.missing_ties(keys)

"""File names and format constants of an smpckpt checkpoint folder (pure functions, no I/O).

A committed checkpoint folder holds::

    <folder>/smpckpt.manifest.json          # commit marker, written last (JSON, see manifest.py)
    <folder>/.metadata                      # pickled DCP Metadata (stock readers look here)
    <folder>/.metadata.<save_id>            # the same bytes under a per-generation name (our reader)
    <folder>/<e4>_r<rank>_<n>.<save_id>.smp.distcp   # data files, one generation per save

``<e4>`` is four hex characters of a hash of the file's identity. It comes first in the object name so
object-store keys of one checkpoint spread over many key prefixes (S3 partitions by prefix); it sits
right after the folder so every object stays under the checkpoint's folder.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time

__all__ = [
    "MANIFEST_NAME",
    "METADATA_NAME",
    "RAW_DESCRIPTOR",
    "FORMAT_VERSION",
    "new_save_id",
    "data_file_name",
    "generation_metadata_name",
    "is_smpckpt_file",
]

MANIFEST_NAME = "smpckpt.manifest.json"
METADATA_NAME = ".metadata"
#: Transform descriptor recorded on raw tensor items. A stock DCP reader does not know it and fails
#: with ``ValueError: Unknown extension name='smpckpt.raw'`` instead of decoding garbage.
RAW_DESCRIPTOR = "smpckpt.raw/1"
#: Version of the manifest layout. Readers refuse manifests newer than they understand.
FORMAT_VERSION = 1

_DATA_RE = re.compile(r"^[0-9a-f]{4}_r\d+_\d+\.[0-9a-z]+\.smp\.distcp$")
_GEN_META_RE = re.compile(r"^\.metadata\.[0-9a-z]+$")
_SAVE_ID_RE = re.compile(r"^[0-9a-z]{8,40}$")


def new_save_id() -> str:
    """A fresh save id: time-ordered (hex milliseconds) then random, lowercase alphanumerics only."""
    return f"{int(time.time() * 1000):x}{secrets.token_hex(4)}"


def check_save_id(save_id: str) -> str:
    if not isinstance(save_id, str) or not _SAVE_ID_RE.match(save_id):
        raise ValueError(f"malformed save id {save_id!r}")
    return save_id


def data_file_name(save_id: str, rank: int, n: int) -> str:
    entropy = hashlib.blake2b(f"{save_id}/{rank}/{n}".encode(), digest_size=2).hexdigest()
    return f"{entropy}_r{rank}_{n}.{check_save_id(save_id)}.smp.distcp"


def generation_metadata_name(save_id: str) -> str:
    return f"{METADATA_NAME}.{check_save_id(save_id)}"


def is_smpckpt_file(name: str) -> bool:
    """True for a data or per-generation metadata file written by our writer (base name only)."""
    return bool(_DATA_RE.match(name) or _GEN_META_RE.match(name))

"""File names and format constants of an smpckpt checkpoint folder (pure functions, no I/O).

A committed checkpoint folder holds::

    <folder>/smpckpt.manifest.json          # commit marker, written last (JSON, see manifest.py)
    <folder>/.metadata                      # pickled DCP Metadata (stock readers look here)
    <folder>/.metadata.<save_id>            # the same bytes under a per-generation name (our reader)
    <folder>/[<prefix>/]<e4>_r<rank>_<n>.<save_id>.smp.distcp   # data files, one generation per save

``<e4>`` is four hex characters of a hash of the file's identity. It comes first in the object name so
object-store keys of one checkpoint spread over many key prefixes (S3 partitions by prefix); it sits
right after the folder so every object stays under the checkpoint's folder. ``<prefix>/`` is the
optional folder a prefix strategy puts the file in (``_prefixes.py``; object stores by default); it is
part of the file's recorded name, so nothing else needs to know the strategy.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import time

from smpckpt._formats import FORMAT_VERSION, RAW_DESCRIPTOR  # noqa: F401 - named here too (their old home)
from smpckpt.storage.backends._folder import is_temp_name  # noqa: F401 - the names' owner is the folder that makes them
from smpckpt.storage.backends._fs import _PREFIX_RE, check_prefix

__all__ = [
    "MANIFEST_NAME",
    "REMOVING_NAME",
    "WRITING_MARKER",
    "DESCRIPTION_FQN",
    "METADATA_NAME",
    "RAW_DESCRIPTOR",
    "LOAD_ID_PREFIX",
    "FORMAT_VERSION",
    "new_save_id",
    "data_file_name",
    "generation_metadata_name",
    "is_smpckpt_file",
    "check_member_name",
    "marker_owner",
    "STAGING_PREFIX",
    "TRASH_PREFIX",
    "staging_name",
    "is_staging_name",
    "is_temp_name",
    "unfinished_full_save",
]

MANIFEST_NAME = "smpckpt.manifest.json"
#: Written by remove_checkpoint before it deletes anything: a folder holding it is being (or was
#: partly) removed on purpose, never a save in flight, so a later retention may finish the job.
REMOVING_NAME = "smpckpt.removing"
#: (object stores) Created exclusively by the coordinator before any rank writes a full artifact's
#: fixed-name files, removed after the commit: a folder with it and no manifest is an unfinished save,
#: never a Hugging Face folder. Its body is ``<save id>``. (POSIX full saves write a staging folder
#: instead, :data:`STAGING_PREFIX`; older versions wrote this marker there too.)
WRITING_MARKER = "smpckpt.writing"
#: (POSIX) A full save writes its artifact into ``.smpckpt-staging.<save id>`` beside its target folder and
#: renames it into place at the commit (no replace): a reader of the target never sees an unfinished or
#: mixed artifact. A staging folder left by a killed save is debris for ``prune``; it blocks nothing.
STAGING_PREFIX = ".smpckpt-staging."
#: (POSIX) A removal renames a staging folder to ``.smpckpt-trash.<hex>`` before deleting it (its own
#: name: a commit can no longer publish it); one left by a killed removal is garbage for ``prune``.
TRASH_PREFIX = ".smpckpt-trash."
METADATA_NAME = ".metadata"
#: Key in ``Metadata.storage_data`` under which a full artifact's description (JSON) is stored.
DESCRIPTION_FQN = "\x00smpckpt.full"
#: Set in ``Metadata.planner_data`` (at load time, never stored) by our reader when every tensor is one
#: whole row-major block (full artifacts, Hugging Face folders): a planner may read it in another shape
#: of the same size (a fused ``[3h, d]`` as the view ``[3, h, d]``).
WHOLE_TENSORS = "smpckpt.whole_tensors"
#: Prefix of the ``StorageMeta.load_id`` our reader sets, so a planner can tell it from a stock reader.
LOAD_ID_PREFIX = "smpckpt-"

_DATA_RE = re.compile(r"^(?:[0-9A-Za-z_-]{1,64}/)?[0-9a-f]{4}_r\d+_\d+\.[0-9a-z]+\.smp\.distcp$")
# folder components (each one _PREFIX_RE) a recorded file name may have before its base name: prefix
# strategies (ours, one level; s3torchconnector's, up to two: "<prefix>/epoch_<n>/__0_0.distcp")
_MAX_FOLDERS = 2
_GEN_META_RE = re.compile(r"^\.metadata\.[0-9a-z]+$")
_SAVE_ID_RE = re.compile(r"^[0-9a-z]{8,40}$")


def new_save_id() -> str:
    """A fresh save id: time-ordered (hex milliseconds) then random, lowercase alphanumerics only."""
    return f"{int(time.time() * 1000):x}{secrets.token_hex(4)}"


def check_save_id(save_id: str) -> str:
    if not isinstance(save_id, str) or not _SAVE_ID_RE.match(save_id):
        raise ValueError(f"malformed save id {save_id!r}")
    return save_id


def data_file_name(save_id: str, rank: int, n: int, prefix: str = "") -> str:
    """The recorded name of data file ``n`` of ``rank``: ``[<prefix>/]<e4>_r<rank>_<n>.<save_id>.smp.distcp``."""
    entropy = hashlib.blake2b(f"{save_id}/{rank}/{n}".encode(), digest_size=2).hexdigest()
    name = f"{entropy}_r{rank}_{n}.{check_save_id(save_id)}.smp.distcp"
    return f"{check_prefix(prefix)}/{name}" if prefix else name


def generation_metadata_name(save_id: str) -> str:
    return f"{METADATA_NAME}.{check_save_id(save_id)}"


def is_smpckpt_file(name: str) -> bool:
    """True for a data or per-generation metadata file written by our writer (recorded name: base name,
    with its prefix folder for data files)."""
    return bool(_DATA_RE.match(name) or _GEN_META_RE.match(name))


def staging_name(save_id: str) -> str:
    """The staging folder of a full save (:data:`STAGING_PREFIX`)."""
    return f"{STAGING_PREFIX}{check_save_id(save_id)}"


def is_staging_name(name: str) -> bool:
    return name.startswith(STAGING_PREFIX) and bool(_SAVE_ID_RE.match(name[len(STAGING_PREFIX) :]))


def unfinished_full_save(names: set[str]) -> bool:
    """Whether a folder's base ``names`` (it has no manifest) are those of an unfinished save of ours: its
    in-progress marker (object stores; older versions on POSIX too), a temporary of that marker (a kill
    between its write and its link), or the mark of an interrupted removal."""
    return bool(names & {WRITING_MARKER, REMOVING_NAME}) or any(
        n.startswith(f"{WRITING_MARKER}.") and is_temp_name(n) for n in names
    )


def marker_owner(data: bytes | None) -> str | None:
    """The save id a :data:`WRITING_MARKER` body names (its first line; markers before the refresh held only it)."""
    if data is None:
        return None
    return data.split(b"\n", 1)[0].decode("utf-8", "replace")


def check_member_name(name: object, *, where: str) -> str:
    """``name`` if it is a plain file name that stays inside its checkpoint folder, else raise
    :class:`~smpckpt.errors.UnsafeCheckpoint` naming ``where`` (the manifest or metadata that held it).

    A name may start with up to two folder components of ``[0-9A-Za-z_-]`` (the prefixes of prefix
    strategies: ``3/e1f0_r0_0...``, s3torchconnector's ``0000000000/__0_0.distcp``); nothing else may
    hold a separator, so no name climbs out of the folder.

    Every file name read from a checkpoint (manifest entries, the metadata's ``relative_path``) goes
    through here before anything is read or deleted: a crafted ``../../victim`` must never reach the
    filesystem.
    """
    from smpckpt.errors import UnsafeCheckpoint

    base = name
    if isinstance(name, str) and "/" in name:
        *folders, base = name.split("/")
        if len(folders) > _MAX_FOLDERS or not all(_PREFIX_RE.fullmatch(f) for f in folders):
            base = None  # refused below
    ok = (
        isinstance(base, str)
        and isinstance(name, str)
        and 0 < len(base) <= 255
        and len(name) <= 400
        and base not in (".", "..")
        and "/" not in base
        and "\\" not in name
        and (os.sep == "/" or os.sep not in name)
        and not any(ord(c) < 0x20 or ord(c) == 0x7F for c in name)
    )
    if not ok:
        raise UnsafeCheckpoint(
            f"{where}: file name {str(name)[:100]!r} is not a plain name inside the checkpoint folder; "
            "refusing the checkpoint (crafted or corrupt)"
        )
    return name  # type: ignore[return-value]

"""Tags, folder names and the ``newest`` file of an smp-style checkpoint root (no torch, no dist).

Layout under a checkpoint root ``path`` (smp's structure)::

    {path}/newest                  # text: the tag of the newest committed checkpoint (rank 0 writes it)
    {path}/{tag}_partial/          # one partial (per-rank shards) checkpoint: a committed DCP folder
    {path}/{tag}                   # full checkpoint artefact          (reserved: full mode, later issue)
    {path}/user_content_{tag}      # user content of a full checkpoint (reserved: full mode, later issue)

Everything here works on an fsspec filesystem plus a plain ``str`` path (URLs keep their scheme), and
never trusts what it reads: the content of ``newest`` is validated exactly like a tag.

Checkpoints under a root are ordered by a sequence number in their manifests, never by clocks.

Every save through the API records ``extra["sequence"]``: one higher than the highest committed under
its root. Retention, a resume without a tag (and its fallback when ``newest`` is missing, stale or
unusable), ``smpckpt ls`` and the fast tier order checkpoints by it, then by save time, then by save id
(:func:`smpckpt.catalog.retention.record_order`). ``newest`` stays a hint for stock tools and a cheap
first guess; wall clocks only break ties among checkpoints written before sequence numbers existed
(smpckpt <= 0.2 manifests, stock DCP folders: sequence 0, so every sequenced checkpoint is newer).

Where a job's highest number comes from (a :class:`SequenceCounter`, which each
:class:`~smpckpt.Checkpointer` owns for its root): the listing a tag-less resume already makes;
otherwise, at its first save, one listing of the root (the same listing retention makes after every
save). After that each save counts on without I/O. A resume of an explicit tag (a roll-back) reads no
listing, so the next save lists the root and numbers past every checkpoint there, the abandoned run's
included: retention then removes those first. Two jobs (or two Checkpointers) saving into one root at
the same time may draw the same number; ties fall back to the save time.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

from smpckpt.errors import CheckpointError
from smpckpt.storage import open_fs, write_bytes_atomic
from smpckpt.storage.backends._fs import translate_errors

__all__ = [
    "NEWEST_NAME",
    "PARTIAL_SUFFIX",
    "validate_tag",
    "is_valid_tag",
    "partial_dirname",
    "tag_of_partial_dirname",
    "join_url",
    "partial_url",
    "read_newest",
    "write_newest",
    "list_partial_tags",
    "open_root",
    "SEQUENCE_KEY",
    "sequence_of",
    "SequenceCounter",
]


log = logging.getLogger(__name__)

NEWEST_NAME = "newest"
PARTIAL_SUFFIX = "_partial"
#: ``newest`` is a one-line text file; anything larger is not ours and is not read whole.
_NEWEST_MAX_BYTES = 4096
#: Longest tag in UTF-8 bytes: ``{tag}_partial`` must fit one path component (255 bytes on common
#: filesystems) with room to spare; checked up front so a long tag never fails half-way through a save.
_MAX_TAG_BYTES = 200
#: Characters a tag may hold besides letters and digits. Deliberately no glob characters (``* ? [ ] { } !``),
#: no separators, no spaces: a tag ends up in fsspec calls and S3 keys, and some backends expand globs.
_TAG_PUNCTUATION = frozenset("._-+=@,")


def validate_tag(tag: Any) -> str:
    """Return ``tag`` if it is usable as a checkpoint tag, else raise :class:`ValueError`.

    A tag names a folder (``{tag}_partial``) directly under the root. It is a non-empty ``str`` of
    letters and digits (Unicode ones too) and ``. _ - + = @ ,``, starting with a letter or digit,
    without ``..``, not ending in ``_partial`` (that suffix is the folder's, and ``smpckpt verify
    ROOT/TAG`` must resolve one way), at most 200 bytes in UTF-8. Everything else -- path separators,
    whitespace, control characters, and the glob characters ``* ? [ ] { } !`` that fsspec backends
    expand -- is refused on every backend alike, before anything is written.
    """
    if not isinstance(tag, str):
        raise ValueError(f"checkpoint tag must be a str, got {type(tag).__name__}")
    problem = _tag_problem(tag)
    if problem:
        raise ValueError(f"invalid checkpoint tag {tag[:80]!r}: {problem}")
    return tag


def _tag_problem(tag: str) -> str | None:
    if not tag:
        return "it is empty"
    bad = sorted({c for c in tag if not (c.isalnum() or c in _TAG_PUNCTUATION)})
    if bad:
        shown = "".join(bad[:10])
        return (
            f"it contains {shown!r}; a tag may hold only letters, digits and "
            f"{''.join(sorted(_TAG_PUNCTUATION))!r} (no path separators, whitespace, control or glob characters)"
        )
    if not tag[0].isalnum():
        return "it must start with a letter or digit"
    if ".." in tag:
        return "it contains '..'"
    if tag.endswith(PARTIAL_SUFFIX):
        return f"it ends in {PARTIAL_SUFFIX!r}, the suffix of partial checkpoint folders"
    size = len(tag.encode("utf-8"))
    if size > _MAX_TAG_BYTES:
        return f"it is {size} bytes long in UTF-8; at most {_MAX_TAG_BYTES} are allowed"
    return None


def is_valid_tag(tag: Any) -> bool:
    return isinstance(tag, str) and _tag_problem(tag) is None


def partial_dirname(tag: str) -> str:
    """``{tag}_partial``; ``tag`` was validated at the caller's edge (:func:`validate_tag`)."""
    return f"{tag}{PARTIAL_SUFFIX}"


def tag_of_partial_dirname(name: str) -> str | None:
    """``"step10_partial"`` -> ``"step10"``; ``None`` for names that are not a valid partial folder."""
    tag = name.removesuffix(PARTIAL_SUFFIX)
    return tag if tag != name and is_valid_tag(tag) else None


def join_url(root: str, name: str) -> str:
    """``root`` + ``/`` + ``name`` for local paths and URLs alike (``str`` concatenation keeps the scheme)."""
    root = os.fspath(root)
    return f"{root.rstrip('/')}/{name}" if root.rstrip("/") else f"/{name}"


def partial_url(root: str, tag: str) -> str:
    return join_url(root, partial_dirname(tag))


def read_newest(fs: Any, root_path: str) -> str | None:
    """The tag ``newest`` names, or ``None`` when it is missing, unreadable or not a valid tag.

    (Called on rank 0 only.) Problems are logged, never raised: the caller falls back to listing.
    """
    path = join_url(root_path, NEWEST_NAME)
    try:
        # a backend's own errors (botocore's EndpointConnectionError when S3 is down) as OSError naming
        # the object, like every storage call: the caller falls back to listing, whose failure is raised
        with translate_errors(path):
            data = fs.cat_file(path, start=0, end=_NEWEST_MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("could not read %s: %s", path, exc)
        return None
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError:
        log.warning("%s is not UTF-8 text; ignoring it", path)
        return None
    if len(data) > _NEWEST_MAX_BYTES:
        log.warning("%s is larger than %d bytes; ignoring it", path, _NEWEST_MAX_BYTES)
        return None
    tag = text.strip()
    if not is_valid_tag(tag):
        log.warning("%s holds %r, which is not a valid tag; ignoring it", path, tag[:80])
        return None
    return tag


def write_newest(fs: Any, root_path: str, tag: str, *, sync: bool = True) -> None:
    """(rank 0, after the checkpoint committed) Point ``newest`` at ``tag``: tmp + rename on POSIX,
    one PUT on object stores, so readers see the old or the new content, never a torn one. ``tag`` was
    validated at the caller's edge."""
    write_bytes_atomic(fs, join_url(root_path, NEWEST_NAME), f"{tag}\n".encode(), sync=sync)


def list_partial_tags(fs: Any, root_path: str) -> dict[str, str]:
    """``{tag: folder name}`` of every ``{tag}_partial`` entry under the root (committed or not).

    One LIST of the root (rank 0 only). A missing root gives ``{}``.
    """
    try:
        with translate_errors(root_path):
            entries = fs.ls(root_path, detail=True)
    except FileNotFoundError:
        return {}
    found: dict[str, str] = {}
    for entry in entries:
        # a tag folder moved to another disk and linked back is still a tag (fsspec types the link "other")
        if entry.get("type") != "directory" and not (entry.get("islink") and _is_dir(fs, entry["name"])):
            continue
        name = str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]
        tag = tag_of_partial_dirname(name)
        if tag is not None:
            found[tag] = name
    return found


def _is_dir(fs: Any, path: str) -> bool:
    with translate_errors(path):
        return bool(fs.isdir(path))


def open_root(url: str, storage_options: Any = None) -> tuple[Any, str]:
    """``(fs, path)`` of a checkpoint root (a thin alias, so callers need one import)."""
    try:
        return open_fs(url, storage_options)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from exc


#: the manifest ``extra`` entry holding a checkpoint's sequence number
SEQUENCE_KEY = "sequence"
_MAX = 2**62  # a damaged manifest's number must not push every later one out of range


def sequence_of(extra: Mapping[str, Any] | None) -> int:
    """The sequence number a manifest's ``extra`` records; 0 when it has none (older checkpoints) or it
    is not a plausible one (a bool, negative, or beyond 2**62: damage, ignored)."""
    value = (extra or {}).get(SEQUENCE_KEY)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX:
        return 0
    return value


class SequenceCounter:
    """The highest sequence number one root holds, as this job has seen or drawn it."""

    def __init__(self, root: str, storage_options: Any = None) -> None:
        self.root, self.storage_options = root, storage_options
        self._lock = threading.Lock()  # the save thread and the drain thread draw and note numbers
        self._highest = 0
        self._listed = False  #: every committed checkpoint of the root has been seen (a listing)

    def saw(self, seq: int, *, listed: bool = False) -> None:
        """A checkpoint numbered ``seq`` exists under the root; ``listed``: ``seq`` is the highest of a
        listing of the whole root (a later save need not list it again)."""
        with self._lock:
            if 0 <= seq < _MAX:
                self._highest = max(self._highest, seq)
            self._listed = self._listed or listed

    def next(self, scan: Callable[[], int] | None = None) -> int:
        """(rank 0) The sequence number of a new save. The first time the root was not listed, ``scan()``
        (default: the highest committed number a listing of the root finds) is read first, outside the lock."""
        if not self._listed:
            if scan is None:
                from smpckpt.catalog.retention import highest_sequence

                seen = highest_sequence(self.root, self.storage_options)
            else:
                seen = scan()
            self.saw(seen, listed=True)
        with self._lock:
            self._highest += 1
            return self._highest

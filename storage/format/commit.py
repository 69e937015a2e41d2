"""The one commit protocol, used by every kind of save (partial, full, fast-tier node copies, drains,
``convert``, ``consolidate``) and by every removal.

A save's files are created, never overwritten (``storage/backends/_folder.py``), under names no other
save uses: data files and ``.metadata.<save id>`` carry the save's id; a full artifact on POSIX is
written into ``.smpckpt-staging.<save id>`` beside the target, renamed into place by
:func:`publish_staged` without replacing anything. So a save that finds a file it did not create, or
that woke after another took over, fails instead of writing into the other's files.

The commit (:func:`commit`, or :func:`publish_staged`), in this order:

1. the generation's metadata and side files, created;
2. one listing: every file the manifest names is there at its size (:func:`check_named`);
3. the manifest, created exclusively, or for an overwrite replacing exactly the one the save saw (S3:
   ``If-Match``), after removing the old stock ``.metadata`` copy (put back if the swap fails); for a
   staged folder, the rename (``renameat2(RENAME_NOREPLACE)``);
4. no removal started meanwhile (:func:`remove_folder` marks first and then looks for a manifest; the
   commit writes its manifest and then looks for the mark: at least one sees the other);
5. the stock ``.metadata`` copy, then the previous generation's files (an overwrite).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from smpckpt.errors import CheckpointError, CheckpointExists
from smpckpt.storage.backends import _nofollow as nf
from smpckpt.storage.backends._folder import Folder
from smpckpt.storage.backends._fs import file_sizes, is_local, join, read_bytes_or_none
from smpckpt.storage.format.manifest import (
    MANIFEST_NAME,
    METADATA_NAME,
    REMOVING_NAME,
    TRASH_PREFIX,
    WRITING_MARKER,
    FileRecord,
    Manifest,
    marker_owner,
    probe,
)

__all__ = ["CommitUncertain", "commit_uncertain", "check_named", "check_files", "settle_uncommitted_folder", "commit"]
__all__ += ["publish_staged", "remove_folder", "remove_staged", "committed_save_id", "refuse_marked_overwrite"]
__all__ += ["generation_gone"]

log = logging.getLogger(__name__)


class CommitUncertain(CheckpointError):
    """The commit (the manifest's write) failed without telling whether it landed (an object store's timeout
    or dropped connection): nothing of that save is removed, it may be a committed checkpoint."""


def commit_uncertain(error: BaseException | None) -> bool:
    """Whether ``error`` (or DCP's ``CheckpointException`` of it) carries a :class:`CommitUncertain`."""
    if isinstance(error, CommitUncertain):
        return True
    failures = getattr(error, "failures", None) or {}
    return any(isinstance(f[0] if isinstance(f, tuple) else f, CommitUncertain) for f in failures.values())


def check_named(listing: Mapping[str, int | None], named: Mapping[str, int], url: str) -> None:
    """Refuse a commit naming a file that is missing or of another size (a link under its name counts as
    missing): the save would return OK with data gone (a prune with too short an age, a side file removed)."""
    bad = [
        f"{n} ({listing.get(n, 'missing')} bytes, {size} written)"
        for n, size in named.items()
        if listing.get(n) != size
    ]
    if bad:
        raise CheckpointError(
            f"{url}: {len(bad)} file(s) of this save are missing or cut short at the commit (or of another size): "
            f"{', '.join(bad[:5])}; nothing was committed. Did something remove files here during the save "
            "(a prune of uncommitted folders with too short an age)?"
        )


def check_files(fs: Any, path: str, url: str, files: Iterable[FileRecord]) -> None:
    """:func:`check_named` for ``files`` in the folder ``path`` (one listing; a fast-tier node's share)."""
    with Folder(fs, path) as folder:
        check_named(folder.listing(), {f.name: f.size for f in files}, url)


def settle_uncommitted_folder(fs: Any, path: str, url: str) -> None:
    """(coordinator, before a partial save into a folder with no committed checkpoint; two small reads, no
    listing) Refuse a folder holding a full save's in-progress marker (it may be running), and finish an
    interrupted removal first (a later prune would otherwise delete this save's files)."""
    marker = read_bytes_or_none(fs, join(path, WRITING_MARKER))
    if marker is not None:
        raise CheckpointExists(
            f"{url} holds an unfinished full save ({WRITING_MARKER} names save {marker[:40]!r}, no "
            f"{MANIFEST_NAME}): one running there, or one that failed or was killed. Save under "
            "another folder, or remove that one first (smpckpt.storage.remove_checkpoint)"
        )
    if read_bytes_or_none(fs, join(path, REMOVING_NAME)) is not None:
        log.warning("%s: finishing an interrupted removal before saving here", url)
        failed = remove_folder(fs, path, url)
        if failed:
            raise CheckpointError(f"{url}: could not finish the interrupted removal found here: {failed[:5]}")


def refuse_marked_overwrite(fs: Any, path: str, url: str) -> None:
    """(coordinator, before an overwrite writes anything) A committed checkpoint beside a removal's mark (a
    removal killed before its manifest delete, or one running): the overwrite's commit would withdraw at its
    look after every byte was written (rev65c F7): refused now, by name."""
    if read_bytes_or_none(fs, join(path, REMOVING_NAME)) is not None:
        raise CheckpointError(
            f"{url}: a removal of the checkpoint here was interrupted or is running ({REMOVING_NAME} is there): "
            "an overwrite would be withdrawn at its commit. Remove it first (smpckpt.storage.remove_checkpoint), "
            "or save under another tag"
        )


def committed_save_id(folder: Folder) -> str | None:
    """The save id of the manifest in ``folder`` (``None``: none, or unreadable)."""
    try:
        data = folder.read(MANIFEST_NAME)
        return Manifest.from_bytes(data).save_id if data is not None else None
    except (CheckpointError, OSError):
        return None


def generation_gone(fs: Any, path: str, url: str, manifest: Manifest, doing: str) -> CheckpointError | None:
    """(a file of the committed generation ``manifest`` missing) The error saying another save replaced it or a
    removal took it (no damage: ``doing`` again works; ``doing``: "load", "verify"); ``None`` when its manifest
    is still there, or its files were deleted by hand. A load and ``verify`` share it (hunt73b: verify reported
    such a checkpoint's files "missing", a false alarm of damage)."""
    names: set[str] = set()  # every file, prefix folders' too, as the store holds them now
    try:
        now = probe(fs, path).manifest
        if now is None:
            fs.invalidate_cache(path)
            with contextlib.suppress(FileNotFoundError):  # the folder gone whole
                names = set(file_sizes(fs, path))
    except Exception:  # noqa: BLE001 - the missing file's own report is the one to give
        return None
    if now is not None and now.save_id == manifest.save_id:
        return None
    # no manifest but files of the generation read (their names hold its save id, not their prefix folders
    # such as S3's `0/`: every generation's, rev64a F1; a file in one counts, rev64d F2), with no removal's
    # mark (set before the manifest goes, dropped after the last file) nor a full save's: deleted by hand
    read = {f.name for f in manifest.files} | {manifest.metadata.name}
    left = names & read
    if left and not names & {REMOVING_NAME, WRITING_MARKER}:
        return None
    if now is None and left and REMOVING_NAME in names:
        # files of the generation still there beside a removal's mark: a removal running now, or a stale mark (a
        # removal that crashed before its manifest delete leaves the checkpoint committed) and files deleted by
        # hand. Not told apart here: both said, never "not damaged" alone (rev73e 2)
        gone = sorted(read - names)
        return CheckpointError(
            f"{url} was removed, or damaged by hand, while this {doing} read it: {gone[:5]} gone, {sorted(left)[:5]} "
            f"still there beside a removal's mark ({REMOVING_NAME}: a removal running, or one that crashed before). "
            f"If no removal is running, the files were deleted by hand: the checkpoint is damaged"
        )
    what = "removed (retention, prune or another job)" if now is None else "replaced by another save (overwrite=True)"
    return CheckpointError(f"{url} was {what} while this {doing} read it (not damaged): {doing} again")


def _create_own(folder: Folder, url: str, files: Mapping[str, bytes], *, sync: bool) -> None:
    """Create this generation's small files (metadata, side files). A file already there with the same
    bytes is this save's own (a retried step); anything else refuses the commit."""
    for name, data in files.items():
        try:
            folder.create(name, data, sync=sync)
        except FileExistsError as exc:
            if folder.read(name) != data:
                raise CheckpointExists(
                    f"{url}: {name} exists and was not written by this save; refusing to commit over it"
                ) from exc


def _named(manifest: Manifest, expected: Sequence[FileRecord] | None) -> dict[str, int]:
    files = manifest.files if expected is None else expected
    return {f.name: f.size for f in files} | {manifest.metadata.name: manifest.metadata.size}


def commit(
    folder: Folder,
    url: str,
    manifest: Manifest,
    manifest_bytes: bytes,
    *,
    sync: bool,
    metadata: bytes | None = None,
    side: Mapping[str, bytes] | None = None,
    expected: Sequence[FileRecord] | None = None,
    write_manifest: Callable[[bytes], None] | None = None,
    stock_metadata: bytes | None = None,
    old_files: Iterable[str] = (),
    owner_marker: str | None = None,
    refused: str = "another save committed a checkpoint here while this one was writing",
    discard: Sequence[str] = (),
    replaces_committed: bool = False,
) -> None:
    """(coordinator) Commit ``manifest`` in place in ``folder`` (module docstring, steps 1-5).

    ``metadata``/``side``: created now (``None``: already written); ``expected``: the files to check
    (default: all the manifest names); ``write_manifest``: step 3 (default: created exclusively; the
    partial writer's replaces exactly the manifest it saw); ``owner_marker``: (object stores, full
    artifacts) the in-progress marker must still name this save id, removed after the commit;
    ``discard``: this save's files, removed when another save's commit refuses this one;
    ``replaces_committed``: the commit replaces a committed manifest of ours, whose stock ``.metadata``
    goes before the swap (:func:`_drop_stock_copy`)."""
    _create_own(folder, url, {manifest.metadata.name: metadata} if metadata is not None else {}, sync=sync)
    _create_own(folder, url, dict(side or {}), sync=sync)
    named = _named(manifest, expected) | {n: len(d) for n, d in (side or {}).items()}
    check_named(folder.listing(), named, url)
    if owner_marker is not None:
        marker = folder.read(WRITING_MARKER)
        if marker_owner(marker) != owner_marker:
            raise CheckpointExists(
                f"{url}: another save took this folder over while this one was writing (its "
                f"{WRITING_MARKER} names {marker!r}, not this save {owner_marker}); not committed"
            )
    if write_manifest is None:
        write_manifest = lambda data: folder.publish(MANIFEST_NAME, data, sync=sync)  # noqa: E731
    dropped = replaces_committed and stock_metadata is not None and _drop_stock_copy(folder, url)
    try:
        _write_manifest(folder, url, manifest, manifest_bytes, write_manifest, refused=refused, discard=discard)
    except CommitUncertain:
        raise  # which manifest will be in place is unknown: a copy put back now could describe the wrong one
    except BaseException:
        if dropped:
            _restore_stock_copy(folder, url)
        raise
    try:
        _unless_removing(folder, url, manifest, manifest_bytes, named | {MANIFEST_NAME: len(manifest_bytes)})
    except CheckpointExists:
        raise
    except OSError as exc:  # the manifest is in place: failing plainly would hide a commit
        raise CommitUncertain(
            f"{url}: the manifest was written, but whether a removal started meanwhile could not be checked "
            f"({type(exc).__name__}: {exc}); this save's files are kept: `smpckpt ls` tells whether it committed"
        ) from exc
    if owner_marker is not None and folder.remove([WRITING_MARKER]):
        log.warning("%s is committed; its %s marker could not be removed (harmless)", url, WRITING_MARKER)
    _after_commit(folder, url, manifest, stock_metadata, old_files, sync=sync)


def _drop_stock_copy(folder: Folder, url: str) -> bool:
    """(an overwrite, before the swap) Remove the stock ``.metadata`` copy: it describes the generation being
    replaced, so a crash after the swap would have stock DCP readers silently load the old generation;
    without it they fail loudly until step 5. Whether a copy was removed (a failure is logged)."""
    if not folder.exists(METADATA_NAME):
        return False
    failed = folder.remove([METADATA_NAME])
    if failed:
        log.warning("%s: the stock %s copy could not be removed before the overwrite: %s", url, METADATA_NAME, failed)
    return not failed


def _restore_stock_copy(folder: Folder, url: str) -> None:
    """(an overwrite whose swap failed, after :func:`_drop_stock_copy`) Put back the stock copy of whichever
    checkpoint is committed here, from that manifest's own metadata (the same bytes its step 5 writes)."""
    try:
        if folder.exists(METADATA_NAME):
            return
        data = folder.read(MANIFEST_NAME)
        if data is None:
            return
        name = Manifest.from_bytes(data).metadata.name
        stock = folder.read(name)
        if stock is not None:
            folder.publish(METADATA_NAME, stock, sync=True, replace=True)
    except (CheckpointError, OSError) as exc:
        log.warning(
            "%s: could not restore the stock %s copy of the checkpoint committed here: %s", url, METADATA_NAME, exc
        )


def _write_manifest(
    folder: Folder,
    url: str,
    manifest: Manifest,
    data: bytes,
    write: Callable[[bytes], None],
    *,
    refused: str,
    discard: Sequence[str],
) -> None:
    """Step 3. Refused by another save's manifest: ``CheckpointExists`` after removing ``discard`` (kept when
    no manifest could be read: :class:`CommitUncertain`); by this save's own (a retried conditional PUT that
    had landed): committed. Another failure on an object store:
    :class:`CommitUncertain`, but a 404 (the manifest an overwrite replaces removed meanwhile) is final; on POSIX
    and memory:// the folder tells whether the manifest landed."""
    try:
        write(data)
    except FileExistsError as exc:
        try:  # this save's files go only once a manifest naming another save was read (rev68c F1)
            found = folder.read(MANIFEST_NAME)
            other = Manifest.from_bytes(found).save_id if found is not None else None
        except (CheckpointError, OSError) as err:
            if not folder.local:
                raise CommitUncertain(
                    f"{url}: the commit was refused, and the manifest in place could not be read ({type(err).__name__}: "
                    f"{err}): this save's own (a request whose reply was lost) or another's; this save's files are "
                    "kept: `smpckpt ls` tells whether it committed"
                ) from exc
            # a refused link is certain on POSIX: the manifest in place (torn: another save's, mid-write) is not ours
            other, refused = (
                "",
                f"a manifest in place, unreadable ({err}), refused this commit; this save's files were removed",
            )
        if other == manifest.save_id:
            return
        if discard and other is None:
            raise CheckpointExists(
                f"{url}: the manifest in place refused this commit and was removed since (a prune, retention or "
                "remove_checkpoint ran meanwhile); nothing is committed here: save it again"
            ) from exc
        if discard:
            failed = folder.remove(discard)
            if failed:
                log.warning("could not remove %d file(s) of the refused save: %s", len(failed), failed[:5])
        raise CheckpointExists(f"{url}: {refused}") from exc
    except Exception as exc:
        store = not (folder.local or getattr(folder.fs, "protocol", None) in ("memory", ("memory",)))
        if store and isinstance(exc, FileNotFoundError):  # a 404 is final: this request did not land (rev66d F3)
            raise CheckpointError(
                f"{url}: the commit found no object where it expected one ({exc}): the checkpoint this save "
                "overwrites, or its folder, was removed while this save was committing (a prune, retention or "
                "remove_checkpoint); nothing is committed here: save it again"
            ) from exc
        if store:
            raise CommitUncertain(
                f"{url}: the commit request failed and may still land ({type(exc).__name__}: {exc}); this save's "
                "files are kept: `smpckpt ls` tells whether it committed"
            ) from exc
        if committed_save_id(folder) == manifest.save_id:
            raise CheckpointError(
                f"{url} is committed (its manifest is in place; it can be resumed by tag), but a step after the "
                f"commit failed ({type(exc).__name__}: {exc}), so it may not survive a power loss"
            ) from exc
        raise


def _unless_removing(folder: Folder, url: str, manifest: Manifest, data: bytes, named: Mapping[str, int]) -> None:
    """Step 4: a removal marked this folder meanwhile (a prune with too short an age, a retention of this
    tag): withdraw this commit (its manifest, if still this one) and fail, before reporting success. The
    mark first, then a listing of this save's files: a removal that finished in between (its mark gone last)
    has taken them, and the save fails too (hunt64b F1). In that order, whatever the listing's pages saw: no
    mark means no removal ran, or one that ended before the look, after every file it listed was gone."""
    said = "a removal of this folder (prune, retention or remove_checkpoint) started while this save was committing"
    if not folder.exists(REMOVING_NAME):
        listing = folder.listing()
        gone = [n for n, size in named.items() if listing.get(n) != size]
        if not gone and REMOVING_NAME not in listing:
            return
        if gone:  # a removal that finished, or another save's overwrite: nothing here is this save's whole
            other = committed_save_id(folder)
            said = f"{len(gone)} file(s) of this save went missing after its manifest landed ({', '.join(sorted(gone)[:3])})"
            if other not in (None, manifest.save_id):  # rev65a F3
                raise CheckpointExists(f"{url}: {said}: another save's commit (save {other}) replaced this one")
            said += ": a removal of this folder (prune, retention or remove_checkpoint) ran while it was committing"
    try:  # the mark was seen: a failure from here on is no uncertain commit (rev64e F3)
        left: bool | list[str] | str = folder.read(MANIFEST_NAME) == data and folder.remove([MANIFEST_NAME])
    except OSError as exc:
        left = f"{type(exc).__name__}: {exc}"
    if left:
        raise CheckpointError(
            f"{url}: {said}, and withdrawing this commit failed ({left}): its manifest may remain beside the "
            "removal's mark, listed as committed: remove the folder (smpckpt.storage.remove_checkpoint) first"
        )
    raise CheckpointError(f"{url}: {said}; the commit was withdrawn and nothing is committed here")


def _after_commit(
    folder: Folder, url: str, manifest: Manifest, stock: bytes | None, old_files: Iterable[str], *, sync: bool
) -> None:
    """Step 5 (failures are logged: the save is committed). The stock ``.metadata`` copy, written only now so
    the loser of a race never replaces the winner's; then the previous generation's files, if replaced."""
    if stock is not None:
        try:
            folder.publish(METADATA_NAME, stock, sync=sync, replace=True)
        except OSError as exc:
            log.warning(
                "%s is committed, but its stock .metadata copy could not be written (stock DCP readers cannot "
                "load it; smpckpt can): %s",
                url,
                exc,
            )
    keep = {f.name for f in manifest.files} | {manifest.metadata.name, METADATA_NAME, MANIFEST_NAME}
    stale = [n for n in dict.fromkeys(old_files) if n not in keep]
    if stale:
        failed = folder.remove(stale)
        if failed:
            log.warning("could not remove %d file(s) of the previous generation: %s", len(failed), failed[:5])


def publish_staged(
    parent: Folder,
    staging: str,
    target: str,
    url: str,
    manifest: Manifest,
    manifest_bytes: bytes,
    *,
    sync: bool,
    metadata: bytes | None,
    side: Mapping[str, bytes],
    refused: str,
) -> None:
    """(coordinator, POSIX) Commit the staged folder ``staging`` in ``parent`` (steps 1-3 inside it) and
    rename it into place as ``target``, replacing nothing (an empty ``target`` made beforehand is removed
    first). A folder already published there: :class:`CheckpointExists` (``refused``); a staging folder
    taken by :func:`remove_staged` meanwhile: the rename fails and so does the save."""
    with Folder(parent.fs, join(parent.path, staging)) as folder:
        own = ({manifest.metadata.name: metadata} if metadata is not None else {}) | dict(side)
        _create_own(folder, url, own, sync=sync)
        named = _named(manifest, None) | {n: len(d) for n, d in side.items()}
        check_named(folder.listing(), named, url)
        folder.create(MANIFEST_NAME, manifest_bytes, sync=sync)
        if sync:
            folder.fsync_dirs()
    # Step 4 is the rename itself: a removal takes a staging folder away by renaming it too
    # (remove_staged), and of two renames of one name exactly one succeeds.
    with contextlib.suppress(OSError):  # an empty folder made beforehand (`mkdir OUT`): not a checkpoint
        os.rmdir(target, dir_fd=parent.fd)
    try:
        nf.rename_noreplace(parent.fd, staging, parent.fd, target)
    except FileExistsError as exc:
        raise CheckpointExists(f"{url}: {refused}") from exc
    except OSError as exc:
        if exc.errno == errno.ENOTEMPTY:  # a rename onto a folder that holds something
            raise CheckpointExists(f"{url}: {refused}") from exc
        raise
    if sync:
        parent.fsync()


def remove_staged(fs: Any, root: str, name: str) -> list[str] | None:
    """(POSIX) Remove the staging folder ``name`` of ``root`` (a killed full save's): first renamed to a
    trash name of its own, so of this rename and the save's publishing rename exactly one succeeds (``None``:
    it lost, nothing removed); then the trash goes, never following a link. The paths not removed."""
    trash = f"{TRASH_PREFIX}{os.urandom(8).hex()}"
    with Folder(fs, root, follow=True) as parent:
        try:
            nf.rename_noreplace(parent.fd, name, parent.fd, trash)
        except FileNotFoundError:
            return None  # published (or removed) meanwhile
        return nf.remove_tree_at(parent.fd, trash, where=join(root, trash), device=os.fstat(parent.fd).st_dev)


def remove_folder(fs: Any, path: str, url: str, *, uncommitted_only: bool = False) -> list[str]:
    """Remove a checkpoint folder (committed or not); the paths not removed. Marks it first
    (:data:`~.manifest.REMOVING_NAME`: garbage if interrupted; a commit running meanwhile withdraws, step 4),
    then the manifest, then the rest, the mark last (a removal cut short stays marked: retried by the next
    retention), never following a link (a linked folder loses the link only). ``uncommitted_only``: a
    manifest found after the mark means a save committed meanwhile: the mark goes, nothing is removed
    (``[]``). A missing folder raises ``FileNotFoundError``."""
    from smpckpt.storage.backends._folder import remove_tree

    if is_local(fs) and os.path.islink(path):
        return remove_tree(fs, path)  # the link only (a warning names its target)
    with Folder(fs, path) as folder:
        if not folder.local and not folder.listing():
            raise FileNotFoundError(path)
        mark = f"removing {os.urandom(8).hex()}\n".encode()  # whose mark it is (rev65c F6)
        try:
            folder.publish(REMOVING_NAME, mark, sync=True)
            ours = True
        except FileExistsError:  # an interrupted removal's mark, or a running one's: this one finishes it
            ours = folder.read(REMOVING_NAME) == mark  # ... unless an object store's retried PUT met its own
        if uncommitted_only and folder.exists(MANIFEST_NAME):
            log.warning("%s committed while it was being removed as stale: left as it is", url)
            if ours:  # another's mark stays: a removal still running goes on, and that commit withdraws (rev65a F1)
                folder.remove([REMOVING_NAME])
            return []
        try:
            return _remove_marked(folder, fs, path, uncommitted_only)
        except nf.MarkGone:  # by path: on POSIX ``folder`` may be the removed folder, a new one in its place
            if uncommitted_only and read_bytes_or_none(fs, join(path, MANIFEST_NAME)) is not None:
                return []  # a save finished that removal and committed: left as it is (rev65c F1)
            if not _anything_in(fs, path):
                return []  # another removal finished it: done (rev65f F1)
            return [
                f"{url} (stopped: its removal mark went meanwhile -- another removal finished, or one that found a commit left; what is there now is left: remove it again)"
            ]


def _anything_in(fs: Any, path: str) -> bool:
    """Whether anything is under ``path`` now (a fresh listing)."""
    try:
        if is_local(fs):
            return bool(os.listdir(path))
        fs.invalidate_cache(path)
        return bool(fs.find(path))
    except FileNotFoundError:
        return False
    except NotADirectoryError:
        return True  # a file in the folder's place: something is there (rev65g F5)


def _remove_marked(folder: Folder, fs: Any, path: str, uncommitted_only: bool) -> list[str]:
    """:func:`remove_folder` once marked: the manifest (``uncommitted_only``: none was found; one there now
    landed after the look, and goes with the rest, rev65c F1), the rest, the mark last. The mark is looked
    for before the manifest goes and in every listing deleted by: gone, :class:`~._nofollow.MarkGone`."""
    from smpckpt.storage.backends._folder import remove_tree

    if not uncommitted_only and not folder.exists(REMOVING_NAME):
        raise nf.MarkGone(path)  # rev65c F2: a mark not its own, unlinked since
    failed = [] if uncommitted_only else folder.remove([MANIFEST_NAME])
    if not failed and not folder.local:
        # the rest in one go (S3: DeleteObjects, in no order), the mark last: a removal cut short stays
        # marked, and the next retention finishes it
        names = folder.listing()
        if REMOVING_NAME not in names:
            raise nf.MarkGone(path)
        failed = folder.remove([n for n in names if n != REMOVING_NAME])
    if failed:
        return failed
    return remove_tree(fs, path, last=REMOVING_NAME)  # local disk: the mark last too (rev62j F2)

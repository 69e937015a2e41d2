"""The small filesystem seam: open a URL, read a small file, list sizes (create-only writes and removals that
never follow links: ``_folder.py``), default thread counts, page-cache-aware local reads, key prefixes.

Backends are chosen by URL scheme through fsspec (``s3://`` needs s3fs). Paths are plain ``str`` so URLs
keep their scheme. Backend errors become the builtin ``OSError`` family naming the file, keeping
``__cause__`` (S3 codes are translated by s3fs; we add the key, wrap untranslated transport errors, and
let smpckpt's own errors pass), so callers catch ``FileNotFoundError`` alike on every backend.

Key prefixes: object stores scale request rates per key prefix, so a prefix strategy puts each data file
one folder down, ``<folder>/<prefix>/<name>``, prefixes differing in their first character between
neighbouring files. The prefix is part of each file's recorded name, so readers and tools follow the
recorded names and need no strategy; every object stays under the checkpoint's folder (design notes 5).
The numeric strategies compute s3torchconnector's ``HexPrefixStrategy`` / ``BinaryPrefixStrategy``
prefixes (tests/storage/test_storage_prefixes.py checks them) without depending on it, and place each
data file by its index in the whole save rather than by rank.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import logging
import os
import re
import stat
import threading
import time
from collections import UserDict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Generic, Literal, Protocol, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from smpckpt.errors import CheckpointError, UnsafeCheckpoint

__all__ = ["supports_url", "open_fs", "location_key", "is_local", "join", "read_bytes_or_none", "file_sizes"]
__all__ += ["ls_fresh", "pread_into", "translate_errors", "translate", "FsspecLocation", "default_write_threads"]
__all__ += ["MAX_WRITE_THREADS", "default_read_threads"]
__all__ += ["PrefixStrategy", "PrefixOption", "FlatLayout", "NumericPrefixes", "HexPrefixes", "BinaryPrefixes"]
__all__ += ["resolve", "check_prefix", "OwnedOptions", "options_now"]


_ERRNO: Mapping[type[OSError], int] = MappingProxyType(
    {
        FileNotFoundError: errno.ENOENT,
        PermissionError: errno.EACCES,
        FileExistsError: errno.EEXIST,
        TimeoutError: errno.ETIMEDOUT,
    }
)


def translate(exc: BaseException, path: str) -> BaseException:
    """The exception to raise instead of ``exc`` (``exc`` itself when it is already fine)."""
    if isinstance(exc, CheckpointError):
        return exc
    if isinstance(getattr(exc, "response", None), dict):
        # a botocore ClientError that reached us untranslated (a call made outside s3fs's wrapper):
        # s3fs's table says which builtin it is (a botocore error means s3fs is installed)
        from s3fs.errors import translate_boto_error

        return _named(translate_boto_error(exc), path, cause=exc)
    if isinstance(exc, TimeoutError) and exc.filename is None and path and type(exc).__module__ != "builtins":
        # fsspec's FSTimeoutError (a GET stalled mid-body past s3fs's retries) says nothing, not even the key
        said = f": {exc}" if str(exc) else ""
        return _named(TimeoutError(f"timed out ({type(exc).__name__}{said}; transient: retry)"), path, cause=exc)
    if isinstance(exc, OSError):
        known = exc.errno is not None or type(exc) in _ERRNO  # s3fs's AccessDenied, ExpiredToken, 412: no errno
        if exc.filename is None and known and path and type(exc).__module__ == "builtins":
            return _named(exc, path, cause=exc)  # s3fs's translation without the key
        return exc
    if type(exc).__module__.split(".")[0] in ("botocore", "aiobotocore", "aiohttp", "s3fs"):
        return _named(OSError(errno.EIO, f"{type(exc).__name__}: {exc}"), path, cause=exc)
    return exc


def _named(exc: BaseException, path: str, *, cause: BaseException) -> BaseException:
    """``exc`` again, as ``type(exc)(errno, message, path)``, caused by ``cause``."""
    if not isinstance(exc, OSError) or type(exc).__module__ != "builtins":
        return exc
    code = exc.errno if isinstance(exc.errno, int) else _ERRNO.get(type(exc), errno.EIO)
    named = type(exc)(code, exc.strerror or str(exc), path)
    named.__cause__ = cause
    return named


@contextlib.contextmanager
def translate_errors(path: str) -> Iterator[None]:
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - re-raised (translated) below
        new = translate(exc, path)
        if new is exc:
            raise
        raise new from exc


log = logging.getLogger(__name__)


#: fsspec options LocalFileSystem understands; anything else given for a local path is a mistake.
_LOCAL_OPTIONS = frozenset(
    {"auto_mkdir", "skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths"}
)


#: filesystems a Location keeps per scheme and process, most recently used: rotated credentials built a client
#: each, all kept for the Location's life (rev67e F5)
KEPT = 3


class OwnedOptions(UserDict[str, Any]):
    """A Location's ``storage_options`` (the caller's mapping, not a copy) keeping the :data:`KEPT` filesystems
    :func:`open_fs` built from them, by their contents, that were used last (``skip_instance_cache=True`` built one
    per open: hunt66b). A call works on a :meth:`snapshot`: a copy and its filesystem, so all it does (its
    background work too) uses the options as they were when it began (rev67e F4); the next call, the caller's edits."""

    def __init__(self, options: Mapping[str, Any], opened: dict[tuple[str, int, str], Any] | None = None) -> None:
        self.data = options  # type: ignore[assignment]  # a read-only mapping stays read-only
        self.opened = {} if opened is None else opened  # by scheme, pid (a forked child builds its own), token
        self.pinned: dict[tuple[str, int], Any] | None = None  # a snapshot's filesystems (its token taken once)

    def snapshot(self) -> OwnedOptions:
        if self.pinned is not None:
            return self
        copy = OwnedOptions(_copied(self.data), self.opened)  # sharing what the Location keeps
        copy.pinned = {}
        return copy

    def kept(self, scheme: str, options: Mapping[str, Any], fs: Any = None) -> Any:
        """The filesystem kept for ``options`` (``fs``: keep it, dropping the least recently used past KEPT)."""
        pin = (scheme, os.getpid())
        if self.pinned is not None and (found := self.pinned.get(pin)) is not None:
            return found
        key = (*pin, fsspec.utils.tokenize(options))
        # single dict operations (atomic under the GIL): two threads at once at worst build one filesystem more
        found = self.opened.pop(key, None)
        fs = found if found is not None else fs
        if fs is not None:
            self.opened[key] = fs  # the most recently used last
            for old in [k for k in list(self.opened) if k[:2] == pin][:-KEPT]:
                self.opened.pop(old, None)  # a call's snapshot that holds it keeps it alive until the call ends
            if self.pinned is not None:
                self.pinned[pin] = fs
        return fs

    def __reduce__(self) -> Any:
        return (dict, (dict(self),))  # another process builds its own: a filesystem is never pickled


def _copied(options: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _copied(v) if isinstance(v, Mapping) else v for k, v in options.items()}


def options_now(options: Any) -> Any:
    """One call's storage options: a Location's as they are now (:meth:`OwnedOptions.snapshot`), others as given."""
    return options.snapshot() if isinstance(options, OwnedOptions) else options


def open_fs(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """``(fs, path)`` for ``url``: an fsspec filesystem chosen by the URL scheme and the path in it.

    ``storage_options`` go to the filesystem constructor (for S3: ``key``, ``secret``, ``client_kwargs``
    with ``endpoint_url`` / ``region_name``, ...). Plain paths and ``file://`` give the local filesystem.
    """
    url = os.fspath(url)
    if not isinstance(url, str) or not url:
        raise ValueError(f"checkpoint location must be a non-empty path or URL, got {url!r}")
    scheme = url.split("://", 1)[0] if "://" in url else "file"
    if scheme in ("file", "local") and storage_options:
        unknown = sorted(set(storage_options) - _LOCAL_OPTIONS)
        if unknown:
            # LocalFileSystem swallows unknown keyword arguments: a misplaced S3 option would be ignored
            raise ValueError(
                f"{url}: storage_options {unknown} do not apply to a local path (local disk accepts "
                f"{sorted(_LOCAL_OPTIONS)}); were they meant for an s3:// URL?"
            )
    # copied to the leaves: s3fs keeps the client_kwargs dict it is given and connects later (rev67g F1)
    options = _copied(storage_options or {})
    options = _s3_defaults(options) if scheme in ("s3", "s3a") else options
    owned = storage_options if isinstance(storage_options, OwnedOptions) and "::" not in url else None
    try:  # changed options (an endpoint moved): a filesystem of their own
        fs = owned.kept(scheme, options) if owned is not None else None
        if fs is not None and not type(fs)._get_kwargs_from_urls(url):
            path = fs._strip_protocol(url)  # as url_to_fs finds it
        else:
            fs, path = fsspec.core.url_to_fs(url, **options)
            if owned is not None:
                owned.kept(scheme, options, fs)
    except ImportError as exc:
        if scheme in ("s3", "s3a"):
            raise ImportError(f"{url}: install smpckpt[s3] (it adds s3fs) to use s3:// paths") from exc
        raise
    except ValueError as exc:
        if "Protocol not known" in str(exc):
            raise ValueError(f"{url}: no fsspec backend for scheme {scheme!r}") from exc
        raise
    if scheme in ("s3", "s3a") and not path.strip("/"):
        # no bucket: S3 would be asked for an object with an empty key (botocore: "Invalid length for
        # parameter Key"), by whichever call came first
        raise OSError(errno.EINVAL, "an S3 location must name a bucket (s3://BUCKET[/PREFIX])", url)
    return fs, path.rstrip("/") if len(path) > 1 else path


def _s3_defaults(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with our S3 client defaults under what the caller set: ``payload_signing_enabled=False``
    (hashing every body for plain-http signatures cost a third of a save's client CPU; bodies still carry
    CRC32 and every block its xxh3). ``config_kwargs["s3"]["payload_signing_enabled"]=True`` signs."""
    # its sections copied: botocore rewrites ``retries`` in place (the options' token, the caller's dict, changed)
    config = {k: dict(v) if isinstance(v, Mapping) else v for k, v in (options.get("config_kwargs") or {}).items()}
    config["s3"] = {"payload_signing_enabled": False, **(config.get("s3") or {})}
    return {**options, "config_kwargs": config}


def supports_url(url: str | os.PathLike[str]) -> bool:
    """Whether some backend can open ``url`` (for DCP's ``validate_checkpoint_id``)."""
    try:
        open_fs(url)
    except (ValueError, ImportError):
        return False
    return True


def location_key(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> str:
    """One string per location however ``url`` is spelled (``/x``, ``x/`` from ``/``, ``file:///x``);
    no I/O. Raises like :func:`open_fs`."""
    fs, path = open_fs(url, storage_options)
    return f"{_protocol(fs)}://{path.rstrip('/')}"


def folder_key(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> str:
    """:func:`location_key` with a local path's symbolic links resolved now (``os.path.realpath``): one string per
    folder however this process reaches it (a mount point linked into a home); a link re-pointed later gives
    another, so callers resolve again when a call starts. Not covered: one folder reached through two mounts (a bind
    mount, NFS mounted twice), which only a ``stat`` of an existing folder could tell. For comparisons inside one
    process only: another node may link other ways, so what ranks compare or a copy records stays
    :func:`location_key`'s."""
    fs, path = open_fs(url, storage_options)
    return f"{_protocol(fs)}://{os.path.realpath(path)}" if is_local(fs) else location_key(url, storage_options)


def is_local(fs: Any) -> bool:
    return isinstance(fs, LocalFileSystem)


def is_s3(fs: Any) -> bool:
    """Whether ``fs`` is an s3fs filesystem (``_s3`` uses its async client), without importing s3fs."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    # ``_call_s3`` (s3fs's async call, which _s3 uses) marks s3fs itself, not another "s3" backend
    return "s3" in protocols and hasattr(fs, "_call_s3")


def join(folder: str, name: str) -> str:
    """``folder/name`` for any backend (fsspec paths use ``/`` everywhere, local disk included)."""
    return f"{folder.rstrip('/')}/{name}" if folder else name


def _protocol(fs: Any) -> str:
    proto = getattr(fs, "protocol", "")
    return str(proto[0] if isinstance(proto, (tuple, list)) else proto)


def read_bytes_or_none(fs: Any, path: str) -> bytes | None:
    """The whole file, or ``None`` when it does not exist (one GET; no HEAD/LIST first), a folder on its way
    being a file included (``{root}/smpckpt.abandoned/...``: a tag naming one of the root's own files)."""
    with translate_errors(path):
        try:
            if _protocol(fs) in ("s3", "s3a"):
                from smpckpt.storage.backends._s3 import get_object

                return get_object(fs, path)
            data = fs.cat_file(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
    return bytes(data)


def file_stamp(fs: Any, path: str, settled_ns: int = 10**9) -> tuple[int, ...]:
    """(local disk) What identifies the plain file ``path`` as it is now (device, inode, size, times; any
    replacement or write changes it); ``()`` when absent, not a plain file, not on local disk, or changed
    under ``settled_ns`` ago (a file written later in the same clock tick on a reused inode could match)."""
    try:
        st = os.stat(path, follow_symlinks=False) if is_local(fs) else None
    except OSError:
        st = None
    if st is None or not stat.S_ISREG(st.st_mode) or time.time_ns() - st.st_ctime_ns < settled_ns:
        return ()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


#: filesystems whose stat() is authoritative: local ones, and Lustre (coherent across clients)
_COHERENT = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "zfs", "f2fs", "overlay", "lustre"})


def coherent_device(dev: int) -> bool:
    """Whether ``stat`` on device ``dev`` tells another host's write at once (``/proc/self/mountinfo``'s
    filesystem type). NFS, SMB and FUSE clients can serve attributes cached before it: not trusted."""
    want = f"{os.major(dev)}:{os.minor(dev)}"
    with contextlib.suppress(OSError):
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for fields in map(str.split, f):
                if len(fields) > 2 and fields[2] == want and "-" in fields[3:-1]:
                    return fields[fields.index("-", 3) + 1] in _COHERENT
    return False


class _Files(Protocol):
    @property
    def files(self) -> Sequence[str]: ...


T = TypeVar("T", bound=_Files)


class StampedCache(Generic[T]):
    """(local disk on a coherent filesystem, :func:`coherent_device`) A value made from a folder's file (a
    manifest), served again while the file's :func:`file_stamp` is the same and the files the value names (``value.files``) are still confined to the
    folder (:func:`confine`); elsewhere (no stamp) made each time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # callers on several threads (a save's, a drain's)
        self._kept: dict[str, tuple[tuple[int, ...], T]] = {}
        self._coherent: dict[int, bool] = {}  # device -> coherent_device

    def get(self, fs: Any, folder: str, name: str, make: Callable[[], tuple[T, bool]]) -> T:
        """The value of ``folder``'s file ``name``: the kept one, or ``make()``'s ``(value, keep)``, kept when
        ``keep`` says so and the file did not change while it was made."""
        path = join(folder, name)
        stamp = file_stamp(fs, path)
        if stamp and stamp[0] not in self._coherent:  # mountinfo read once per device, not per manifest
            self._coherent[stamp[0]] = coherent_device(stamp[0])
        if stamp and not self._coherent[stamp[0]]:
            stamp = ()  # an NFS-like client: its stat may hide another host's overwrite, read every time
        with self._lock:
            then, value = self._kept.pop(path, ((), None))
        keep = bool(stamp) and stamp == then and value is not None
        try:  # a link planted since: made again (and refused there)
            if keep and value is not None:
                confine(fs, folder, value.files, where=folder)
        except UnsafeCheckpoint:
            keep = False
        if not keep or value is None:
            value, keep = make()
        if keep and stamp and stamp == file_stamp(fs, path):
            with self._lock:
                self._kept[path] = (stamp, value)
        return value

    def keep_only(self, paths: Collection[str]) -> None:
        """Forget every file but ``paths`` (those gone from a listing)."""
        with self._lock:
            self._kept = {p: v for p, v in self._kept.items() if p in paths}


def escapes(folder: str, path: str) -> bool:
    """(local disk) Whether ``path``, a file named inside ``folder``, is reached through a symbolic link
    leading out of the folder (links above the folder itself do not count)."""
    base = os.path.realpath(folder)
    return os.path.commonpath([base, os.path.realpath(path)]) != base


def confine(fs: Any, folder: str, names: Iterable[str], *, where: str) -> None:
    """(local disk; object stores have no links) Refuse a checkpoint whose files, as named by its
    manifest or metadata, are reached through links leading out of its folder: reading them would read
    another folder's files, and deleting them (overwrite, retention) would delete them."""
    if not is_local(fs):
        return
    for name in set(names):
        if escapes(folder, join(folder, name)):
            raise UnsafeCheckpoint(
                f"{where}: {name!r} is reached through a symbolic link leading out of the checkpoint folder "
                f"(to {os.path.realpath(join(folder, name))}); refusing to read or delete through it"
            )


def ls_fresh(fs: Any, path: str, *, detail: bool) -> Any:
    """``fs.ls(path, detail=detail)`` as the store holds it now: s3fs caches listings for the life of the
    (shared) filesystem object, which hid saves made by other processes since."""
    fs.invalidate_cache(path)
    return fs.ls(path, detail=detail)


def file_sizes(fs: Any, folder: str) -> dict[str, int]:
    """Every file under ``folder`` (prefix folders included): relative name -> size. One listing: on S3
    a LIST per 1,000 objects, never a HEAD per file."""
    base = folder.rstrip("/") + "/"  # ``folder`` is as open_fs gave it: as fs.find names its files
    with translate_errors(folder):
        found = fs.find(folder, detail=True)
    return {
        str(p)[len(base) :]: int(info.get("size") or 0)
        for p, info in found.items()
        if str(p).startswith(base) and info.get("type") != "directory"
    }


def pread_into(fd: int, buffers: Sequence[memoryview], offset: int, want: int) -> int:
    """Read file bytes ``[offset, offset + want)`` of ``fd`` into ``buffers`` (byte views, filled in order;
    capacity past ``want`` bytes is left alone), looping on short reads (Linux returns at most 2 GiB - 4 KiB
    per ``preadv``). Returns the bytes read: fewer than ``want`` only when the file ends first."""
    got = 0
    while got < want:
        views: list[memoryview] = []
        skip, room = got, want - got
        for mv in buffers:
            if skip >= len(mv):
                skip -= len(mv)
                continue
            part = mv[skip : skip + room]
            views.append(part)
            room -= len(part)
            skip = 0
            if not room:
                break
        n = os.preadv(fd, views, offset + got)
        if n == 0:
            break
        got += n
    return got


class FsspecLocation:
    """A checkpoint folder as URL, fsspec filesystem and path. ``reset`` re-points it (keeping the
    ``storage_options``) and calls ``_open`` so the subclass forgets its per-checkpoint state."""

    storage_options: Mapping[str, Any]
    url: str
    fs: Any
    path: str

    def _keep(self, options: Mapping[str, Any] | None) -> None:  # a Location's own kept (its filesystem), else copied
        self.storage_options = options if isinstance(options, OwnedOptions) else dict(options or {})

    def _open(self, path: str | os.PathLike[str]) -> None:
        self.url = os.fspath(path)
        self.fs, self.path = open_fs(self.url, self.storage_options)

    @property
    def checkpoint_id(self) -> str:
        return self.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return supports_url(checkpoint_id)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """(all ranks) Point at ``checkpoint_id`` (keeping storage_options) and forget the last save/load."""
        self._open(checkpoint_id if checkpoint_id else self.url)


#: threads per rank when CPUs are plentiful (one rank per node, or a few on a large one)
MAX_WRITE_THREADS = 4


def default_write_threads(local: bool) -> int:
    """Writer threads per rank: 4; local writers (copying and hashing: CPU work) keep ``ranks x threads``
    within ``max(cpus, 4)``, ranks on this node from torchrun's ``LOCAL_WORLD_SIZE``. Object-store
    uploads wait on the network and keep 4."""
    if not local:
        return MAX_WRITE_THREADS
    return max(1, min(MAX_WRITE_THREADS, max(_cpus(), MAX_WRITE_THREADS) // _local_ranks()))


def default_read_threads(local: bool) -> int:
    """Reader threads per rank: 4; on local files no more than the CPUs this rank may use (at least 2:
    one reads while another verifies): cached loads are CPU work, and more threads than CPUs only take
    turns (``benchmarks/RESULTS.md``). Object stores wait on the network: they keep 4."""
    if not local:
        return MAX_WRITE_THREADS
    return max(2, min(MAX_WRITE_THREADS, rank_cpus()))


def rank_cpus() -> int:
    """The CPUs this process may use, shared out among the node's ranks (at least one)."""
    return max(1, _cpus() // _local_ranks())


def _local_ranks() -> int:
    """Ranks on this node, from torchrun's ``LOCAL_WORLD_SIZE`` (1 when unset or malformed)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    except ValueError:
        return 1


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# A prefix is one plain folder name: what _names.check_member_name accepts for a folder component.
_PREFIX_RE = re.compile(r"^[0-9A-Za-z_-]{1,64}$")


def check_prefix(prefix: str) -> str:
    """``prefix`` when it is ``""`` (no folder) or one plain folder name, else ``ValueError``."""
    if prefix and not (isinstance(prefix, str) and _PREFIX_RE.fullmatch(prefix)):
        raise ValueError(f"prefix {prefix!r} must be 1-64 characters of [0-9A-Za-z_-] (one folder level) or ''")
    return prefix


class PrefixStrategy(abc.ABC):
    """Decides the folder (``""``: none) of each data file of a save, from the file's index among all the
    save's files (``rank * files_per_rank + n``) and their count. The coordinator's instance travels with
    the plan to every rank: it must be picklable and deterministic."""

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

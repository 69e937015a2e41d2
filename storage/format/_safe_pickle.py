"""Loading checkpoint metadata and objects without running code from the checkpoint.

:func:`load_metadata` unpickles ``.metadata`` with an allow-list (DCP's metadata dataclasses,
``_StorageInfo``, ``torch.Size``, dtypes, a few path classes, harmless builtins); anything else is
refused before it is called. What a load builds is bounded (:class:`_Bounds`), keeping the C
unpickler's speed, against a few hundred bytes that allocate until memory runs out:

* every allowed callable runs through a guard charging its arguments' elements to one budget per
  load (``1 Mi + the file's size``); a bomb is refused as :class:`CheckpointCorrupt` naming the file;
* DCP's classes are built as per-load stand-in subclasses whose ``__setstate__`` refuses a ``BUILD`` of
  more than :data:`_MAX_STATE` fields, turned into the real class when the load ends (an
  ``OrderedDict`` carries such a ``__setstate__`` in its ``__dict__`` until then);
* nothing the process shares is handed to the pickle (classes as stand-ins, enums as per-load types,
  functions as guards); enum members are compared with their state before the load and restored (the
  file refused) if a ``BUILD`` reached them;
* a ``MemoryError`` while unpickling (``LONG_BINPUT`` near 2**32 asks the C memo for 64 GiB) is reported
  as :class:`CheckpointCorrupt` naming the file.

Cost on a legitimate load: ``benchmarks/bench_metadata_load.py``. :func:`check_weights_only` refuses
object values (``torch.save`` pickles) that ``torch.load(weights_only=True)`` would refuse. Object values'
records themselves: :func:`encode_object` and :func:`decode_object` (once per distinct small value), read
from where they landed through :class:`ViewFile` (no copy into a ``bytes``).
"""

from __future__ import annotations

import copyreg
import dataclasses
import enum
import functools
import io
import pickle
import pickletools
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping
from typing import IO, Any, cast

import torch

from smpckpt._gc import gc_paused
from smpckpt.errors import CheckpointCorrupt, UnsafeCheckpoint

__all__ = ["load_metadata", "check_weights_only", "warn_pickled", "ALLOWED_GLOBALS", "ViewFile", "record_file"]
__all__ += ["encode_object", "decode_object"]

ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.distributed.checkpoint.planner", "WriteItemType"),
        ("torch.distributed.checkpoint.planner", "LoadItemType"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("collections", "OrderedDict"),
        ("collections", "defaultdict"),
        ("copyreg", "_reconstructor"),
    }
    | {("pathlib", name) for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")}
    | {("builtins", name) for name in ("set", "frozenset", "slice", "complex", "range", "object")}
)


#: elements one load may walk through the allow-listed callables, besides one per byte of the file
_BASE_BUDGET = 1 << 20
#: fields one BUILD may set on one object (DCP's metadata dataclasses have at most six)
_MAX_STATE = 64


class _TooBig(Exception):
    """What a load builds went past its bounds (internal: reported as CheckpointCorrupt)."""


class _Bounds:
    """One load's budget of elements, and the stand-in objects it made (made real when the load ends)."""

    def __init__(self, size: int) -> None:
        self.left = _BASE_BUDGET + size
        self.made: list[tuple[Any, type]] = []
        self.hooked: list[Any] = []  # objects carrying a BUILD of their own in their __dict__

    def charge(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise _TooBig(
                "its allow-listed constructors were given more elements than the file could hold "
                f"({_BASE_BUDGET} + one per byte): a crafted allocation, refused"
            )

    def walk(self, *objs: Any) -> None:
        """Charge every element reachable through the containers in ``objs`` (each time it is reached:
        a shared tuple given twice is built, or hashed, twice), before anything is built from them."""
        todo = list(objs)
        while todo:
            o = todo.pop()
            if isinstance(o, (str, bytes)):
                self.charge(1 + len(o))
            elif isinstance(o, range):
                try:
                    n = len(o)
                except OverflowError:
                    n = self.left + 1
                self.charge(1 + n)
            elif isinstance(o, (tuple, list, set, frozenset)):
                self.charge(1 + len(o))  # before the extend: the list of pending elements stays bounded too
                todo.extend(o)
            elif isinstance(o, dict):
                self.charge(1 + 2 * len(o))
                todo.extend(o.keys())
                todo.extend(o.values())
            else:
                self.charge(1)

    def finish(self) -> None:
        """Every object made through a stand-in becomes an instance of its real class; BUILD hooks go."""
        for obj, real in self.made:
            object.__setattr__(obj, "__class__", real)
        for obj in self.hooked:
            obj.__dict__.pop("__setstate__", None)
        # cleared in place: the stand-ins' closures hold these lists, and the stand-in classes live on in
        # reference cycles until the collector runs (a rebinding would leave an entry per object to it)
        self.made.clear()
        self.hooked.clear()


def _bounded_build(obj: Any, state: Any) -> None:
    """The C unpickler's default BUILD (fill ``__dict__``, then set slot state), bounded: the dict part and
    the slot part are refused beyond :data:`_MAX_STATE` fields each."""
    slots = None
    if type(state) is tuple and len(state) == 2:
        state, slots = state
    for part in (state, slots):
        if part is not None and (type(part) is not dict or len(part) > _MAX_STATE):
            size = len(part) if isinstance(part, dict) else type(part).__name__
            raise _TooBig(f"a {type(obj).__name__} is given a state of {size} fields (at most {_MAX_STATE})")
    if state:
        obj.__dict__.update(state)
    if slots:
        for k, v in slots.items():
            setattr(obj, k, v)


def _stand_in(real: type, bounds: _Bounds) -> type:
    """A per-load subclass of ``real`` for ``NEWOBJ`` and ``REDUCE``: its instances (made in C) take a bounded
    BUILD, which records them, and become instances of ``real`` when the load ends; a class without fields
    (``BytesStorageMetadata``) gets no BUILD, so its instances are recorded as they are made."""
    own_setstate = vars(real).get("__setstate__")
    made = bounds.made.append

    def __setstate__(self: Any, state: Any) -> None:
        made((self, real))
        if own_setstate is not None:  # TensorProperties: unpacks a 5-tuple, nothing more
            own_setstate(self, state)
        elif type(state) is dict and len(state) <= _MAX_STATE:  # what pickle writes for a dataclass
            # dict.update reuses the state's stored hashes: no key is hashed again, whatever its type
            self.__dict__.update(state)
        else:
            _bounded_build(self, state)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # REDUCE: a constructor call
        bounds.walk(args, kwargs)
        made((self, real))
        real.__init__(self, *args, **kwargs)  # type: ignore[misc]

    namespace: dict[str, Any] = {"__slots__": (), "__setstate__": __setstate__, "__init__": __init__}
    if dataclasses.is_dataclass(real) and not dataclasses.fields(real):

        def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
            obj: Any = object.__new__(cls)
            made((obj, real))
            return obj

        namespace["__new__"] = __new__
    return type(real.__name__, (real,), namespace)


def _ordered_dict(bounds: _Bounds) -> Any:
    """``OrderedDict``: a built-in type (no stand-in class can turn into it), whose instances have a
    ``__dict__``; each carries a bounded BUILD of its own until the load ends."""

    def ordered_dict(*args: Any, **kwargs: Any) -> OrderedDict[Any, Any]:
        bounds.walk(args, kwargs)
        obj: OrderedDict[Any, Any] = OrderedDict(*args, **kwargs)
        obj.__dict__["__setstate__"] = functools.partial(_bounded_build, obj)
        bounds.hooked.append(obj)
        return obj

    return ordered_dict


def _enum_lookup(real: type[enum.Enum], bounds: _Bounds) -> type:
    """A per-load type standing for an enum: ``REDUCE`` calls it with a value and gets the real member."""

    def __new__(cls: type, *args: Any) -> Any:
        bounds.walk(args)
        return real(*args)

    return type(real.__name__, (), {"__new__": __new__})


def _guarded_call(fn: Any, bounds: _Bounds) -> Any:
    """``fn`` behind a per-load function that charges its arguments first."""

    def call(*args: Any, **kwargs: Any) -> Any:
        bounds.walk(args, kwargs)
        return fn(*args, **kwargs)

    return call


def _size(bounds: _Bounds) -> Any:
    """``torch.Size``, charged by its length (three per chunk in every .metadata: kept cheap)."""

    def size(*args: Any) -> torch.Size:
        if len(args) == 1 and type(args[0]) is tuple:  # what pickle writes: a tuple of ints
            bounds.left -= 1 + len(args[0])
            if bounds.left < 0:
                bounds.charge(0)  # raises
        else:
            bounds.walk(args)
        return torch.Size(*args)

    return size


def _reconstructor(bounds: _Bounds, stand_ins: set[type]) -> Any:
    """``copyreg._reconstructor``: an allowed class made as its stand-in; anything else charged first."""

    def reconstructor(cls: Any, base: Any, state: Any) -> Any:
        if base is object and cls in stand_ins and state is None:
            return cls.__new__(cls)
        bounds.walk(state)
        return copyreg._reconstructor(cls, base, state)  # type: ignore[attr-defined]

    return reconstructor


#: classes and functions on the list handed over as they are: immutable, and built in O(1) from
#: their arguments
_AS_IS = frozenset({("builtins", "slice"), ("builtins", "range"), ("builtins", "object")})


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f: io.BytesIO, bounds: _Bounds) -> None:
        super().__init__(f)
        self._bounds = bounds
        self._made: dict[tuple[str, str], Any] = {}
        self._stand_ins: set[type] = set()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS:
            made = self._made.get((module, name))
            if made is None:
                made = self._made[(module, name)] = self._guarded(module, name, super().find_class(module, name))
            return made
        if module == "torch" and "." not in name:
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value  # immutable C objects without __dict__
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in checkpoint metadata")

    def _guarded(self, module: str, name: str, real: Any) -> Any:
        bounds = self._bounds
        if (module, name) in _AS_IS:
            return real
        if (module, name) == ("torch", "Size"):
            return _size(bounds)
        if (module, name) == ("copyreg", "_reconstructor"):
            return _reconstructor(bounds, self._stand_ins)
        if isinstance(real, type) and issubclass(real, enum.Enum):
            return _enum_lookup(real, bounds)
        if real is OrderedDict:
            return _ordered_dict(bounds)
        if isinstance(real, type) and real.__module__.startswith("torch.distributed.checkpoint"):
            stand_in = _stand_in(real, bounds)  # the classes whose instances have a __dict__
            self._stand_ins.add(stand_in)
            return stand_in
        return _guarded_call(real, bounds)  # set, frozenset, complex, defaultdict, paths, _get_layout


def load_metadata(data: bytes, *, where: str) -> Any:
    """Unpickle DCP ``Metadata`` from ``data``, allow-listed and bounded; else raises naming ``where``."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, Metadata
    from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType

    bounds = _Bounds(len(data))
    members = [m for e in (_MEM_FORMAT_ENCODING, WriteItemType, LoadItemType) for m in e]
    before = [dict(m.__dict__) for m in members]
    try:
        with gc_paused():  # an object per item: no collections while they are made (or turned real)
            try:
                obj = _MetadataUnpickler(io.BytesIO(data), bounds).load()
            finally:
                bounds.finish()
                tampered = []  # put back any enum member a BUILD reached; those it changed
                for member, state in zip(members, before):
                    if member.__dict__ != state:
                        member.__dict__.clear()
                        member.__dict__.update(state)
                        tampered.append(repr(member))
    except pickle.UnpicklingError as exc:
        if "is not allowed" in str(exc):
            raise UnsafeCheckpoint(f"{where}: refused to load: {exc}") from exc
        raise CheckpointCorrupt(f"{where}: cannot be unpickled: {exc}") from exc
    except _TooBig as exc:
        raise CheckpointCorrupt(f"{where}: refused to unpickle: {exc}") from exc
    except MemoryError as exc:
        raise CheckpointCorrupt(
            f"{where}: unpickling it ran out of memory (a crafted or damaged .metadata: a legitimate one "
            f"takes about 15 times its size in memory, and this one is {len(data)} bytes)"
        ) from exc
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as exc:
        raise CheckpointCorrupt(f"{where}: cannot be unpickled: {type(exc).__name__}: {exc}") from exc
    if tampered:
        raise CheckpointCorrupt(
            f"{where}: its pickle sets attributes of shared enum members ({', '.join(tampered)}): refused"
        )
    if not isinstance(obj, Metadata):
        raise CheckpointCorrupt(f"{where}: holds {type(obj).__name__}, not DCP Metadata")
    return obj


#: values whose pickle says all there is to them (no tensor, no class of the user's)
_ATOMS = (int, float, bool, complex, str, bytes, type(None))
#: a memo keeps decoded objects this small (an optimizer's hyper-parameter is ~1.3 KB)
MEMO_BYTES = 4096


def _plain(value: Any, *, immutable: bool) -> bool:
    """Atoms and tuples of them (``immutable``: one decoded copy may be shared); else lists and dicts too."""
    kind = type(value)
    if kind is tuple or (not immutable and kind is list):
        return all(_plain(v, immutable=immutable) for v in value)
    if not immutable and kind is dict:
        return all(_plain(k, immutable=True) and _plain(v, immutable=False) for k, v in value.items())
    return kind in _ATOMS


def encode_object(value: Any, memo: dict[bytes, bytes], odd: dict[bytes, set[int]] | None = None) -> bytes:
    """``torch.save`` bytes of ``value``. A plain value's bytes are a function of its pickle (keyed by
    it, 1.0, 1, True and -0.0 stay apart): an optimizer's thousands of hyper-parameter objects (11 a
    parameter in torch's flattened format) are a few distinct values, each saved once per ``memo``."""
    try:
        key = pickle.dumps(value, 2) if _plain(value, immutable=False) else None
    except RecursionError:  # nested deeper than the walk goes: saved as it is, unshared (rev63h F5)
        key = None
    if key is not None and key in memo:
        return memo[key]
    buf = io.BytesIO()
    torch.save(value, buf)
    raw = buf.getvalue()
    if key is not None:
        memo[key] = raw
    elif odd is not None:  # not plain (a numpy scalar): the caller checks it loads weights-only, once per bytes
        odd.setdefault(raw, set()).add(id(value))
    return raw


def decode_object(raw: bytes | io.BytesIO | ViewFile, memo: dict[bytes, Any], *, weights_only: bool) -> Any:
    """``torch.load`` of object bytes (or a file of them), once per distinct small blob in ``memo``: the same
    bytes load to the same value, so the memo keeps what the (weights-only) load accepted, and only
    immutable results (atoms, tuples of them), which a caller cannot change under the other keys sharing
    them. A large record in a :class:`ViewFile` is loaded from it as it lies (no copy into ``bytes``)."""
    if isinstance(raw, ViewFile) and len(raw.view()) > MEMO_BYTES:
        return torch.load(record_file(raw.view()), weights_only=weights_only, map_location="cpu")
    if not isinstance(raw, bytes):
        raw = raw.read()
    small = len(raw) <= MEMO_BYTES
    if small and raw in memo:
        return memo[raw]
    obj = torch.load(io.BytesIO(raw), weights_only=weights_only, map_location="cpu")
    if small and _plain(obj, immutable=True):
        memo[raw] = obj
    return obj


class ViewFile(io.BufferedIOBase):
    """A read-only, seekable file over a byte view, sharing it (``io.BytesIO`` shares a ``bytes`` only and
    copies a ``bytearray`` or ``memoryview``): a large object record is unpickled straight from the read
    buffer it landed in, and a resume's ``user_content`` kept as that buffer (:meth:`view`), not copied
    into a ``bytes`` first (512 MiB: 0.23 s, and its pages). ``getvalue``/``getbuffer`` as ``BytesIO``'s."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        super().__init__()
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def view(self) -> memoryview:
        """The whole record (the view given, not a copy)."""
        return self._view

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        bases = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}
        if whence not in bases:
            raise ValueError(f"invalid whence ({whence}, should be 0, 1 or 2)")
        base = bases[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        end = len(self._view) if size is None or size < 0 else min(len(self._view), self._pos + size)
        out = bytes(self._view[self._pos : end]) if end > self._pos else b""
        self._pos = max(self._pos, end)
        return out

    read1 = read

    def readinto(self, b: Any) -> int:
        # torch's reader fills each storage through this (no intermediate bytes)
        dst = memoryview(b).cast("B")
        n = max(0, min(len(dst), len(self._view) - self._pos))
        dst[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    readinto1 = readinto

    def getvalue(self) -> bytes:
        return bytes(self._view)

    def getbuffer(self) -> memoryview:
        return self._view


def record_file(data: bytes | bytearray | memoryview) -> IO[bytes]:
    """A file over an object record for ``torch.load``: a ``bytes`` shared by ``io.BytesIO``, else a :class:`ViewFile`."""
    return io.BytesIO(data) if isinstance(data, bytes) else cast(IO[bytes], ViewFile(data))


def check_weights_only(data: bytes | memoryview, *, where: str) -> None:
    """Refuse object bytes that need arbitrary code to load (``UnsafeCheckpoint``); bytes that are no
    readable record at all are ``CheckpointCorrupt`` (never advise ``allow_pickle`` for plain damage)."""
    try:
        torch.load(record_file(data), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        if not _well_formed(data):
            raise CheckpointCorrupt(f"{where}: object bytes are not a readable torch.save record: {exc}") from exc
        raise UnsafeCheckpoint(
            f"{where}: this object is not weights-only safe (loading it could run code from the "
            f"checkpoint); pass allow_pickle=True for checkpoints you trust. Detail: {exc}"
        ) from exc
    except (RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointCorrupt(f"{where}: object bytes cannot be read: {exc!r}") from exc


def warn_pickled(objects: Mapping[bytes, Collection[int]], named: Iterable[tuple[str, Any]]) -> None:
    """Warn naming the values (``named``: key, value) of ``objects`` (``torch.save`` bytes -> the ids of the
    values saved as them) that a load without ``allow_pickle`` refuses (weights-only)."""
    refused: set[int] = set()
    for data, ids in objects.items():
        try:
            torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except pickle.UnpicklingError:
            refused.update(ids)
        except Exception:  # noqa: BLE001 - not the refusal asked about (a load reports anything else)
            pass
    shown = [f"{k} ({type(v).__module__}.{type(v).__name__})" for k, v in named if id(v) in refused] if refused else []
    if shown:
        warnings.warn(
            f"{len(shown)} saved objects load only with allow_pickle=True (weights-only loading refuses them): "
            f"{', '.join(shown[:5])}. Store Python numbers (float(x) of a numpy scalar), tensors, or containers of them",
            stacklevel=3,
        )


def _well_formed(data: bytes | memoryview) -> bool:
    """Whether ``data`` parses as a torch.save record (zip or legacy pickle), without executing it."""
    raw = bytes(data)
    if raw[:4] == b"PK\x03\x04":
        try:
            with zipfile.ZipFile(io.BytesIO(raw)) as archive:
                name = next((n for n in archive.namelist() if n.endswith("data.pkl")), None)
                if name is None:
                    return False
                raw = archive.read(name)
        except (zipfile.BadZipFile, OSError, ValueError):
            return False
    try:
        for _ in pickletools.genops(io.BytesIO(raw)):
            pass
    except Exception:  # noqa: BLE001 - any parse failure means damaged bytes
        return False
    return bool(raw)

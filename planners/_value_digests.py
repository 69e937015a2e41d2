"""Value digests: 4 bytes per tensor from a fixed sample of its elements, compared as values.

Every rank computes one per replicated tensor at every save (:mod:`._replica_values` compares them), so
there is no torch or hash call per tensor where it can be helped (the README's "Replica checks", Cost):
plain contiguous CPU tensors are sampled with one numpy fancy-index per dtype straight from their memory,
canonicalised on their bits in numpy (:func:`_canonical_bits`; torch's intra-op threads cost more than the
rest on a busy machine); other tensors take one ``torch.take`` each, with the same digest. A digest
covers :data:`SAMPLES` evenly spaced elements (first and last included) and the element count; a tensor
none can be taken of (a packed or quantized dtype) is named by :func:`undigestable`."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

__all__ = ["SAMPLES", "value_digests", "undigestable"]

#: elements sampled per tensor (evenly spaced, first and last included)
SAMPLES = 16
_STEPS = SAMPLES - 1
_PLAIN = torch.Tensor

# the mix: odd multipliers (each step a bijection of the state for a fixed word, so two samples that
# differ in one word always differ in the 64-bit state; the digest keeps 32 bits of it)
_P1 = np.uint64(0x9E3779B97F4A7C15)
_P2 = np.uint64(0xBF58476D1CE4E5B9)
_P3 = np.uint64(0x94D049BB133111EB)
_S32 = np.uint64(32)
_S29 = np.uint64(29)


#: the fast path's dtypes, complex ones last (only they can carry the conjugate bit): those whose every
#: element takes ``itemsize`` bytes of its storage, the only ones whose samples the fast path reads from
#: raw addresses (a packed or quantized dtype, ``quint4x2`` two elements per byte, would be read past its
#: storage's end; the slow path's ``torch.take`` checks bounds)
_FAST_DTYPES: tuple[torch.dtype, ...] = tuple(
    getattr(torch, name)
    for name in (
        "bool uint8 int8 int16 int32 int64 float16 bfloat16 float32 float64 uint16 uint32 uint64 float8_e4m3fn "
        "float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz complex64 complex128"
    ).split()
)
#: dtype -> its code, its place in ``_FAST_DTYPES``
_FAST_CODES: Mapping[torch.dtype, int] = MappingProxyType({dt: i for i, dt in enumerate(_FAST_DTYPES)})
_FIRST_COMPLEX = _FAST_CODES[torch.complex64]
_SKIP = -1  # no values (empty, meta): the count alone
_SLOW = -2  # sampled by torch


def value_digests(tensors: Sequence[torch.Tensor]) -> bytes:
    """One little-endian uint32 per tensor: a digest of its sampled elements' values and its element
    count. Meta and empty tensors (no values: planning benchmarks plan with meta tensors) digest their
    count alone."""
    # One Python pass reads what each tensor's sampling needs and appends to flat lists (no dict or
    # group per tensor: this loop is most of the digests' cost); numpy groups them after.
    numels: list[int] = []
    ptrs: list[int] = []
    kinds: list[int] = []
    codes = _FAST_CODES
    for t in tensors:
        numel = t.numel()
        numels.append(numel)
        if numel and type(t) is _PLAIN and t.is_cpu and t.is_contiguous() and not t.is_neg():
            code = codes.get(t.dtype)
            if code is not None and (code < _FIRST_COMPLEX or not t.is_conj()):
                ptr = t.data_ptr()
                if ptr:  # a ZeroTensor has no memory (address 0): sampled by torch, below
                    kinds.append(code)
                    ptrs.append(ptr)
                    continue
        kinds.append(_SKIP if not numel or t.is_meta else _SLOW)
        ptrs.append(0)
    counts = np.asarray(numels, dtype=np.int64)
    kind = np.asarray(kinds, dtype=np.int64)
    addresses = np.asarray(ptrs, dtype=np.int64)
    h = _start(counts)
    for code in np.unique(kind[kind >= 0]).tolist():
        at = np.nonzero(kind == code)[0]
        h[at] = _mix(h[at], _gather_cpu(_FAST_DTYPES[code], addresses[at], counts[at]))
    slow = np.nonzero(kind == _SLOW)[0].tolist()
    if slow:
        for at, data in _gather_torch([tensors[i] for i in slow], slow):
            h[at] = _mix(h[at], data)
    return _finish(h).astype("<u4").tobytes()


@functools.cache
def _offsets(itemsize: int) -> np.ndarray:
    return np.arange(itemsize, dtype=np.int64)


_SAMPLE_I = np.arange(SAMPLES, dtype=np.int64)


def _sample_index(numels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The flat element indices sampled from tensors of ``numels`` elements, ``(rows, SAMPLES)``, and
    which of them are samples (a tensor of fewer elements has fewer: the rest point at its first)."""
    last = numels[:, None] - 1
    # integer arithmetic: evenly spaced over [0, last], rounded to nearest; all elements when fewer
    spread = (_SAMPLE_I[None, :] * last + _STEPS // 2) // _STEPS
    small = numels[:, None] <= SAMPLES
    idx = np.where(small, np.minimum(_SAMPLE_I[None, :], last), spread)
    valid = ~small | (_SAMPLE_I[None, :] < numels[:, None])
    return idx, valid


class _Memory:
    """An array of ``n`` words (bytes by default) from ``lo`` in this process's memory (numpy's array interface): the
    tensors' own bytes, read only where a sample lies, inside the tensors the caller holds."""

    def __init__(self, lo: int, n: int, typestr: str = "|u1") -> None:
        self.__array_interface__ = {"shape": (n,), "typestr": typestr, "data": (lo, True), "version": 3}


_WORDS: Mapping[int, Any] = MappingProxyType({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64})


def _gather_cpu(dtype: torch.dtype, base: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The canonical sample bytes of contiguous CPU tensors of ``dtype`` at addresses ``base``, one row
    each, gathered with one fancy index (of words: a tensor's elements lie at multiples of their size
    from each other, as ``torch`` aligns them; bytes where some do not)."""
    size = dtype.itemsize
    idx, valid = _sample_index(counts)
    lo = int(base.min())
    hi = int((base + counts * size).max())
    word = _WORDS[min(size, 8)]  # an element's word (complex128: two)
    step = np.dtype(word).itemsize
    per = size // step  # words per element (2 for complex128)
    rel = base - lo
    if (rel % step).any():
        word, step, per = np.uint8, 1, size
    memory = np.asarray(_Memory(lo, (hi - lo) // step, np.dtype(word).str))
    at = (rel // step)[:, None] + idx * per
    raw = memory[at if per == 1 else at[:, :, None] + _offsets(per)[None, None, :]]
    return _canonical_rows(dtype, raw.reshape(len(base), SAMPLES, -1), valid)


def _gather_torch(tensors: list[torch.Tensor], where: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The canonical sample bytes of any other tensors: one ``take`` each (any strides, no copy of the
    tensor), one join and one copy to the host per device and dtype."""
    groups: dict[tuple[torch.device | None, torch.dtype], tuple[list[int], list[torch.Tensor], list[int]]] = {}
    for i, t in zip(where, tensors):
        n = t.numel()
        # ``get_device`` is a plain int, -1 on the CPU (``Tensor.device`` builds an object: read only for
        # an accelerator's tensor, whose type -- cuda, xpu, mps, ... -- the index must be moved to)
        device = None if t.get_device() < 0 else t.device
        if n > SAMPLES:
            bits = _BITS_FOR_TAKE.get(t.dtype)
            if bits is None:  # a packed or quantized dtype: ``take`` raises if it has no kernel for it
                sample = torch.take(t, _torch_index(n, device))
            else:  # the sampled bits through an integer view of the same size (any strides), back as dtype
                t = t.resolve_conj().resolve_neg()  # a view of other type would drop the conj/neg bit
                sample = torch.take(t.view(bits), _torch_index(n, device)).view(t.dtype)
        else:
            sample = t.reshape(-1).resolve_conj().resolve_neg()
        group = groups.setdefault((device, t.dtype), ([], [], []))
        group[0].append(i)
        group[1].append(sample)
        group[2].append(n)
    out = []
    for (device, dtype), (positions, samples, numels) in groups.items():
        counts = np.asarray(numels, dtype=np.int64)
        _, valid = _sample_index(counts)
        joined = torch.cat(samples)
        host = joined if device is None else joined.cpu()
        flat = host.contiguous().view(torch.uint8).numpy().reshape(-1, dtype.itemsize)
        raw = np.zeros((len(numels), SAMPLES, dtype.itemsize), dtype=np.uint8)
        raw[valid] = flat  # samples in row order; a small tensor's missing ones stay zero
        out.append((np.asarray(positions, dtype=np.int64), _canonical_rows(dtype, raw, valid)))
    return out


#: quantized dtypes (refused before the check): never sampled through a view. Packed float4 is one element a
#: byte (two values), so its byte view samples it as the small path's reshape does
_NOT_VIEWABLE = frozenset(
    dt for name in ("quint8", "qint8", "qint32", "quint4x2", "quint2x4") if (dt := getattr(torch, name, None))
)
#: the integer type of each element size: every dtype is sampled as its bits through a view of this type
#: (``torch.take`` has no kernel for some: float8, uint16-64, complex32 on torch 2.13)
_BITS_FOR_TAKE: Mapping[torch.dtype, torch.dtype] = MappingProxyType(
    {
        dt: {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dt.itemsize]
        for dt in (getattr(torch, name, None) for name in dir(torch))
        if isinstance(dt, torch.dtype) and dt not in _NOT_VIEWABLE and dt.itemsize in (1, 2, 4, 8)
    }
)


@functools.lru_cache(maxsize=4096)
def _torch_index(numel: int, device: torch.device | None) -> torch.Tensor:
    """The sampled flat indices of a tensor of ``numel`` elements on ``device`` (``None``: the CPU)."""
    idx, _ = _sample_index(np.asarray([numel], dtype=np.int64))
    t = torch.from_numpy(idx[0].copy())
    return t if device is None else t.to(device)


def _canonical_rows(dtype: torch.dtype, raw: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Sample bytes or words ``(rows, SAMPLES, -1)`` as canonical values, ``(rows, W)`` bytes with ``W`` a
    multiple of 8; samples that are not (a small tensor's) are zero bytes."""
    rows = raw.shape[0]
    bits = _FLOAT_BITS.get(dtype)
    raw = np.ascontiguousarray(raw)
    if bits is not None:
        out = _canonical_bits(raw.view(bits[0]), *bits).reshape(rows, SAMPLES, -1)
    elif dtype == _FP4:  # two e2m1 values a byte, no NaN: a zero nibble's sign cleared (-0.0 is +0.0, rev71d L4)
        out = np.where((raw & 0x0F) == 0x08, raw & 0xF0, raw)
        out = np.where((out & 0xF0) == 0x80, out & 0x0F, out)
    else:  # integers, booleans and floats with one encoding per value (float8 *fnuz, e8m0) are their bits
        out = raw.copy()
    out[~valid] = 0
    flat = out.view(np.uint8).reshape(rows, -1)
    pad = -flat.shape[1] % 8
    if pad:
        flat = np.concatenate([flat, np.zeros((rows, pad), dtype=np.uint8)], axis=1)
    return flat


#: packed float4 (``None`` where torch lacks it): its zeros are canonicalised per nibble
_FP4 = getattr(torch, "float4_e2m1fn_x2", None)
#: floating dtypes with two encodings of a value (complex ones by part), canonicalised on their bits: (unsigned
#: word type, the word's sign bit, the largest magnitude bits that are not a NaN, the NaN written): one integer
#: pass on one thread (see the module docstring)
_FLOAT_BITS: Mapping[torch.dtype, tuple[Any, int, int, int]] = MappingProxyType(
    {
        torch.float16: (np.uint16, 0x8000, 0x7C00, 0x7E00),
        torch.bfloat16: (np.uint16, 0x8000, 0x7F80, 0x7FC0),
        torch.float32: (np.uint32, 0x8000_0000, 0x7F80_0000, 0x7FC0_0000),
        torch.float64: (np.uint64, 0x8000_0000_0000_0000, 0x7FF0_0000_0000_0000, 0x7FF8_0000_0000_0000),
        torch.complex64: (np.uint32, 0x8000_0000, 0x7F80_0000, 0x7FC0_0000),
        torch.complex128: (np.uint64, 0x8000_0000_0000_0000, 0x7FF0_0000_0000_0000, 0x7FF8_0000_0000_0000),
        torch.complex32: (np.uint16, 0x8000, 0x7C00, 0x7E00),
        torch.float8_e4m3fn: (np.uint8, 0x80, 0x7E, 0x7F),  # no infinities: 0x7F is its NaN
        torch.float8_e5m2: (np.uint8, 0x80, 0x7C, 0x7E),
    }
)


def _canonical_bits(words: np.ndarray, word: Any, sign: int, inf: int, nan: int) -> np.ndarray:
    """Samples as values, not bit patterns, on their words (native order, of type ``word``): a word whose
    bits other than the sign are zero is a zero (written ``+0.0``: all bits clear), one whose magnitude
    bits exceed ``inf`` is a NaN (written as ``nan``). Replicas computed alike may differ there (``0 * -x``
    and ``0 * x``; x86 writes ``0/0`` as a negative NaN, CUDA as a positive one), so ranks holding equal
    numbers are replicas; which one's bits are stored is unspecified, as between any equal replicas."""
    magnitude = words & word(sign - 1)  # every bit but the sign
    out = np.where(magnitude > word(inf), word(nan), words)
    out[magnitude == 0] = 0
    return out


def _start(counts: np.ndarray) -> np.ndarray:
    """Each row's mix state, seeded with its element count."""
    with np.errstate(over="ignore"):
        return (counts.astype(np.uint64) + _P1) * _P2


def _mix(h: np.ndarray, data: np.ndarray) -> np.ndarray:
    """``h`` (one state per row) mixed with the rows of ``data`` (bytes, a multiple of 8 per row), a
    64-bit word at a time across all rows."""
    words: Any = np.ascontiguousarray(data).view(np.uint64)
    h = h.copy()
    with np.errstate(over="ignore"):
        for j in range(words.shape[1]):
            h ^= words[:, j]
            h *= _P1
            h ^= h >> _S32
    return h


def _finish(h: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        h = h ^ (h >> _S29)
        h = h * _P3
        h = h ^ (h >> _S32)
    return (h & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def undigestable(tensors: Iterable[tuple[str, Any]], exc: BaseException) -> BaseException:
    """The error for a tensor whose values the replica check cannot sample (a packed or quantized dtype):
    named by its key, with the way out; ``exc`` itself when no single tensor is at fault."""
    for key, value in tensors:
        if not isinstance(value, torch.Tensor):
            continue
        try:
            value_digests([value.to_local() if hasattr(value, "to_local") else value])
        except (RuntimeError, NotImplementedError, TypeError) as one:
            why = (str(one).splitlines() or [""])[0][:200]  # torch's dispatcher lists every backend after it
            return TypeError(
                f"{key}: the replica value check cannot sample a {value.dtype} tensor ({why}); save with "
                "verify_replicas=False (SaveOptions(verify_replicas=False) through save_checkpoint or a "
                "Checkpointer), or hold this tensor on one rank only"
            )
    return exc

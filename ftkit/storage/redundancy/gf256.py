"""Arithmetic in GF(2^8) (polynomial 0x11D): tables, vector kernels, Cauchy matrices.

Addition is XOR. Used by the Reed–Solomon level: a Cauchy matrix gives an MDS code, so any
``m`` of the ``k`` segments of a stripe determine the other ``k - m``.

Vector kernels: :func:`scale_into` (``out = c * v``) and :func:`mad_into` (``out ^= c * v``)
run on Intel ISA-L (:mod:`ftkit.storage.redundancy.isal`, memory bandwidth, several GB/s)
when a copy of the library loads and passes a self-test, else on NumPy (a 64 K-entry table applied to
byte pairs, about 1-2 GB/s). :func:`scale_into_ref` is the independent reference kernel
(bit-sliced), kept for tests and benchmarks. All of them give the same bytes.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ftkit import passes
from ftkit.storage.redundancy import isal

_EXP = np.zeros(512, dtype=np.uint8)
_LOG = np.zeros(256, dtype=np.int32)
_x = 1
for _i in range(255):
    _EXP[_i] = _x
    _LOG[_x] = _i
    _x <<= 1
    if _x & 0x100:
        _x ^= 0x11D
_EXP[255:510] = _EXP[0:255]
#: MUL[c] is the table of c * x for every byte x
MUL = np.zeros((256, 256), dtype=np.uint8)
for _c in range(1, 256):
    MUL[_c, 1:] = _EXP[_LOG[_c] + _LOG[np.arange(1, 256)]]


def gmul(a: int, b: int) -> int:
    """Product of two field elements."""
    return int(MUL[a, b])


def ginv(a: int) -> int:
    """Multiplicative inverse (a != 0)."""
    if a == 0:
        raise ZeroDivisionError("0 has no inverse in GF(256)")
    return int(_EXP[255 - _LOG[a]])


# ------------------------------------------------------------------ reference kernel
_LO7 = np.uint64(0x7F7F7F7F7F7F7F7F)
_HI1 = np.uint64(0x0101010101010101)
_POLY = np.uint64(0x1D)
_ONE, _SEVEN = np.uint64(1), np.uint64(7)


def _xtime(w: np.ndarray, tmp: np.ndarray) -> None:
    """Multiply every byte of the uint64 words ``w`` by x (=2), in place."""
    np.right_shift(w, _SEVEN, out=tmp)
    np.bitwise_and(tmp, _HI1, out=tmp)
    np.multiply(tmp, _POLY, out=tmp)           # 0x1D in every byte whose top bit was set
    np.bitwise_and(w, _LO7, out=w)
    np.left_shift(w, _ONE, out=w)
    np.bitwise_xor(w, tmp, out=w)


def scale_into_ref(out: np.ndarray, c: int, v: np.ndarray) -> np.ndarray:
    """``out = c * v`` (uint8 vectors); returns out. The reference kernel, kept independent
    of the fast ones (tests compare them): bit-sliced over 64-bit words when the length is a
    multiple of 8, else one lookup in :data:`MUL`."""
    if c == 0:
        out[...] = 0
    elif c == 1:
        np.copyto(out, v)
    elif len(v) % 8:
        np.copyto(out, MUL[c][v])
    else:
        acc, w = out.view(np.uint64), v.view(np.uint64).copy()
        tmp = np.empty_like(w)
        acc[...] = 0
        for bit in range(8):
            if c >> bit & 1:
                np.bitwise_xor(acc, w, out=acc)
            if c >> (bit + 1):
                _xtime(w, tmp)
    return out


# ------------------------------------------------------------------------ fast kernels
#: uint16 elements per chunk of the NumPy kernel (256 KiB of input: its intp index copy
#: and the products stay in cache)
CHUNK = 1 << 17
#: shorter vectors stay on NumPy (a native call costs more than it saves)
NATIVE_MIN = 64
#: the kernels :func:`use_kernel` can select
KERNELS = ("native", "numpy", "reference")
_native: isal.Isal | None = None
_loaded = False
_mode = "native"


def _native_kernel() -> isal.Isal | None:
    """The ISA-L kernel when it is loaded (on first use) and selected, else None. Local."""
    global _native, _loaded
    if not _loaded:
        _native = isal.load(lambda c, v: scale_into_ref(np.empty(len(v), np.uint8), c, v))
        _loaded = True
    return _native if _mode == "native" else None


def use_kernel(name: str) -> str:
    """Select the kernel of :func:`scale_into` and :func:`mad_into`: ``native`` (ISA-L when
    it loads, else NumPy; the default), ``numpy`` (the fallback) or ``reference``
    (:func:`scale_into_ref`; tests and benchmarks). Returns the previous one. Local."""
    global _mode
    if name not in KERNELS:
        raise ValueError(f"unknown GF(256) kernel {name!r}; one of {KERNELS}")
    previous, _mode = _mode, name
    return previous


def kernel() -> str:
    """The kernel in use: ``isa-l <version> (<library>)``, ``numpy`` or ``reference``.
    Local."""
    native = _native_kernel()
    return f"isa-l {native.version} ({native.where})" if native else \
        "reference" if _mode == "reference" else "numpy"


@lru_cache(maxsize=64)
def _pairs(c: int) -> np.ndarray:
    """65,536-entry table of c times every byte pair, as uint16 (native byte order)."""
    return MUL[c][np.arange(1 << 16, dtype=np.uint16).view(np.uint8)].view(np.uint16)


def _numpy_apply(out: np.ndarray, c: int, v: np.ndarray, accumulate: bool) -> None:
    """``out (^)= c * v`` on NumPy: two bytes per lookup in :func:`_pairs` (``np.take``
    over CHUNK-element slices), the odd last byte in :data:`MUL`."""
    if not (out.flags.c_contiguous and v.flags.c_contiguous):
        product = MUL[c][v]
        np.bitwise_xor(out, product, out=out) if accumulate else np.copyto(out, product)
        return
    even = len(v) & ~1
    src, dst, tbl = v[:even].view(np.uint16), out[:even].view(np.uint16), _pairs(c)
    tmp = np.empty(min(CHUNK, len(src)), np.uint16) if accumulate else None
    for at in range(0, len(src), CHUNK):
        s, d = src[at:at + CHUNK], dst[at:at + CHUNK]
        if tmp is None:
            np.take(tbl, s, out=d, mode="clip")          # uint16 indices never clip
        else:
            np.take(tbl, s, out=tmp[:len(s)], mode="clip")
            np.bitwise_xor(d, tmp[:len(s)], out=d)
    if even < len(v):
        last = MUL[c][v[even]]
        out[even] = out[even] ^ last if accumulate else last


def _apply(out: np.ndarray, c: int, v: np.ndarray, accumulate: bool) -> None:
    """``out = c * v`` or ``out ^= c * v`` (2 <= c <= 255) on the fastest kernel; an
    ``encode`` pass over ``v``."""
    passes.count("encode", v.nbytes)
    if out.dtype != np.uint8 or v.dtype != np.uint8 or out.shape != v.shape or v.ndim != 1:
        raise TypeError(f"GF(256) vectors must be equally long 1-D uint8 arrays, got "
                        f"{out.dtype}{out.shape} and {v.dtype}{v.shape}")
    if _mode == "reference":
        product = scale_into_ref(np.empty(len(v), np.uint8), c, np.ascontiguousarray(v))
        np.bitwise_xor(out, product, out=out) if accumulate else np.copyto(out, product)
        return
    native = _native_kernel()
    if (native is None or len(v) < NATIVE_MIN or not out.flags.writeable
            or not (out.flags.c_contiguous and v.flags.c_contiguous)):
        _numpy_apply(out, c, v, accumulate)
        return
    if np.may_share_memory(out, v):
        v = v.copy()                       # ISA-L reads tails twice: no overlap allowed
    (native.mad if accumulate else native.scale)(out, c, v)


def scale_into(out: np.ndarray, c: int, v: np.ndarray) -> np.ndarray:
    """``out = c * v`` (equally long uint8 vectors); returns out. Native when ISA-L is
    available, else NumPy; same bytes as :func:`scale_into_ref`. Local."""
    if c == 0:
        out[...] = 0
    elif c == 1:
        np.copyto(out, v)
    else:
        _apply(out, c, v, accumulate=False)
    return out


def mad_into(out: np.ndarray, c: int, v: np.ndarray) -> np.ndarray:
    """``out ^= c * v`` (multiply-accumulate, no temporary of the vector's size); returns
    out. Local."""
    if c == 1:
        xor_into(out, v)
    elif c:
        _apply(out, c, v, accumulate=True)
    return out


def xor_into(out: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``out ^= v`` in place, on 64-bit words when both are contiguous and the length is
    a multiple of 8; returns out. Local."""
    if len(out) % 8 == 0 and out.flags.c_contiguous and v.flags.c_contiguous:
        np.bitwise_xor(out.view(np.uint64), v.view(np.uint64), out=out.view(np.uint64))
    else:
        np.bitwise_xor(out, v, out=out)
    return out


def cauchy(rows: int, cols: int) -> list[list[int]]:
    """A rows x cols Cauchy matrix 1 / (x_i + y_j), x_i = i, y_j = rows + j: every square
    sub-matrix of [I; C] is invertible."""
    if rows + cols > 256:
        raise ValueError(f"Cauchy matrix {rows}x{cols} does not fit GF(256)")
    return [[ginv(i ^ (rows + j)) for j in range(cols)] for i in range(rows)]


def invert(matrix: list[list[int]]) -> list[list[int]]:
    """Inverse of a square matrix over GF(256) (Gauss–Jordan); ValueError if singular."""
    n = len(matrix)
    a = [list(row) + [int(i == j) for j in range(n)] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = next((r for r in range(col, n) if a[r][col]), None)
        if pivot is None:
            raise ValueError("singular matrix over GF(256)")
        a[col], a[pivot] = a[pivot], a[col]
        inv = ginv(a[col][col])
        a[col] = [gmul(inv, x) for x in a[col]]
        for r in range(n):
            if r != col and a[r][col]:
                f = a[r][col]
                a[r] = [x ^ gmul(f, y) for x, y in zip(a[r], a[col])]
    return [row[n:] for row in a]

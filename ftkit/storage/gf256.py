"""Arithmetic in GF(2^8) (polynomial 0x11D), vectorised with NumPy lookup tables.

Addition is XOR. ``mul(c, v)`` scales a uint8 vector by a constant through a 256-entry table
(one fancy-index pass). Used by the Reed–Solomon level: a Cauchy matrix gives an MDS code,
so any ``m`` of the ``k`` segments of a stripe determine the other ``k - m``.
"""
from __future__ import annotations

import numpy as np

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


def scale_into(out: np.ndarray, c: int, v: np.ndarray) -> np.ndarray:
    """``out = c * v`` (uint8 vectors); returns out."""
    if c == 0:
        out[...] = 0
    elif c == 1:
        np.copyto(out, v)
    else:
        np.take(MUL[c], v, out=out)
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

"""Optional native GF(256) kernels: Intel ISA-L's erasure-code routines through ctypes.

ISA-L multiplies a byte vector by a constant with two 16-entry nibble tables (PSHUFB / GFNI),
at memory bandwidth. Its field is GF(2^8) with polynomial 0x11D, the one of
:mod:`ftkit.storage.redundancy.gf256`. The library is looked up, in order, as the copy the ``pyeclib``
wheel bundles (``pyeclib.libs/libisal*.so*``, found without importing pyeclib) and as a system
``libisal.so.2``. :func:`load` returns None when neither loads or a loaded one fails a
self-test against ``reference`` (other architectures, no pyeclib): callers fall back to NumPy.

Only two entry points are used, both of which accept any alignment and any length:
``ec_encode_data`` with one source and one destination (``dest = c * src``) and
``ec_encode_data_update`` (``dest ^= c * src``); ``ec_init_tables`` builds the 32-byte table
of a coefficient. Calls release the GIL (ctypes) and are cut into pieces below 2 GiB (the
length is a C ``int``).
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)
#: largest length of one native call (the C prototypes take ``int len``)
PIECE = 1 << 30
_P = ctypes.c_void_p
_INT = ctypes.c_int


class Isal:
    """GF(256) vector kernels of one loaded ISA-L library."""

    def __init__(self, lib: ctypes.CDLL, where: str) -> None:
        self.where = where
        self._init = lib.ec_init_tables
        self._init.argtypes, self._init.restype = [_INT, _INT, _P, _P], None
        self._encode = lib.ec_encode_data
        self._encode.argtypes = [_INT, _INT, _INT, _P, _P, _P]
        self._encode.restype = None
        self._update = lib.ec_encode_data_update
        self._update.argtypes = [_INT, _INT, _INT, _INT, _P, _P, _P]
        self._update.restype = None
        version = getattr(lib, "isal_get_version_str", None)
        if version is not None:
            version.restype = ctypes.c_char_p
        self.version = version().decode() if version is not None else "?"
        self._tables: dict[int, ctypes.Array[ctypes.c_ubyte]] = {}

    def table(self, c: int) -> ctypes.Array[ctypes.c_ubyte]:
        """ISA-L's 32-byte multiplication table of the constant ``c`` (cached)."""
        tbl = self._tables.get(c)
        if tbl is None:
            tbl = self._tables[c] = (ctypes.c_ubyte * 32)()
            self._init(1, 1, ctypes.byref(ctypes.c_ubyte(c)), tbl)
        return tbl

    def scale(self, out: np.ndarray, c: int, v: np.ndarray) -> None:
        """``out = c * v``: contiguous, equally long uint8 vectors that do not overlap."""
        tbl = self.table(c)
        for n, src, dst in _pieces(out, v):
            self._encode(n, 1, 1, tbl, ctypes.byref(_P(src)), ctypes.byref(_P(dst)))

    def mad(self, out: np.ndarray, c: int, v: np.ndarray) -> None:
        """``out ^= c * v``: contiguous, equally long uint8 vectors that do not overlap."""
        tbl = self.table(c)
        for n, src, dst in _pieces(out, v):
            self._update(n, 1, 1, 0, tbl, _P(src), ctypes.byref(_P(dst)))


def _pieces(out: np.ndarray, v: np.ndarray) -> Iterator[tuple[int, int, int]]:
    """(length, source address, destination address) of consecutive pieces <= PIECE."""
    src, dst = v.ctypes.data, out.ctypes.data
    for at in range(0, len(v), PIECE):
        yield min(PIECE, len(v) - at), src + at, dst + at


def _candidates() -> Iterator[tuple[str, Callable[[], ctypes.CDLL]]]:
    """(where, loader) of every library to try, in order."""
    spec = importlib.util.find_spec("pyeclib")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for path in sorted(Path(root).parent.joinpath("pyeclib.libs").glob("libisal*.so*")):
            yield str(path), functools.partial(ctypes.CDLL, str(path))
    yield "libisal.so.2", functools.partial(ctypes.CDLL, "libisal.so.2")


def load(reference: Callable[[int, np.ndarray], np.ndarray]) -> Isal | None:
    """The first ISA-L library that loads and multiplies like ``reference(c, v)`` (which
    returns ``c * v``), or None; says why at debug level (a mismatch at warning). Local."""
    why = []
    for where, loader in _candidates():
        try:
            isal = Isal(loader(), where)
        except (OSError, AttributeError) as exc:
            why.append(f"{where}: {exc}")
            continue
        if _self_test(isal, reference):
            log.debug("GF(256) kernel: ISA-L %s from %s", isal.version, where)
            return isal
        log.warning("ISA-L at %s does not multiply in GF(256)/0x11D like ftkit; not used",
                    where)
    log.debug("ISA-L not available (%s); GF(256) runs on NumPy", "; ".join(why) or "no pyeclib")
    return None


def _self_test(isal: Isal, reference: Callable[[int, np.ndarray], np.ndarray]) -> bool:
    """Both kernels agree with ``reference`` on every byte value, several coefficients and
    lengths (including tails shorter than a SIMD register)."""
    v = np.random.default_rng(0x11D).permutation(np.tile(np.arange(256, dtype=np.uint8), 3))
    for c, n in ((2, 768), (0x53, 767), (0x8E, 101), (0xFF, 64), (7, 33)):
        want, got = reference(c, v[:n]), np.empty(n, np.uint8)
        isal.scale(got, c, v[:n])
        if not np.array_equal(got, want):
            return False
        isal.mad(got, c, v[:n])
        if got.any():
            return False
    return True

"""The fast GF(256) kernels (ISA-L through ctypes, NumPy byte-pair tables) against the
independent reference kernel ``gf256.scale_into_ref``: every coefficient, odd lengths,
unaligned and overlapping views, chunk and piece boundaries, and the fallback when no native
library loads. The native cases skip where ISA-L is not importable (no pyeclib wheel)."""
from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import pytest

from ftkit.storage.redundancy import gf256, isal

NATIVE = gf256.kernel() != "numpy"


@pytest.fixture(params=["native", "numpy", "reference"])
def kernel(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test on one kernel (the native one only where it loads; the reference one
    checks its multiply-accumulate and the argument checks shared by all)."""
    if request.param == "native" and not NATIVE:
        pytest.skip("ISA-L not available (install pyeclib)")
    previous = gf256.use_kernel(request.param)
    yield request.param
    gf256.use_kernel(previous)


def ref(c: int, v: np.ndarray) -> np.ndarray:
    return gf256.scale_into_ref(np.empty(len(v), np.uint8), c, np.ascontiguousarray(v))


def rand(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_selected_kernel() -> None:
    previous = gf256.use_kernel("reference")
    try:
        assert gf256.kernel() == "reference"
        v = rand(1000, 12)
        assert np.array_equal(gf256.mad_into(v.copy(), 0x21, v), v ^ gf256.MUL[0x21][v])
        gf256.use_kernel("numpy")
        assert gf256.kernel() == "numpy"
        with pytest.raises(ValueError, match="unknown GF"):
            gf256.use_kernel("fast")
    finally:
        gf256.use_kernel(previous)
    assert gf256.kernel() != "reference"


def test_reference_kernel_is_the_multiplication_table() -> None:
    v = np.tile(np.arange(256, dtype=np.uint8), 2)
    for c in range(256):
        for n in (512, 509):                        # bit-sliced and table paths
            assert np.array_equal(ref(c, v[:n]), gf256.MUL[c][v[:n]]), c


def test_every_coefficient(kernel: str) -> None:
    v = rand(4099, 1)
    for c in range(256):
        want = ref(c, v)
        out = np.full(len(v), 0xA5, np.uint8)
        assert gf256.scale_into(out, c, v) is out
        assert np.array_equal(out, want), (kernel, c)
        acc = rand(len(v), 2)
        before = acc.copy()
        assert gf256.mad_into(acc, c, v) is acc
        assert np.array_equal(acc, before ^ want), (kernel, c)


@pytest.mark.parametrize("n", [0, 1, 2, 7, 31, 32, 33, 63, 64, 65, 127, 129, 1000, 65537])
def test_odd_lengths(kernel: str, n: int) -> None:
    v, acc = rand(n, n), rand(n, n + 1)
    for c in (2, 0x53, 0xFF):
        assert np.array_equal(gf256.scale_into(np.empty(n, np.uint8), c, v), ref(c, v))
        assert np.array_equal(gf256.mad_into(acc.copy(), c, v), acc ^ ref(c, v))


@pytest.mark.parametrize(("src_at", "dst_at"), [(1, 0), (0, 3), (5, 7), (1, 1), (13, 2)])
def test_unaligned_views(kernel: str, src_at: int, dst_at: int) -> None:
    n = 10_001
    base_v, base_o = rand(n + 32, 3), rand(n + 32, 4)
    v, out = base_v[src_at:src_at + n], base_o[dst_at:dst_at + n]
    keep_o = base_o.copy()
    want = ref(0x8E, v)
    gf256.scale_into(out, 0x8E, v)
    assert np.array_equal(out, want)
    mask = np.ones(n + 32, bool)
    mask[dst_at:dst_at + n] = False
    assert np.array_equal(base_o[mask], keep_o[mask])          # nothing outside the view
    before = out.copy()
    gf256.mad_into(out, 0x1D, v)
    assert np.array_equal(out, before ^ ref(0x1D, v))


def test_strided_views(kernel: str) -> None:
    v, out = rand(3000, 5)[::3], np.zeros(2000, np.uint8)[::2]
    gf256.scale_into(out, 0x77, v)
    assert np.array_equal(out, ref(0x77, v))
    gf256.mad_into(out, 0x77, v)
    assert not out.any()


def test_in_place_and_overlapping(kernel: str) -> None:
    v = rand(5000, 6)
    want = ref(0xC3, v)
    same = v.copy()
    assert np.array_equal(gf256.scale_into(same, 0xC3, same), want)
    same = v.copy()
    assert np.array_equal(gf256.mad_into(same, 0xC3, same), v ^ want)   # (1 + c) * v
    buf = np.concatenate([v, np.zeros(64, np.uint8)])
    gf256.scale_into(buf[64:64 + 4000], 0xC3, buf[:4000])                # shifted overlap
    assert np.array_equal(buf[64:64 + 4000], want[:4000])


def test_chunk_boundaries(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slices of the NumPy kernel and pieces of the native calls end mid-vector."""
    monkeypatch.setattr(gf256, "CHUNK", 17)
    monkeypatch.setattr(isal, "PIECE", 96)
    v, acc = rand(1001, 7), rand(1001, 8)
    assert np.array_equal(gf256.scale_into(np.empty(1001, np.uint8), 0x35, v), ref(0x35, v))
    assert np.array_equal(gf256.mad_into(acc.copy(), 0x35, v), acc ^ ref(0x35, v))


def test_bad_arguments_raise(kernel: str) -> None:
    v = rand(256, 9)
    with pytest.raises(TypeError):
        gf256.scale_into(np.empty(256, np.uint16), 3, v)
    with pytest.raises(TypeError):
        gf256.mad_into(np.empty(255, np.uint8), 3, v)
    frozen = np.zeros(256, np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(ValueError):
        gf256.mad_into(frozen, 3, v)                  # never written behind NumPy's back
    assert not frozen.any()


def test_xor_into() -> None:
    for n in (0, 5, 64, 1003):
        a, b = rand(n, n), rand(n, n + 1)
        want = a ^ b
        assert np.array_equal(gf256.xor_into(a, b), want)
    a, b = rand(33, 1)[1:], rand(32, 2)                # unaligned 64-bit view
    want = a ^ b
    assert np.array_equal(gf256.xor_into(a, b), want)


@pytest.fixture
def unloaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """gf256 as if freshly imported: the native kernel loads again on first use."""
    monkeypatch.setattr(gf256, "_loaded", False)
    monkeypatch.setattr(gf256, "_native", None)


def test_missing_native_library_falls_back(unloaded: None, monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(isal.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(isal.ctypes, "CDLL", _no_library)
    with caplog.at_level(logging.DEBUG, logger="ftkit.storage.redundancy.isal"):
        assert gf256.kernel() == "numpy"
        v = rand(4096, 10)
        assert np.array_equal(gf256.scale_into(np.empty(4096, np.uint8), 9, v), ref(9, v))
        gf256.mad_into(np.empty(4096, np.uint8), 9, v)
    said = [r for r in caplog.records if r.name == "ftkit.storage.redundancy.isal"]
    assert len(said) == 1 and said[0].levelno == logging.DEBUG         # once, quietly
    assert "not available" in said[0].getMessage()


def _no_library(name: str) -> object:
    raise OSError(f"{name}: cannot open shared object file")


@pytest.mark.skipif(not NATIVE, reason="ISA-L not available (install pyeclib)")
def test_library_that_multiplies_differently_is_refused(
        unloaded: None, caplog: pytest.LogCaptureFixture) -> None:
    """A library whose field differs from ours (self-test against the reference) is not
    used: as if the reference were multiplication in another field."""
    wrong = np.roll(gf256.MUL, 1, axis=1)
    assert isal.load(lambda c, v: wrong[c][v]) is None
    assert any(r.levelno == logging.WARNING and "does not multiply" in r.getMessage()
               for r in caplog.records)


@pytest.mark.skipif(not NATIVE, reason="ISA-L not available (install pyeclib)")
def test_native_kernel_is_used_when_available(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ISA-L loaded, long vectors go to it (not to the NumPy kernel)."""
    monkeypatch.setattr(gf256, "_numpy_apply", _refuse)
    v = rand(1 << 16, 11)
    assert np.array_equal(gf256.scale_into(np.empty(1 << 16, np.uint8), 0x42, v),
                          ref(0x42, v))
    assert gf256.kernel().startswith("isa-l ")


def _refuse(*args: object) -> None:
    raise AssertionError("NumPy kernel used")

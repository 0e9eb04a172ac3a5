"""ftkit.capture.flatten + staging: state trees survive flatten -> shard -> unflatten exactly.

Background staging (and torn-snapshot detection) is tested in test_staging.py."""
from __future__ import annotations

import importlib
import math
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ftkit.capture.flatten import UnsupportedLeaf, flatten, leaf_from_bytes, unflatten
from ftkit.capture.staging import Stager
from ftkit.errors import CheckpointError

Roundtrip = Callable[[Any], Any]
fl = importlib.import_module("ftkit.capture.flatten")   # the module, not the function
pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support:UserWarning")

_OPTIONAL = ("uint16", "uint32", "uint64", "complex32", "float8_e4m3fn", "float8_e5m2",
             "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2")
TORCH_DTYPES = [torch.float16, torch.float32, torch.float64, torch.bfloat16, torch.int8,
                torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
                torch.complex64, torch.complex128,
                *(getattr(torch, n) for n in _OPTIONAL if hasattr(torch, n))]


# ----------------------------------------------------------------- helpers
def _tensor_bytes(t: torch.Tensor) -> bytes:
    if t.numel() == 0:
        return b""
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).tolist())


def _float_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Deep, type-exact, bit-exact equality."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, tuple(a.shape)) == (b.dtype, tuple(b.shape)), path
        assert _tensor_bytes(a) == _tensor_bytes(b), path
    elif isinstance(a, np.ndarray):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), path
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, float):
        assert _float_bits(a) == _float_bits(b), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert type(k) is type(next(kk for kk in b if kk == k)), f"{path}: key {k!r}"
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` filled with random bit patterns (valid 0/1 for bool)."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (max(n, 1) * size,), dtype=torch.uint8, generator=g)
    return raw.view(dtype)[:n].reshape(shape)


# ---------------------------------------------------------------- tensors
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_every_torch_dtype(dtype: torch.dtype, roundtrip: Roundtrip) -> None:
    state = {"m": _random_tensor(dtype, (3, 5), 1), "s": _random_tensor(dtype, (), 2),
             "v": _random_tensor(dtype, (7,), 3)}
    out = roundtrip(state)
    assert_same(state, out)
    assert out["s"].dim() == 0


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.bool], ids=str)
def test_empty_tensor_one_byte_dtypes(dtype: torch.dtype, roundtrip: Roundtrip) -> None:
    state = {"e": torch.empty(0, dtype=dtype), "e2": torch.empty(2, 0, 3, dtype=dtype)}
    assert_same(state, roundtrip(state))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16,
                                   torch.complex128], ids=str)
def test_empty_tensor_wide_dtypes(dtype: torch.dtype, roundtrip: Roundtrip) -> None:
    state = {"e": torch.empty(0, dtype=dtype), "e2": torch.empty(2, 0, 3, dtype=dtype)}
    assert_same(state, roundtrip(state))


def test_non_contiguous_views(roundtrip: Roundtrip) -> None:
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    state: dict[str, Any] = {
        "strided": base[:, ::3],
        "transposed": base.t(),
        "offset": base[2:4, 5:],
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
        "conj": torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj(),
        "neg": torch.tensor([1 + 2j], dtype=torch.complex128).conj().imag,
        "grad": torch.ones(3, requires_grad=True) * 2,
        "np_strided": np.arange(40, dtype=np.int32).reshape(4, 10)[::2, 1::3],
        "np_fortran": np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4)),
        "np_transposed": np.arange(6, dtype=np.uint16).reshape(2, 3).T,
    }
    out = roundtrip(state)
    assert torch.equal(out["strided"], base[:, ::3])
    assert torch.equal(out["transposed"], base.t())
    assert torch.equal(out["offset"], base[2:4, 5:])
    assert torch.equal(out["expanded"], torch.tensor([[1.0, 2.0]] * 3))
    assert torch.equal(out["conj"], torch.tensor([1 - 2j, 3 + 4j], dtype=torch.complex64))
    assert not out["conj"].is_conj()
    assert torch.equal(out["neg"], torch.tensor([-2.0], dtype=torch.float64))
    assert torch.equal(out["grad"], torch.full((3,), 2.0)) and not out["grad"].requires_grad
    for key in ("np_strided", "np_fortran", "np_transposed"):
        assert out[key].dtype == state[key].dtype
        assert np.array_equal(out[key], state[key])


def test_zero_dim_and_scalar_like(roundtrip: Roundtrip) -> None:
    state = {"t0": torch.tensor(3.25), "t1": torch.tensor([3.25]), "a0": np.array(7, np.int16)}
    out = roundtrip(state)
    assert out["t0"].shape == () and out["t0"].item() == 3.25
    assert out["t1"].shape == (1,)
    assert isinstance(out["a0"], np.ndarray) and out["a0"].shape == () and out["a0"] == 7


# ----------------------------------------------------------------- numpy
@pytest.mark.parametrize("dtype", ["<f2", "<f4", ">f8", "<i1", "<i2", ">i4", "<i8", "|u1",
                                   "<u2", "<u4", "<u8", "|b1", "<c8", "<c16", "<M8[ns]",
                                   "<m8[s]", "|S5", "<U3", "|V4"])
def test_numpy_dtypes(dtype: str, roundtrip: Roundtrip) -> None:
    dt = np.dtype(dtype)
    raw = np.random.default_rng(0).integers(0, 256, 6 * dt.itemsize, dtype=np.uint8)
    if dt.kind == "b":
        raw = raw % 2
    if dt.kind == "U":
        raw = np.frombuffer("abcdefghijklmnopqr".encode("utf-32-le"), np.uint8)
    arr = raw.view(dt).reshape(2, 3)
    out = roundtrip({"a": arr})["a"]
    assert out.dtype == arr.dtype and out.dtype.byteorder == arr.dtype.byteorder
    assert out.tobytes() == arr.tobytes()


@pytest.mark.parametrize("dtype", [
    np.dtype([("a", "<f4"), ("b", "<i8")]),
    np.dtype([("n", [("x", "<i2"), ("y", ">f4")]), ("z", "?")]),
    np.dtype({"names": ["a", "b"], "formats": ["u1", "<f8"]}, align=True),
    np.dtype({"names": ["a", "b"], "formats": ["u1", "<i4"], "offsets": [0, 4],
              "itemsize": 12}),
], ids=["plain", "nested", "aligned", "offsets"])
def test_structured_numpy(dtype: np.dtype, roundtrip: Roundtrip) -> None:
    arr = np.zeros(4, dtype=dtype)
    arr.view(np.uint8)[:] = np.arange(arr.nbytes, dtype=np.uint8)
    out = roundtrip({"a": arr})["a"]
    assert out.dtype == arr.dtype
    assert out.tobytes() == arr.tobytes()


def test_structured_numpy_with_subarray_field(roundtrip: Roundtrip) -> None:
    arr = np.zeros(3, dtype=[("a", "<f4", (2,)), ("b", "u1")])
    arr["a"] = [[1, 2], [3, 4], [5, 6]]
    out = roundtrip({"a": arr})["a"]
    assert out.dtype == arr.dtype and out.tobytes() == arr.tobytes()


def test_structured_numpy_out_of_order_fields(roundtrip: Roundtrip) -> None:
    dtype = np.dtype({"names": ["a", "b"], "formats": ["u1", "<i4"], "offsets": [4, 0],
                      "itemsize": 8})
    arr = np.zeros(2, dtype=dtype)
    try:
        out = roundtrip({"opt": {"arr": arr}})["opt"]["arr"]
    except UnsupportedLeaf as exc:
        assert "opt/arr" in str(exc)
    else:
        assert out.dtype == arr.dtype and out.tobytes() == arr.tobytes()


@pytest.mark.parametrize("value", [np.float32(1.5), np.float64(-0.0), np.float16(2.5),
                                   np.int8(-3), np.int64(2**62), np.uint64(2**64 - 1),
                                   np.bool_(True), np.complex64(1 - 2j),
                                   np.datetime64("2024-01-02T03:04:05", "s"), np.str_("hé")],
                         ids=repr)
def test_numpy_scalars_keep_their_type(value: np.generic, roundtrip: Roundtrip) -> None:
    out = roundtrip({"x": value, "in_list": [value]})
    assert_same(value, out["x"])
    assert_same(value, out["in_list"][0])


# ---------------------------------------------------------- python values
def test_python_scalars_bit_exact(roundtrip: Roundtrip) -> None:
    state = {
        "int": 3, "neg": -17, "big": 2**200 + 1, "negbig": -(2**90), "zero": 0,
        "float": 0.1, "nan": float("nan"), "inf": math.inf, "ninf": -math.inf,
        "negzero": -0.0, "tiny": 5e-324, "max": 1.7976931348623157e308,
        "str": "héllo ✓ \x00 \"quoted\" \\", "empty": "", "none": None,
        "true": True, "false": False,
    }
    out = roundtrip(state)
    assert_same(state, out)
    assert out["true"] is True and out["false"] is False
    assert math.copysign(1.0, out["negzero"]) == -1.0
    assert math.isnan(out["nan"])


@pytest.mark.parametrize("bits", [0xFFF8000000000000, 0x7FF8000000000001, 0x7FF0000000000001],
                         ids=["negative-nan", "payload-nan", "signalling-nan"])
def test_nan_sign_and_payload_bit_exact(bits: int, roundtrip: Roundtrip) -> None:
    x = struct.unpack("<d", struct.pack("<Q", bits))[0]
    assert _float_bits(roundtrip({"x": x})["x"]) == _float_bits(x)


def test_containers_preserved(roundtrip: Roundtrip) -> None:
    state = {
        "tuple": (1, 2.0, "3"), "list": [1, 2.0, "3"], "empty_list": [], "empty_tuple": (),
        "empty_dict": {}, "nested": [(1, [2, (3,)]), {"a": ({"b": []},)}],
        "int_keys": {0: "a", 1: "b", -5: "c", 2**70: "d"},
        "mixed_keys": {"s": 1, 3: 2, 1.5: 3, None: 4, True: 5},
        "order": {"z": 1, "a": 2, "m": 3},
    }
    out = roundtrip(state)
    assert_same(state, out)
    assert isinstance(out["nested"][0], tuple) and isinstance(out["nested"][0][1], list)
    assert list(out["order"]) == ["z", "a", "m"]


def test_tensors_inside_tuples_and_int_keyed_dicts(roundtrip: Roundtrip) -> None:
    state = {"t": (torch.ones(2), [np.zeros(3)]), "d": {7: torch.arange(3), 8: None}}
    assert_same(state, roundtrip(state))


# ------------------------------------------------------- torch objects
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                               torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_module_via_state_dict(roundtrip: Roundtrip) -> None:
    model = _model()
    model(torch.randn(5, 4))                     # updates BatchNorm running stats
    out = roundtrip({"model": model})["model"]
    sd = model.state_dict()
    assert list(out) == list(sd)
    for k, v in sd.items():
        assert_same(v, out[k], k)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.ReLU(), torch.nn.Linear(8, 2))
    fresh.load_state_dict(out)
    x = torch.randn(3, 4)
    model.eval()
    fresh.eval()
    assert torch.equal(model(x), fresh(x))


def test_adam_state_after_a_step(roundtrip: Roundtrip) -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, amsgrad=True)
    model(torch.randn(6, 4)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    assert sd["state"] and all(isinstance(k, int) for k in sd["state"])
    out = roundtrip({"optim": opt})["optim"]
    assert_same(sd, out)
    # the restored state drives a fresh optimizer to the same next step
    model2 = _model()
    model2.load_state_dict(model.state_dict())
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2, amsgrad=True)
    opt2.load_state_dict(out)
    x = torch.randn(6, 4)
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(x).sum().backward()
        o.step()
    for p1, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p1, p2)


def test_object_with_state_dict_becomes_its_state_dict() -> None:
    class Counter:
        def __init__(self) -> None:
            self.n = 5

        def state_dict(self) -> dict[str, Any]:
            return {"n": self.n, "arr": np.arange(3)}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.n = sd["n"]

    tree, leaves = flatten({"c": Counter()})
    assert tree["items"][0][1]["t"] == "obj"
    assert [lf.path for lf in leaves] == ["c/arr"]
    out = unflatten(tree, [leaf.source for leaf in leaves])
    assert out["c"]["n"] == 5 and np.array_equal(out["c"]["arr"], np.arange(3))


# --------------------------------------------------------- unsupported
@pytest.mark.parametrize(("state", "path"), [
    ({"a": {"b": [1, object()]}}, "a/b/1"),
    ({"opt": {"x": np.array([1, "a"], dtype=object)}}, "opt/x"),
    ({"s": {"inner": {1, 2}}}, "s/inner"),
    ({"k": {(1, 2): 3}}, "k/(1, 2)"),
    ({"f": frozenset()}, "f"),
    ({"b": b"bytes"}, "b"),
    ({"c": 1 + 2j}, "c"),
], ids=["object", "np-object", "set", "tuple-key", "frozenset", "bytes", "complex"])
def test_unsupported_leaf_names_the_path(state: Any, path: str) -> None:
    with pytest.raises(UnsupportedLeaf) as info:
        flatten(state)
    assert info.value.path == path
    assert path in str(info.value)
    assert isinstance(info.value, CheckpointError)


def test_unsupported_sparse_tensor() -> None:
    with pytest.raises(UnsupportedLeaf, match="w/sp"):
        flatten({"w": {"sp": torch.eye(3).to_sparse()}})


def test_unsupported_root() -> None:
    with pytest.raises(UnsupportedLeaf, match="<root>"):
        flatten(object())


# ------------------------------------------------------------- staging
def test_stager_snapshot_is_private_and_buffers_reused() -> None:
    t = torch.arange(8, dtype=torch.float32)
    a = np.arange(4, dtype=np.int64)
    stager = Stager()
    tree, leaves = flatten({"t": t, "a": a})
    bufs = stager.capture(leaves)
    allocated = stager.allocated_bytes
    assert allocated == 8 * 4 + 4 * 8
    t.add_(100)
    a += 100                                    # live state changes after capture
    restored = unflatten(tree, [leaf_from_bytes(lf, b.copy()) for lf, b in zip(leaves, bufs)])
    assert torch.equal(restored["t"], torch.arange(8, dtype=torch.float32))
    assert np.array_equal(restored["a"], np.arange(4))
    _, leaves2 = flatten({"t": t, "a": a})
    bufs2 = stager.capture(leaves2)
    assert stager.allocated_bytes == allocated  # steady state: no new buffers
    assert all(b1 is b2 for b1, b2 in zip(bufs, bufs2))
    assert np.array_equal(bufs2[1].view(np.int64), np.arange(4) + 100)


def test_stager_reallocates_on_size_change_and_drops_stale() -> None:
    stager = Stager()
    stager.capture(flatten({"x": torch.zeros(4), "y": torch.zeros(2)})[1])
    before = stager.allocated_bytes
    bufs = stager.capture(flatten({"x": torch.zeros(8)})[1])
    assert bufs[0].nbytes == 32
    assert stager.allocated_bytes == before + 32
    assert len(stager._buffers) == 1   # the stale second buffer was dropped


@pytest.mark.parametrize("state", [
    {1: torch.tensor([1.0]), "1": torch.tensor([2.0])},
    {"a/b": torch.tensor([1.0]), "a": {"b": torch.tensor([2.0])}},
], ids=["int-vs-str-key", "slash-in-key"])
def test_leaves_with_colliding_paths(state: Any, roundtrip: Roundtrip) -> None:
    assert_same(state, roundtrip(state))


# ------------------------------------------------------------ hypothesis
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=True),
    st.just(math.nan),   # signed/payload NaNs have a dedicated bit-exact test
    st.text(max_size=8),
)
_arrays = hnp.arrays(
    dtype=st.sampled_from([np.dtype(d) for d in ("<f4", ">f8", "<i2", "|u1", "|b1", "<c8")]),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
)
_tensors = st.builds(
    lambda dt, shape, seed: _random_tensor(dt, shape, seed),
    st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool]),
    st.lists(st.integers(1, 4), max_size=3).map(tuple),
    st.integers(0, 2**16),
)
_trees = st.recursive(
    st.one_of(_scalars, _arrays, _tensors),
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.lists(kids, max_size=4).map(tuple),
        # keys of one type per dict; same-path leaves have a dedicated test
        st.dictionaries(st.text(alphabet="abcxyz_", min_size=1, max_size=6), kids, max_size=4),
        st.dictionaries(st.integers(-(2**40), 2**40), kids, max_size=4),
    ),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(tree=_trees)
def test_random_trees_roundtrip(tree: Any, roundtrip: Roundtrip) -> None:
    assert_same({"root": tree}, roundtrip({"root": tree}))


# ------------------------------------------------------ trees that do not decode
def _t(i: int, **extra: Any) -> dict[str, Any]:
    return {"t": "tensor", "i": i, **extra}


def _d(*items: Any) -> dict[str, Any]:
    return {"t": "dict", "items": [list(kv) for kv in items]}


def _nested(levels: int) -> dict[str, Any]:
    node: dict[str, Any] = {"t": "v", "v": 1}
    for _ in range(levels):
        node = {"t": "list", "items": [node]}
    return _d(("a", _t(0)), ("b", _t(1)), ("deep", node))


@pytest.mark.parametrize(("skel", "path", "what"), [
    (_d(("a", _t(0)), ("b", {"t": "list", "items": [_t(5)]})), "b/0", "index 5"),
    (_d(("a", _t(0)), ("b", _t(-1))), "b", "index -1"),
    (_d(("a", _t(0)), ("b", _t(True))), "b", "index True"),
    (_d(("a", _t(0)), ("b", _t(0))), "b", "more than once"),
    (_d(("a", _t(0))), "<root>", "not used"),
    (_d(("a", _t(0)), ("b", _t(1)), ("m", {"t": "list", "items": [{"t": "nope"}]})), "m/0",
     "unknown"),
    (_d(("a", _t(0)), ("b", _t(1)), ("x", _d(("y", {"t": "f", "v": "zz"})))), "x/y", "float"),
    (_d(("a", _t(0)), ("b", _t(1)), ("d", {"t": "dict", "items": [[1]]})), "d", "pair"),
    (_d(("a", _t(0)), ("b", _t(1)), ("d", _d(([1], {"t": "v", "v": 1})))), "d", "key"),
    (_d(("a", _t(0)), ("b", _t(1)), ("a", {"t": "v", "v": 1})), "<root>", "twice"),
    (_d(("a", _t(0)), ("b", _t(1)), ("v", {"t": "v", "v": [1]})), "v", "value"),
    (_d(("a", _t(0, scalar=True)), ("b", _t(1))), "a", "scalar"),
    (_nested(200), "deep/0/0/...", "deeper than"),
    (_nested(100_000), "deep/0/0/...", "deeper than"),
    (5, "<root>", "node"),
], ids=["index-out-of-range", "index-negative", "index-bool", "index-repeated",
        "index-unused", "unknown-node", "bad-float", "item-not-pair", "unhashable-key",
        "duplicate-key", "value-list", "scalar-on-torch", "deep-200", "deep-100k", "not-a-node"])
def test_unflatten_refuses_a_tree_that_does_not_fit(skel: Any, path: str, what: str) -> None:
    """One error type (a ValueError subclass) naming the path in the state tree."""
    tensors = [torch.zeros(2), np.arange(3)]
    with pytest.raises(fl.DecodeError) as info:
        unflatten(skel, tensors)
    assert isinstance(info.value, ValueError)
    where = path.removesuffix("...")
    assert info.value.path == path or where != path and info.value.path.startswith(where)
    assert where in str(info.value) and what in str(info.value), info.value


@pytest.mark.parametrize(("kind", "dtype", "shape", "nbytes", "raw", "what"), [
    ("torch", "float32", (3,), 12, 8, "bytes"),
    ("torch", "float32", (4,), 12, 12, "shape"),
    ("torch", "Tensor", (3,), 12, 12, "dtype"),
    ("torch", "qint8", (3,), 3, 3, "dtype"),
    ("numpy", "|O", (3,), 24, 24, "dtype"),
    ("numpy", "i2", (3,), 6, 6, "dtype"),
    ("numpy", 'json:[["a", "|O"]]', (1,), 8, 8, "dtype"),
    ("numpy", "<f4", (-3,), -12, 12, "shape"),
    ("numpy", "<f4", (2,), 8, 12, "bytes"),
    ("pickle", "<f4", (3,), 12, 12, "kind"),
], ids=["raw-short", "shape-mismatch", "torch-attribute", "quantized", "object", "alias",
        "structured-object", "negative-dim", "raw-long", "unknown-kind"])
def test_leaf_from_bytes_refuses_a_leaf_that_does_not_fit(
        kind: str, dtype: str, shape: tuple[int, ...], nbytes: int, raw: int, what: str) -> None:
    from ftkit.capture.flatten import TensorLeaf
    with pytest.raises(fl.DecodeError) as info:
        leaf_from_bytes(TensorLeaf("m/w", kind, dtype, shape, nbytes),
                        np.zeros(raw, dtype=np.uint8))
    assert info.value.path == "m/w" and "m/w" in str(info.value), info.value
    assert what in str(info.value), info.value


def test_state_nesting_is_bounded_on_both_sides(roundtrip: Roundtrip) -> None:
    """flatten refuses a state nested deeper than MAX_DEPTH (a reader would refuse it);
    one exactly at the limit survives a shard."""
    deepest: Any = torch.ones(2)
    for _ in range(fl.MAX_DEPTH - 1):
        deepest = {"a": deepest}
    assert_same(deepest, roundtrip(deepest))
    with pytest.raises(UnsupportedLeaf, match="deeper than"):
        flatten({"a": deepest})


def _all_torch_dtypes() -> list[torch.dtype]:
    found = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    return sorted((d for d in found if not str(d).startswith(("torch.qint", "torch.quint"))),
                  key=str)


@pytest.mark.parametrize("dtype", _all_torch_dtypes(), ids=str)
def test_every_non_quantized_torch_dtype_is_allowed(dtype: torch.dtype,
                                                    roundtrip: Roundtrip) -> None:
    """The reader's torch allow-list covers every dtype flatten stores; flatten refuses the
    others up front (sub-byte ints: torch cannot even copy them)."""
    name = str(dtype).removeprefix("torch.")
    state = {"t": torch.zeros(3, 2, dtype=dtype)}
    if name not in fl.TORCH_ITEMSIZE:
        assert name.removeprefix("u") in {f"int{n}" for n in range(1, 8)}, name
        with pytest.raises(UnsupportedLeaf, match="allow-list"):
            flatten(state)
        return
    assert fl.itemsize("torch", name) == dtype.itemsize
    out = roundtrip(state)
    assert out["t"].dtype == dtype and out["t"].shape == (3, 2)


@pytest.mark.parametrize("descr", ["|O", "O", "object", "i2", "<f3", "json:{", "json:[1]",
                                   'json:[["a", "|O"]]', "json:" + "[" * 100_000])
def test_numpy_descr_outside_the_allow_list(descr: str) -> None:
    with pytest.raises(fl.DecodeError):
        fl.itemsize("numpy", descr)


@pytest.mark.parametrize("dtype", ["<f2", ">f8", "|b1", "<U7", "|S5", "<M8[ns]", "<m8[s]",
                                   "|V8", [("a", "<i4"), ("b", "<f8", (2,))]], ids=str)
def test_numpy_descr_flatten_produces_is_allowed(dtype: Any) -> None:
    _, leaves = flatten({"a": np.zeros(2, dtype=dtype)})
    assert fl.itemsize("numpy", leaves[0].dtype) == np.dtype(dtype).itemsize

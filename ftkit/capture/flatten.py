"""Flatten a nested training state into raw tensors plus a JSON skeleton, and back.

No pickle anywhere: the skeleton is JSON, every array is raw bytes with a dtype and shape.

Skeleton nodes::

    {"t": "dict",  "items": [[key, node], ...]}   keys: str, int, float, bool or None
    {"t": "list" | "tuple", "items": [node, ...]}
    {"t": "tensor", "i": index}                   index into the tensor list
    {"t": "obj",   "v": node}                     object restored via load_state_dict()
    {"t": "v", "v": value}                        int, str, bool, None
    {"t": "f", "v": "<hex of 8 bytes>"}           floats, bit-exact (IEEE-754 little endian,
                                                  so NaN sign and payload survive)

Decoding trusts nothing: :func:`check_tree`, :func:`unflatten`, :func:`leaf_from_bytes` and
:func:`itemsize` accept exactly what :func:`flatten` produces (node grammar, every tensor
index used once, nesting at most :data:`MAX_DEPTH`, dtypes from an allow-list) and raise
:class:`DecodeError`, naming the path in the state tree, for anything else.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import string
import struct
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ftkit.errors import CheckpointError

Skeleton = dict[str, Any]

#: deepest skeleton node (the root is at depth 1) that flatten writes and decoding accepts
MAX_DEPTH = 100
#: most dimensions of a tensor (numpy's and torch's limit)
MAX_DIMS = 64
#: bytes per element of every torch dtype flatten stores (quantized dtypes are refused)
TORCH_ITEMSIZE: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "uint32": 4, "int32": 4,
    "uint64": 8, "int64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex32": 4, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "bits8": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
}   # not the sub-byte int1..int7 / uint1..uint7: torch cannot copy them (no shard has them)
_DESCR_DEPTH = 32          # JSON nesting of a structured numpy descr
_HEX = frozenset(string.hexdigits)


@dataclasses.dataclass
class TensorLeaf:
    """One array of the state: where it lives in the tree and how to rebuild it."""

    path: str
    kind: str            # "torch" or "numpy"
    dtype: str           # torch dtype name ("bfloat16") or numpy descr ("<f4")
    shape: tuple[int, ...]
    nbytes: int
    source: Any = None   # the live tensor / array (only on the capture side)
    version: int | None = None   # ``source._version`` when staging started (torch only)
    holder: Any = None   # the DTensor whose local tensor ``source`` is (else None)


class DecodeError(ValueError):
    """A state tree or tensor description that does not decode: a skeleton node of an
    unknown form, a tensor index out of range or used twice, a dtype outside the allow-list,
    bytes that do not fit a shape. ``path`` is the place in the state tree (``"<root>"`` for
    the root; None when the check has no place, e.g. :func:`itemsize`)."""

    def __init__(self, path: str | None, reason: str) -> None:
        self.path = None if path is None else path or "<root>"
        self.reason = reason
        where = self.path if self.path is None or len(self.path) <= 100 else \
            f"{self.path[:48]}...{self.path[-48:]}"
        super().__init__(reason if where is None else f"state tree at {where}: {reason}")


class UnsupportedLeaf(CheckpointError):
    """A state leaf of a type ftkit cannot store without pickle."""

    def __init__(self, path: str, what: str) -> None:
        super().__init__(-1, {}, message=f"cannot checkpoint {path or '<root>'}: {what} "
                                         f"(supported: tensors, numpy arrays, int, float, str, "
                                         f"bool, None, dict, list, tuple, objects with "
                                         f"state_dict())")
        self.path = path


def _torch() -> Any:
    return sys.modules.get("torch")


def _is_torch_tensor(x: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def torch_dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


Extra = Callable[[Any], "dict[str, Any] | None"]
#: the key under which ``flatten``'s ``extra`` is stored in an object's state
RESERVED = "__ftkit_loader__"


def reserved(path: str) -> bool:
    """Whether ``path`` (a leaf's place in the state tree) lies in what ftkit saved beside an
    object's state (under :data:`RESERVED`)."""
    return RESERVED in path.split("/")


def flatten(state: Any, extra: Extra | None = None) -> tuple[Skeleton, list[TensorLeaf]]:
    """Flatten ``state``; returns the JSON skeleton and the tensor leaves in tree order.
    ``extra(obj)``: what ftkit saves with an object beside its ``state_dict`` (stored under
    the key ``ftkit.capture.loaders.RESERVED``; see that module), or None."""
    leaves: list[TensorLeaf] = []
    return _flatten(state, "", leaves, 1, extra), leaves


def _flatten(x: Any, path: str, leaves: list[TensorLeaf], depth: int,
             extra: Extra | None = None) -> Skeleton:
    if depth > MAX_DEPTH:
        raise UnsupportedLeaf(path, f"state nested deeper than {MAX_DEPTH} levels")
    if isinstance(x, (np.ndarray, np.generic)):   # before float: np.float64 is a float
        return _array_leaf(np.asarray(x), path, leaves, scalar=isinstance(x, np.generic))
    if x is None or isinstance(x, (bool, int, str)):
        return {"t": "v", "v": x}
    if isinstance(x, float):
        return {"t": "f", "v": struct.pack("<d", x).hex()}
    if _is_torch_tensor(x):
        return _tensor_leaf(x, path, leaves)
    if isinstance(x, dict):
        items = []
        for key, val in x.items():
            if not (key is None or isinstance(key, (str, int, float, bool))):
                raise UnsupportedLeaf(f"{path}/{key!r}", f"dict key of type {type(key).__name__}")
            items.append([key, _flatten(val, _key_path(path, key), leaves, depth + 1, extra)])
        return {"t": "dict", "items": items}
    if isinstance(x, (list, tuple)):
        kind = "tuple" if isinstance(x, tuple) else "list"
        return {"t": kind, "items": [_flatten(v, f"{path}/{i}", leaves, depth + 1, extra)
                                     for i, v in enumerate(x)]}
    if hasattr(x, "state_dict") and hasattr(x, "load_state_dict"):
        sd = x.state_dict()
        more = extra(x) if extra is not None else None
        if more is not None:
            sd = {RESERVED: more, **sd}
        return {"t": "obj", "v": _flatten(sd, path, leaves, depth + 1, extra)}
    raise UnsupportedLeaf(path, f"object of type {type(x).__module__}.{type(x).__qualname__}")


def _key_path(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


def dtensor_type() -> Any:
    """``torch.distributed.tensor.DTensor`` when torch has imported it, else None."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def _tensor_leaf(t: Any, path: str, leaves: list[TensorLeaf]) -> Skeleton:
    torch = _torch()
    dtensor = dtensor_type()
    if dtensor is not None and isinstance(t, dtensor):
        return _dtensor_leaf(t, path, leaves)
    if t.is_sparse or t.is_quantized or t.layout != torch.strided:
        raise UnsupportedLeaf(path, f"tensor with layout {t.layout}")
    name = torch_dtype_name(t.dtype)
    if name not in TORCH_ITEMSIZE:
        raise UnsupportedLeaf(path, f"tensor of dtype {name} (not in ftkit's allow-list)")
    if t.dtype.is_complex and t.is_conj():
        t = t.resolve_conj()
    leaves.append(TensorLeaf(path, "torch", name, tuple(t.shape),
                             t.numel() * t.element_size(), t))
    return {"t": "tensor", "i": len(leaves) - 1}


def _dtensor_leaf(t: Any, path: str, leaves: list[TensorLeaf]) -> Skeleton:
    """A DTensor is stored as its local tensor (its placements make it a declared shard:
    :mod:`ftkit.capture.shards`); a partial sum is not a state."""
    partial = [p for p in t.placements if p.is_partial()]
    if partial:
        raise UnsupportedLeaf(path, f"DTensor with placements {tuple(t.placements)}: a "
                                    f"partial sum; redistribute it (e.g. Replicate) first")
    node = _tensor_leaf(t.detach().to_local(), path, leaves)
    leaves[-1].holder = t
    return node


def _array_leaf(a: np.ndarray, path: str, leaves: list[TensorLeaf], scalar: bool) -> Skeleton:
    if a.dtype.hasobject:
        raise UnsupportedLeaf(path, "numpy array of dtype object (would need pickle)")
    try:
        descr = _descr_of(a.dtype)
        numpy_dtype(descr)              # what a reader accepts, so it can be restored
    except ValueError as exc:                       # DecodeError included
        raise UnsupportedLeaf(path, f"numpy dtype {a.dtype} cannot be described: {exc}") from exc
    leaves.append(TensorLeaf(path, "numpy", descr, a.shape, a.nbytes, a))
    node: Skeleton = {"t": "tensor", "i": len(leaves) - 1}
    if scalar:
        node["scalar"] = True
    return node


def _descr_of(dtype: np.dtype) -> str:
    """The dtype string stored for a numpy leaf: NumPy's descr, ``json:`` + JSON when it is
    a list (structured dtypes)."""
    descr = np.lib.format.dtype_to_descr(dtype)
    return descr if isinstance(descr, str) else "json:" + json.dumps(descr)


def _descr_from_json(descr: Any) -> Any:
    """Undo JSON's tuple->list change in a structured ``dtype_to_descr`` list."""
    if isinstance(descr, str):
        return descr
    fields = []
    for name, sub, *shape in descr:
        fields.append((tuple(name) if isinstance(name, list) else name,
                       _descr_from_json(sub), *(tuple(s) for s in shape)))
    return fields


def exceeds_depth(value: Any, limit: int) -> bool:
    """Whether JSON ``value`` nests lists/dicts more than ``limit`` levels (iterative: a
    hostile depth cannot exhaust the stack)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > limit:
                return True
            stack.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict)
                                                  else node))
    return False


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (for messages about hostile input)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def numpy_dtype(descr: str) -> np.dtype:
    """Inverse of the dtype string stored for numpy leaves. Only strings :func:`flatten`
    produces are accepted: NumPy's canonical descr (``<f4``, ``|S5``, ``<M8[ns]``) or a
    structured ``json:`` descr, never an object dtype. DecodeError otherwise."""
    if not isinstance(descr, str):
        raise DecodeError(None, f"numpy dtype {short_repr(descr)} is not a string")
    return _numpy_dtype(descr)


@functools.lru_cache(maxsize=256)
def _numpy_dtype(descr: str) -> np.dtype:
    try:
        if descr.startswith("json:"):
            spec = json.loads(descr[5:])
            if exceeds_depth(spec, _DESCR_DEPTH):
                raise DecodeError(None, f"numpy dtype {short_repr(descr)} nests deeper than "
                                        f"{_DESCR_DEPTH} levels")
            dtype = np.lib.format.descr_to_dtype(_descr_from_json(spec))
        else:
            dtype = np.lib.format.descr_to_dtype(descr)  # type: ignore[arg-type]
        canonical = _descr_of(dtype)
    except DecodeError:
        raise
    except Exception as exc:  # noqa: BLE001 - json/numpy raise many types on hostile input
        raise DecodeError(None, f"numpy dtype {short_repr(descr)} does not decode "
                                f"({type(exc).__name__})") from None
    if dtype.hasobject:
        raise DecodeError(None, f"numpy dtype {short_repr(descr)} holds Python objects")
    if canonical != descr:
        raise DecodeError(None, f"numpy dtype {short_repr(descr)} is not in the form ftkit "
                                f"writes ({short_repr(canonical)})")
    return dtype


def itemsize(kind: str, dtype: str) -> int:
    """Bytes per element of a stored ``kind``/``dtype`` (torch name or numpy descr) from the
    allow-list, without importing torch. DecodeError when not allowed."""
    if kind == "torch":
        if isinstance(dtype, str) and dtype in TORCH_ITEMSIZE:
            return TORCH_ITEMSIZE[dtype]
        raise DecodeError(None, f"torch dtype {short_repr(dtype)} is not one ftkit writes")
    if kind == "numpy":
        return int(numpy_dtype(dtype).itemsize)
    raise DecodeError(None, f"unknown tensor kind {short_repr(kind)}")


def check_shape(shape: Any) -> tuple[int, ...]:
    """``shape`` as a tuple of plain non-negative ints (at most MAX_DIMS); DecodeError."""
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_DIMS or not all(
            type(n) is int and 0 <= n < 2 ** 63 for n in shape):
        raise DecodeError(None, f"shape {short_repr(shape)} is not a list of at most {MAX_DIMS} "
                                f"non-negative ints")
    return tuple(shape)


def leaf_nbytes(kind: str, dtype: str, shape: Any) -> int:
    """Bytes of a tensor of ``shape`` (validated) and an allowed ``kind``/``dtype``."""
    return math.prod(check_shape(shape)) * itemsize(kind, dtype)


def torch_dtype(name: str) -> Any:
    """The torch dtype object of an allowed dtype name (DecodeError when this torch lacks
    it)."""
    itemsize("torch", name)
    torch = _torch()
    if torch is None:
        import torch
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise DecodeError(None, f"this torch ({torch.__version__}) has no dtype {name}")
    return dtype


def leaf_from_bytes(leaf: TensorLeaf, raw: np.ndarray) -> Any:
    """Build a tensor / array for ``leaf`` over ``raw`` (a uint8 array, not copied). Raises
    DecodeError naming ``leaf.path`` when the leaf's kind, dtype, shape, size and ``raw`` do
    not fit together."""
    try:
        want = leaf_nbytes(leaf.kind, leaf.dtype, leaf.shape)
        if leaf.nbytes != want or raw.nbytes != want:
            raise DecodeError(None, f"{raw.nbytes} bytes (recorded: {leaf.nbytes}) do not fit "
                                    f"{leaf.kind} {leaf.dtype} of shape {list(leaf.shape)} "
                                    f"({want} bytes)")
        if leaf.kind == "numpy":
            return raw.view(numpy_dtype(leaf.dtype)).reshape(leaf.shape)
        dtype = torch_dtype(leaf.dtype)
        torch = sys.modules["torch"]
        if want == 0:
            return torch.empty(leaf.shape, dtype=dtype)
        return torch.from_numpy(raw).view(dtype).reshape(leaf.shape)
    except DecodeError as exc:
        raise DecodeError(leaf.path, exc.reason) from None
    except (RuntimeError, TypeError, ValueError) as exc:
        raise DecodeError(leaf.path, f"{type(exc).__name__}: {exc}") from None


# --------------------------------------------------------------------- decoding
_NODES = {"v": ({"t", "v"}, set()), "f": ({"t", "v"}, set()), "obj": ({"t", "v"}, set()),
          "tensor": ({"t", "i"}, {"scalar"}), "dict": ({"t", "items"}, set()),
          "list": ({"t", "items"}, set()), "tuple": ({"t", "items"}, set())}
Leaf = Callable[[int, bool, str], Any]     # (index, scalar, path) -> value


class _Decoder:
    """One walk over a skeleton: validates every node and builds the value (``leaf`` gives
    each tensor node's value); every tensor index in ``range(count)`` must be used once."""

    def __init__(self, count: int, leaf: Leaf) -> None:
        self.count, self.leaf = count, leaf
        self.used: dict[int, str] = {}

    def run(self, skel: Any) -> Any:
        out = self.node(skel, "", 1)
        unused = [i for i in range(self.count) if i not in self.used]
        if unused:
            raise DecodeError("", f"tensors {unused[:5]}{' ...' if len(unused) > 5 else ''} "
                                  f"of {self.count} are not used by the tree")
        return out

    def node(self, skel: Any, path: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise DecodeError(path, f"nested deeper than {MAX_DEPTH} levels")
        kind = skel.get("t") if isinstance(skel, dict) else None
        if not isinstance(kind, str):
            raise DecodeError(path, f"not a skeleton node: {short_repr(skel)}")
        if kind not in _NODES:
            raise DecodeError(path, f"unknown skeleton node {short_repr(kind)}")
        need, optional = _NODES[kind]
        if not need <= skel.keys() <= need | optional:
            raise DecodeError(path, f"{kind} node with keys {short_repr(sorted(skel))}")
        if kind in ("dict", "list", "tuple"):
            return self.container(kind, skel["items"], path, depth)
        if kind == "tensor":
            return self.tensor(skel, path)
        if kind == "obj":
            return self.node(skel["v"], path, depth + 1)
        return _scalar(kind, skel["v"], path)

    def container(self, kind: str, items: Any, path: str, depth: int) -> Any:
        if not isinstance(items, list):
            raise DecodeError(path, f"{kind} node whose items are not a list")
        if kind != "dict":
            out = [self.node(v, f"{path}/{i}", depth + 1) for i, v in enumerate(items)]
            return tuple(out) if kind == "tuple" else out
        result: dict[Any, Any] = {}
        for item in items:
            if not (isinstance(item, list) and len(item) == 2):
                raise DecodeError(path, f"dict item {short_repr(item)} is not a [key, node] pair")
            key, sub = item
            if not (key is None or isinstance(key, (str, int, float, bool))):
                raise DecodeError(path, f"dict key {short_repr(key)} is not a str, int, float, "
                                        f"bool or None")
            if key in result:
                raise DecodeError(path, f"dict key {short_repr(key)} appears twice")
            result[key] = self.node(sub, _key_path(path, key), depth + 1)
        return result

    def tensor(self, skel: dict[str, Any], path: str) -> Any:
        i, scalar = skel["i"], skel.get("scalar", False)
        if type(i) is not int or not 0 <= i < self.count:
            raise DecodeError(path, f"tensor index {short_repr(i)} is not an int in "
                                    f"0..{self.count - 1}")
        if scalar is not True and "scalar" in skel:
            raise DecodeError(path, f"tensor node with scalar {short_repr(scalar)}")
        if i in self.used:
            raise DecodeError(path, f"tensor {i} is used more than once (also at "
                                    f"{self.used[i] or '<root>'})")
        self.used[i] = path
        return self.leaf(i, scalar, path)


def _scalar(kind: str, value: Any, path: str) -> Any:
    if kind == "f":
        if not (isinstance(value, str) and len(value) == 16 and _HEX.issuperset(value)):
            raise DecodeError(path, f"float node with {short_repr(value)}, not 16 hex digits")
        return struct.unpack("<d", bytes.fromhex(value))[0]
    if not (value is None or isinstance(value, (bool, int, str))):
        raise DecodeError(path, f"value {short_repr(value)} is not an int, str, bool or None")
    return value


def check_tree(skel: Any, leaves: Sequence[TensorLeaf]) -> None:
    """Validate a skeleton against the tensors it refers to, without building anything:
    the node grammar, nesting at most MAX_DEPTH, every index of ``leaves`` used exactly
    once, ``scalar`` only on 0-d numpy leaves. Raises DecodeError naming the path."""
    def leaf(i: int, scalar: bool, path: str) -> None:
        if scalar and (leaves[i].kind != "numpy" or tuple(leaves[i].shape) != ()):
            raise DecodeError(path, f"scalar node over a {leaves[i].kind} tensor of shape "
                                    f"{list(leaves[i].shape)} (only 0-d numpy arrays)")
    _Decoder(len(leaves), leaf).run(skel)


def unflatten(skel: Skeleton, tensors: list[Any]) -> Any:
    """Rebuild the tree; ``obj`` nodes become their state_dict (plain containers). Raises
    DecodeError naming the path when the tree does not fit ``tensors``."""
    def leaf(i: int, scalar: bool, path: str) -> Any:
        val = tensors[i]
        if not scalar:
            return val
        if not (isinstance(val, np.ndarray) and val.shape == ()):
            raise DecodeError(path, "scalar node over a value that is not a 0-d numpy array")
        return val[()]
    return _Decoder(len(tensors), leaf).run(skel)

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
"""
from __future__ import annotations

import dataclasses
import json
import struct
import sys
from typing import Any

import numpy as np

from ftkit.errors import CheckpointError

Skeleton = dict[str, Any]


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


def flatten(state: Any) -> tuple[Skeleton, list[TensorLeaf]]:
    """Flatten ``state``; returns the JSON skeleton and the tensor leaves in tree order."""
    leaves: list[TensorLeaf] = []
    return _flatten(state, "", leaves), leaves


def _flatten(x: Any, path: str, leaves: list[TensorLeaf]) -> Skeleton:
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
            items.append([key, _flatten(val, f"{path}/{key}" if path else str(key), leaves)])
        return {"t": "dict", "items": items}
    if isinstance(x, (list, tuple)):
        kind = "tuple" if isinstance(x, tuple) else "list"
        return {"t": kind, "items": [_flatten(v, f"{path}/{i}", leaves) for i, v in enumerate(x)]}
    if hasattr(x, "state_dict") and hasattr(x, "load_state_dict"):
        return {"t": "obj", "v": _flatten(x.state_dict(), path, leaves)}
    raise UnsupportedLeaf(path, f"object of type {type(x).__module__}.{type(x).__qualname__}")


def _tensor_leaf(t: Any, path: str, leaves: list[TensorLeaf]) -> Skeleton:
    torch = _torch()
    if t.is_sparse or t.is_quantized or t.layout != torch.strided:
        raise UnsupportedLeaf(path, f"tensor with layout {t.layout}")
    if t.dtype.is_complex and t.is_conj():
        t = t.resolve_conj()
    leaves.append(TensorLeaf(path, "torch", torch_dtype_name(t.dtype), tuple(t.shape),
                             t.numel() * t.element_size(), t))
    return {"t": "tensor", "i": len(leaves) - 1}


def _array_leaf(a: np.ndarray, path: str, leaves: list[TensorLeaf], scalar: bool) -> Skeleton:
    if a.dtype.hasobject:
        raise UnsupportedLeaf(path, "numpy array of dtype object (would need pickle)")
    try:
        descr = np.lib.format.dtype_to_descr(a.dtype)
    except ValueError as exc:
        raise UnsupportedLeaf(path, f"numpy dtype {a.dtype} cannot be described: {exc}") from exc
    leaves.append(TensorLeaf(path, "numpy", descr if isinstance(descr, str) else
                             "json:" + json.dumps(descr), a.shape, a.nbytes, a))
    node: Skeleton = {"t": "tensor", "i": len(leaves) - 1}
    if scalar:
        node["scalar"] = True
    return node


def _descr_from_json(descr: Any) -> Any:
    """Undo JSON's tuple->list change in a structured ``dtype_to_descr`` list."""
    if isinstance(descr, str):
        return descr
    fields = []
    for name, sub, *shape in descr:
        fields.append((tuple(name) if isinstance(name, list) else name,
                       _descr_from_json(sub), *(tuple(s) for s in shape)))
    return fields


def numpy_dtype(descr: str) -> np.dtype:
    """Inverse of the dtype string stored for numpy leaves."""
    if descr.startswith("json:"):
        return np.lib.format.descr_to_dtype(_descr_from_json(json.loads(descr[5:])))
    return np.lib.format.descr_to_dtype(descr)  # type: ignore[arg-type]


def leaf_from_bytes(leaf: TensorLeaf, raw: np.ndarray) -> Any:
    """Build a tensor / array for ``leaf`` over ``raw`` (a uint8 array, not copied)."""
    if leaf.kind == "numpy":
        return raw.view(numpy_dtype(leaf.dtype)).reshape(leaf.shape)
    torch = _torch()
    if torch is None:
        import torch
    dtype = getattr(torch, leaf.dtype)
    if leaf.nbytes == 0:
        return torch.empty(leaf.shape, dtype=dtype)
    return torch.from_numpy(raw).view(dtype).reshape(leaf.shape)


def unflatten(skel: Skeleton, tensors: list[Any]) -> Any:
    """Rebuild the tree; ``obj`` nodes become their state_dict (plain containers)."""
    t = skel["t"]
    if t == "v":
        return skel["v"]
    if t == "f":
        return struct.unpack("<d", bytes.fromhex(skel["v"]))[0]
    if t == "tensor":
        val = tensors[skel["i"]]
        return val[()] if skel.get("scalar") else val
    if t == "obj":
        return unflatten(skel["v"], tensors)
    if t == "dict":
        return {k: unflatten(v, tensors) for k, v in skel["items"]}
    if t in ("list", "tuple"):
        items = [unflatten(v, tensors) for v in skel["items"]]
        return tuple(items) if t == "tuple" else items
    raise ValueError(f"unknown skeleton node {t!r}")

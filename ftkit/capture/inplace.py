"""Where a restored tensor's bytes land: straight in the live tensor's memory when it can
take them, else in a new buffer.

A restore that reads a checkpoint into new memory and then copies it into the live state
touches every byte twice, and the new memory costs a page fault per page on first touch.
So the restore reads each saved tensor directly into its live counterpart when there is
one that can take the bytes as they are: the leaf at the same position of the live state
flattened as the save flattened it, with the same path, the same kind,
dtype and shape, in contiguous, writable CPU memory (a torch tensor that is not an
inference tensor, or a NumPy array that holds no Python objects). A contiguous CUDA
counterpart is filled through one reused pinned host buffer and one host-to-device copy
(:mod:`ftkit.capture.devicecopy`). Anything else (a tensor the state does not have yet, a
strided view) gets a new buffer and is loaded as before
(:func:`ftkit.capture.apply.load_into`). A DTensor's bytes land in its local tensor and the
DTensor itself goes back to its owner.

Writing through a NumPy view does not bump a torch tensor's version counter; restore runs
before training resumes, and ``load_into`` then hands the very same tensors back to their
owners (``load_state_dict``), so nothing observes the difference. Local, pure apart from
the flattening of the live state (which calls ``state_dict()`` on its objects).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ftkit.buffers import aligned_empty
from ftkit.capture import attached
from ftkit.capture.devicecopy import device_target, overwritable
from ftkit.capture.flatten import (
    DecodeError,
    Extra,
    TensorLeaf,
    flatten,
    leaf_from_bytes,
    unflatten,
)


def live_leaves(state: Any, extra: Extra | None = None) -> list[TensorLeaf]:
    """The tensor leaves of the live ``state`` in tree order, flattened as a save flattens
    it (``extra``: the same as the save's), so leaf i is the live counterpart of a saved
    shard's tensor i when the structures agree ([] when it cannot be flattened: then nothing
    is read in place)."""
    try:
        return flatten(state, extra)[1]
    except Exception:  # noqa: BLE001 - in place is an optimisation; the load checks the rest
        return []


def destination(saved: TensorLeaf, live: TensorLeaf | None) -> tuple[Any, Any]:
    """Where ``saved``'s bytes go, and the tensor that holds them afterwards: when ``live``
    (the leaf at the same position) is its counterpart, ``(the live tensor's bytes as a flat
    writable uint8 NumPy view, the live tensor)`` on the CPU, ``(its bytes as a flat uint8
    torch view, the live tensor)`` on a GPU (read through
    :class:`ftkit.capture.devicecopy.DeviceLanding`); else ``(a new uint8 buffer, None)``.
    Paths are compared too, but they do not identify a leaf alone (``{"a/b": x}`` and
    ``{"a": {"b": y}}`` print alike)."""
    if live is not None and (live.path, live.kind, live.dtype, tuple(live.shape),
                             live.nbytes) == (saved.path, saved.kind, saved.dtype,
                                              tuple(saved.shape), saved.nbytes) \
            and saved.nbytes:
        held = live.source if live.holder is None else live.holder
        view = _bytes_of(live.source)
        if view is not None and view.nbytes == saved.nbytes:
            return view, held
        device = device_target(live.source)
        if device is not None and device.numel() == saved.nbytes:
            return device, held
    return aligned_empty(saved.nbytes), None


def _as_live(value: Any, live: TensorLeaf | None) -> Any:
    """A new tensor read for a live DTensor's local part, as a DTensor like it (the
    module's ``load_state_dict`` takes no plain tensor for a DTensor parameter)."""
    if live is None or live.holder is None or tuple(getattr(value, "shape", ())) != \
            tuple(live.shape):
        return value
    from torch.distributed.tensor import DTensor
    h = live.holder
    return DTensor.from_local(value, h.device_mesh, h.placements, run_check=False,
                              shape=h.shape, stride=h.stride())


def _bytes_of(x: Any) -> np.ndarray | None:
    """A flat writable uint8 view of the memory of ``x`` (None when it has none we may
    write: GPU, strided, read-only, inference, objects)."""
    if isinstance(x, np.ndarray):
        ok = x.flags.c_contiguous and x.flags.writeable and not x.dtype.hasobject
        return x.reshape(-1).view(np.uint8) if ok else None
    try:
        if not overwritable(x, "cpu"):
            return None
        import torch
        view: np.ndarray = x.detach().reshape(-1).view(torch.uint8).numpy()
    except Exception:  # noqa: BLE001 - any tensor torch cannot show as bytes: a new buffer
        return None
    return view if view.flags.writeable else None


@dataclasses.dataclass
class Reading:
    """Where each saved tensor's bytes go, and the state tree over them (nothing read yet)."""

    dests: list[Any]       # np.ndarray (host bytes) or a flat uint8 CUDA tensor
    live: list[bool]       # dests[i] is a live tensor's memory, not a new buffer
    tree: dict[str, Any]


def plan_reading(saved: list[TensorLeaf], tree: Any, state: Any) -> Reading:
    """The destination of every ``saved`` tensor (:func:`destination`, against ``state``
    flattened as a save flattens it) and the state tree ``tree`` (a checkpoint's JSON
    skeleton) decoded over them. DecodeError when the tree does not decode or its root is
    not a dict."""
    live = live_leaves(state, attached.extra_layout)
    dests, flags, tensors = [], [], []
    for i, leaf in enumerate(saved):
        mine = live[i] if i < len(live) else None
        dest, value = destination(leaf, mine)
        dests.append(dest)
        flags.append(value is not None)
        tensors.append(value if value is not None else
                       _as_live(leaf_from_bytes(leaf, dest), mine))
    root = unflatten(tree, tensors)
    if not isinstance(root, dict):
        raise DecodeError(None, f"the state root is a {type(root).__name__}, not a dict")
    return Reading(dests, flags, root)

"""Load a restored state tree into the user's live objects, in place where possible.

Objects with ``load_state_dict`` get it called; tensors and arrays that already exist with
the same shape and dtype are overwritten in place (so references held elsewhere, e.g. by an
optimizer, stay valid); everything else is replaced in its container.
"""
from __future__ import annotations

import sys
from collections.abc import MutableMapping
from typing import Any

import numpy as np

from ftkit import passes
from ftkit.capture import attached
from ftkit.capture.flatten import RESERVED, _is_torch_tensor, flatten
from ftkit.errors import StateMismatchError

_MAX_LISTED = 5


def structure_diff(state: Any, restored: Any) -> list[str]:
    """How the objects with a ``state_dict`` in the live ``state`` (models, optimizers, ...)
    differ in structure from their part of a ``restored`` tree (from :func:`unflatten`):
    every tensor must exist in the checkpoint with the same dtype and shape (an optimizer's
    per-parameter ``state`` may be empty before its first step). Plain containers are
    replaced by the checkpoint's content on load, so they are not compared. Local, pure."""
    out: list[str] = []
    for path, obj, saved in _objects(state, restored, ""):
        _, live_leaves = flatten(obj)
        _, saved_leaves = flatten(saved)
        by_path = {leaf.path: leaf for leaf in saved_leaves}
        optimizer = hasattr(obj, "param_groups")
        for leaf in live_leaves:
            name = f"{path}/{leaf.path}" if leaf.path else path
            old = by_path.get(leaf.path)
            if old is None:
                if not (optimizer and leaf.path.startswith("state/")):
                    out.append(f"{name}: in the state ({leaf.dtype} {list(leaf.shape)}) but "
                               f"not in the checkpoint")
            elif (old.dtype, old.shape) != (leaf.dtype, leaf.shape):
                out.append(f"{name}: checkpoint has {old.dtype} {list(old.shape)}, the state "
                           f"has {leaf.dtype} {list(leaf.shape)}")
    return out


def _objects(live: Any, saved: Any, path: str) -> list[tuple[str, Any, Any]]:
    """(path, live object, its restored state) for every object with a ``state_dict``
    reachable through plain containers present on both sides."""
    if hasattr(live, "state_dict") and hasattr(live, "load_state_dict"):
        return [(path, live, saved)]
    if isinstance(live, dict) and isinstance(saved, dict):
        return [o for k, v in live.items() if k in saved
                for o in _objects(v, saved[k], f"{path}/{k}" if path else str(k))]
    if isinstance(live, (list, tuple)) and isinstance(saved, (list, tuple)):
        return [o for i, (v, w) in enumerate(zip(live, saved))
                for o in _objects(v, w, f"{path}/{i}")]
    return []


def mismatch_text(diffs: list[str]) -> str:
    """One line naming the first differences."""
    more = f" (and {len(diffs) - _MAX_LISTED} more)" if len(diffs) > _MAX_LISTED else ""
    return "; ".join(diffs[:_MAX_LISTED]) + more


def load_into(state: MutableMapping[str, Any], restored: dict[str, Any], step: int) -> None:
    """Load ``restored`` (from :func:`unflatten`) into the live ``state`` mapping."""
    missing = [k for k in state if k not in restored]
    extra = [k for k in restored if k not in state]
    if missing or extra:
        raise StateMismatchError(step, {}, message=(
            f"state keys differ from the checkpoint of step {step}: missing in checkpoint "
            f"{missing}, not in state {extra}"))
    for key in state:
        state[key] = _merge(state[key], restored[key], str(key), step)


def _merge(live: Any, new: Any, path: str, step: int) -> Any:
    if hasattr(live, "load_state_dict") and hasattr(live, "state_dict"):
        try:
            if isinstance(new, dict) and RESERVED in new:     # ftkit's part (attached.py)
                new = dict(new)
                attached.load_saved(live, new.pop(RESERVED))
            live.load_state_dict(new)
            if _is_module(live):       # a module copies every tensor into its own
                passes.count("copy", _tensor_bytes(new))
        except Exception as exc:
            raise StateMismatchError(step, {}, message=(
                f"load_state_dict of {path} failed for step {step}: {exc}")) from exc
        return live
    if new is live:                   # read in place (capture/inplace.py): nothing to copy
        return live
    if _is_torch_tensor(live) and _is_torch_tensor(new):
        if live.shape == new.shape and live.dtype == new.dtype:
            with _no_grad():
                live.copy_(new)
            passes.count("copy", live.element_size() * live.numel())
            return live
        return new
    if isinstance(live, np.ndarray) and isinstance(new, np.ndarray):
        if live.shape == new.shape and live.dtype == new.dtype and live.flags.writeable:
            np.copyto(live, new)
            passes.count("copy", live.nbytes)
            return live
        return new
    if isinstance(live, dict) and isinstance(new, dict):
        for k in list(live):
            if k not in new:
                del live[k]
        for k, v in new.items():
            live[k] = _merge(live[k], v, f"{path}/{k}", step) if k in live else v
        return live
    if isinstance(live, list) and isinstance(new, list) and len(live) == len(new):
        live[:] = [_merge(a, b, f"{path}/{i}", step) for i, (a, b) in enumerate(zip(live, new))]
        return live
    return new


def _no_grad() -> Any:
    import torch
    return torch.no_grad()


def _is_module(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.nn.Module)


def _tensor_bytes(x: Any) -> int:
    """Bytes of the torch tensors in a (nested) state dict."""
    if _is_torch_tensor(x):
        return int(x.element_size() * x.numel())
    if isinstance(x, dict):
        return sum(_tensor_bytes(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(v) for v in x)
    return 0

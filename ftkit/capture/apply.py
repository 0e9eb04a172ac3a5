"""Load a restored state tree into the user's live objects, in place where possible.

Objects with ``load_state_dict`` get it called; tensors and arrays that already exist with
the same shape and dtype are overwritten in place (so references held elsewhere, e.g. by an
optimizer, stay valid); everything else is replaced in its container.
"""
from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import numpy as np

from ftkit.capture.flatten import _is_torch_tensor
from ftkit.errors import CheckpointError


def load_into(state: MutableMapping[str, Any], restored: dict[str, Any], step: int) -> None:
    """Load ``restored`` (from :func:`unflatten`) into the live ``state`` mapping."""
    missing = [k for k in state if k not in restored]
    extra = [k for k in restored if k not in state]
    if missing or extra:
        raise CheckpointError(step, {}, message=(
            f"state keys differ from the checkpoint of step {step}: missing in checkpoint "
            f"{missing}, not in state {extra}"))
    for key in state:
        state[key] = _merge(state[key], restored[key], str(key), step)


def _merge(live: Any, new: Any, path: str, step: int) -> Any:
    if hasattr(live, "load_state_dict") and hasattr(live, "state_dict"):
        try:
            live.load_state_dict(new)
        except Exception as exc:
            raise CheckpointError(step, {}, message=(
                f"load_state_dict of {path} failed for step {step}: {exc}")) from exc
        return live
    if _is_torch_tensor(live) and _is_torch_tensor(new):
        if live.shape == new.shape and live.dtype == new.dtype:
            with _no_grad():
                live.copy_(new)
            return live
        return new
    if isinstance(live, np.ndarray) and isinstance(new, np.ndarray):
        if live.shape == new.shape and live.dtype == new.dtype and live.flags.writeable:
            np.copyto(live, new)
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

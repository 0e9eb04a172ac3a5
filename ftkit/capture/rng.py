"""Random-number-generator state of Python, NumPy, torch CPU and every CUDA device."""
from __future__ import annotations

import logging
import random
import sys
from typing import Any

import numpy as np

from ftkit.capture.flatten import RESERVED

log = logging.getLogger(__name__)
_RNG_KEYS = {"python", "numpy", "torch", "cuda"}    # the state_dict of RNGState


class RNGState:
    """Put an instance in the checkpointed state; it captures and restores every RNG.

    ``state_dict()`` is taken at capture time, so a checkpoint holds the generators exactly
    as they were when ``save`` was called.
    """

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        np_state: Any = np.random.get_state(legacy=True)
        out: dict[str, Any] = {
            "python": {"version": version, "state": np.asarray(internal, dtype=np.uint64),
                       "gauss": gauss},
            "numpy": {"kind": np_state[0], "keys": np.asarray(np_state[1]).copy(),
                      "pos": int(np_state[2]), "has_gauss": int(np_state[3]),
                      "gauss": float(np_state[4])},
        }
        torch = sys.modules.get("torch")
        if torch is not None:
            out["torch"] = torch.get_rng_state()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                out["cuda"] = list(torch.cuda.get_rng_state_all())
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        py = sd["python"]
        random.setstate((py["version"], tuple(int(v) for v in py["state"]), py["gauss"]))
        n = sd["numpy"]
        np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"],
                             n["has_gauss"], n["gauss"]))
        if "torch" in sd:
            import torch
            torch.set_rng_state(sd["torch"].clone().to(torch.uint8))
            if "cuda" in sd:
                if torch.cuda.is_available():
                    torch.cuda.set_rng_state_all([s.clone() for s in sd["cuda"]])
                else:
                    log.warning("checkpoint holds CUDA RNG state but CUDA is not available; "
                                "CUDA generators not restored")


def rank_local_indices(tree: Any) -> set[int]:
    """Tensor indices of the state that legitimately differ between DP replicas: those of
    ``ftkit.RNGState`` objects (each rank draws its own random streams) and what ftkit saves
    beside an object's state under ``RESERVED`` (:mod:`ftkit.capture.attached`: a loader's
    generator is seeded per rank)."""
    found: set[int] = set()

    def tensors(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("t") == "tensor":
                found.add(int(node["i"]))
            for v in node.values():
                tensors(v)
        elif isinstance(node, list):
            for v in node:
                tensors(v)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            inner = node.get("v")
            if node.get("t") == "obj" and isinstance(inner, dict) and inner.get("t") == "dict":
                items = [item for item in inner.get("items", []) if isinstance(item, list)]
                keys = {item[0] for item in items if item}
                if {"python", "numpy"} <= keys <= _RNG_KEYS:
                    tensors(inner)
                    return
                for item in items:
                    if len(item) == 2 and item[0] == RESERVED:
                        tensors(item[1])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(tree)
    return found

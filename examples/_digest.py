"""A digest of the whole checkpointed training state, for bit-exact resume checks.

The examples print it in their last line; the end-to-end tests compare a run that was killed
and relaunched with a failure-free one. It covers everything a resume must bring back, so a
restore that forgets a part (optimizer moments or step counts, a generator, the loader
position) changes it:

* objects with ``state_dict()`` (modules, optimizers, loaders): their state dicts;
* :class:`ftkit.RNGState`: the *live* generators, read here with the libraries' own getters
  (Python ``random``, NumPy's global generator, torch CPU and every initialised CUDA device
  when torch is imported),
  not through ftkit, so the check does not depend on the code under test;
* plain trees of tensors, arrays and scalars as they are.

Bytes are hashed in a fixed order (mapping keys sorted, lists in order, each value tagged with
its type, dtype and shape). The two representations a checkpoint round trip may legitimately
change are folded together: tuples hash like lists and mapping keys by their ``str``.
This module is not part of ftkit.
"""
from __future__ import annotations

import hashlib
import random
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np
from mpi4py import MPI

import ftkit


def live_rng_states() -> dict[str, Any]:
    """The generators' states as the libraries report them (local)."""
    out: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state()}
    torch = sys.modules.get("torch")           # a NumPy-only example never imports it
    if torch is None:
        return out
    out["torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = list(torch.cuda.get_rng_state_all())
    return out


def resolve(obj: Any) -> Any:
    """``obj`` with state-dict holders replaced by their state dicts and ``RNGState`` by the
    live generator states."""
    if isinstance(obj, ftkit.RNGState):
        return live_rng_states()
    if hasattr(obj, "state_dict") and callable(obj.state_dict):
        return resolve(obj.state_dict())
    if isinstance(obj, Mapping):
        return {k: resolve(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [resolve(v) for v in obj]
    return obj


def feed(h: Any, obj: Any) -> None:
    """Hash ``obj`` (already :func:`resolve`-d) into ``h`` in a canonical order."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}:".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        h.update(f"A{a.dtype.str}{a.shape}:".encode())
        h.update(a.tobytes())
    elif isinstance(obj, Mapping):
        items = sorted(((str(k), v) for k, v in obj.items()), key=lambda kv: kv[0])
        h.update(f"M{len(items)}:".encode())
        for key, value in items:
            h.update(f"K{len(key)}:{key}".encode())
            feed(h, value)
    elif isinstance(obj, (list, tuple)):
        h.update(f"L{len(obj)}:".encode())
        for value in obj:
            feed(h, value)
    elif obj is None or isinstance(obj, (bool, int, float, str, np.generic)):
        value = obj.item() if isinstance(obj, np.generic) else obj
        text = repr(value)
        h.update(f"S{type(value).__name__}{len(text)}:{text}".encode())
    else:
        raise TypeError(f"state_digest: cannot hash a {type(obj).__name__} ({obj!r:.80})")


def part_digest(obj: Any) -> bytes:
    """sha256 of one part of this rank's state (local)."""
    h = hashlib.sha256()
    feed(h, resolve(obj))
    return h.digest()


def state_digest(comm: MPI.Comm, state: Mapping[str, Any]) -> tuple[str, dict[str, str]]:
    """(digest of every rank's whole ``state``, {part: digest of that part over all ranks}).

    Every rank hashes each top-level part of its own state; rank 0 gathers the hashes and
    combines them in (part name, rank) order. Collective over ``comm`` (every rank calls);
    the result is meaningful on rank 0 only (``("", {})`` elsewhere)."""
    mine = {name: part_digest(state[name]) for name in sorted(state)}
    gathered = comm.gather(mine, root=0)
    if gathered is None:       # not the root
        return "", {}
    parts: dict[str, str] = {}
    whole = hashlib.sha256()
    for name in sorted(state):
        h = hashlib.sha256()
        for per_rank in gathered:
            h.update(per_rank[name])
        parts[name] = h.hexdigest()
        whole.update(f"{name}:".encode() + h.digest())
    return whole.hexdigest(), parts

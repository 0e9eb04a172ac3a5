"""Host staging buffers: the snapshot of a rank's tensors taken at ``capture``.

Buffers are allocated once per (tensor path, size) and reused at every later capture, so
the steady state allocates no state-sized memory. After :meth:`Stager.capture` returns, the
training loop may modify the live tensors: the staged bytes are a private copy.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ftkit.capture.flatten import TensorLeaf, _torch


class Stager:
    """Owns the reusable host buffers of one rank. Local; not thread-safe by itself."""

    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}
        self.allocated_bytes = 0

    def buffer(self, path: str, nbytes: int) -> np.ndarray:
        """The uint8 buffer for ``path``; (re)allocated only when its size changed."""
        buf = self._buffers.get(path)
        if buf is None or buf.nbytes != nbytes:
            buf = np.empty(nbytes, dtype=np.uint8)
            self._buffers[path] = buf
            self.allocated_bytes += nbytes
        return buf

    def capture(self, leaves: list[TensorLeaf]) -> list[np.ndarray]:
        """Copy every leaf's bytes into its staging buffer; returns the buffers in order."""
        live = {leaf.path for leaf in leaves}
        for stale in [p for p in self._buffers if p not in live]:
            del self._buffers[stale]
        return [self._copy(leaf) for leaf in leaves]

    def _copy(self, leaf: TensorLeaf) -> np.ndarray:
        buf = self.buffer(leaf.path, leaf.nbytes)
        src = leaf.source
        if leaf.kind == "numpy":
            if leaf.nbytes:
                np.copyto(buf.view(src.dtype).reshape(src.shape), src)
            return buf
        torch = _torch()
        if leaf.nbytes:
            dst: Any = torch.from_numpy(buf).view(src.dtype).reshape(src.shape)
            with torch.no_grad():
                dst.copy_(src.detach())
        return buf

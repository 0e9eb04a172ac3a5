"""Host staging buffers: the snapshot of a rank's tensors taken at ``capture``.

Buffers are allocated once per (leaf index, size) and reused at every later capture, so
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
        self._buffers: list[np.ndarray] = []
        self.allocated_bytes = 0

    def buffer(self, index: int, nbytes: int) -> np.ndarray:
        """The uint8 buffer of leaf ``index``; (re)allocated only when its size changed.
        Keyed by position, not path: two leaves may print the same path."""
        while len(self._buffers) <= index:
            self._buffers.append(np.empty(0, dtype=np.uint8))
        buf = self._buffers[index]
        if buf.nbytes != nbytes:
            buf = np.empty(nbytes, dtype=np.uint8)
            self._buffers[index] = buf
            self.allocated_bytes += nbytes
        return buf

    def capture(self, leaves: list[TensorLeaf]) -> list[np.ndarray]:
        """Copy every leaf's bytes into its staging buffer; returns the buffers in order."""
        del self._buffers[len(leaves):]
        return [self._copy(i, leaf) for i, leaf in enumerate(leaves)]

    def _copy(self, index: int, leaf: TensorLeaf) -> np.ndarray:
        buf = self.buffer(index, leaf.nbytes)
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

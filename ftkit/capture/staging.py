"""Host staging buffers: the snapshot of a rank's tensors taken at ``capture``.

Buffers are allocated once per (leaf index, size) and reused at every later capture, so
the steady state allocates no state-sized memory. GPU tensors are staged into *pinned*
buffers on a side CUDA stream; CPU tensors by a worker thread (``torch`` and NumPy copies
release the GIL), so staging overlaps the next forward/backward.

Only leaves the caller marks *deferrable* are copied in the background — tensors whose only
writer is an optimizer guarded by :meth:`Staging.wait` (see ``Checkpointer.wait_staged``).
Everything else (module buffers such as BatchNorm statistics, which the next forward
changes) is copied before :meth:`Stager.start` returns.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ftkit.capture.flatten import TensorLeaf, _torch

log = logging.getLogger(__name__)


class Staging:
    """One capture whose background part may still run. Local."""

    def __init__(self, future: cf.Future[None] | None) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def wait(self, timeout: float | None = None) -> BaseException | None:
        """Block until the staged bytes are complete; return the staging error, if any
        (raises ``concurrent.futures.TimeoutError`` after ``timeout`` seconds)."""
        if self._future is None:
            return None
        return self._future.exception(timeout=timeout)


class Stager:
    """Owns the reusable host buffers of one rank (and the staging worker when
    ``background``). Calls are made from one thread; the worker only fills buffers."""

    def __init__(self, background: bool = False) -> None:
        self._buffers: list[np.ndarray] = []
        self._owners: list[Any] = []          # pinned torch tensors behind buffers
        self.allocated_bytes = 0
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="ftkit-stage") \
            if background else None
        self._streams: dict[Any, Any] = {}    # CUDA device -> side stream

    def buffer(self, index: int, nbytes: int, pinned: bool = False) -> np.ndarray:
        """The uint8 buffer of leaf ``index``; (re)allocated only when its size (or pinning)
        changed. Keyed by position, not path: two leaves may print the same path."""
        while len(self._buffers) <= index:
            self._buffers.append(np.empty(0, dtype=np.uint8))
            self._owners.append(None)
        buf = self._buffers[index]
        if buf.nbytes != nbytes or (pinned and self._owners[index] is None and nbytes):
            owner = None
            if pinned and nbytes:
                owner = _torch().empty(nbytes, dtype=_torch().uint8, pin_memory=True)
                buf = owner.numpy()
            else:
                buf = np.empty(nbytes, dtype=np.uint8)
            self._buffers[index], self._owners[index] = buf, owner
            self.allocated_bytes += nbytes
        return buf

    def capture(self, leaves: list[TensorLeaf]) -> list[np.ndarray]:
        """Copy every leaf's bytes into its staging buffer now; returns the buffers in order."""
        bufs, staging = self.start(leaves, lambda leaf: False)
        staging.wait()
        return bufs

    def start(self, leaves: list[TensorLeaf], deferrable: Callable[[TensorLeaf], bool]
              ) -> tuple[list[np.ndarray], Staging]:
        """Stage ``leaves``: the non-deferrable ones before returning, the rest in the
        background. Returns the buffers (complete once the :class:`Staging` is done)."""
        del self._buffers[len(leaves):], self._owners[len(leaves):]
        bufs = [self.buffer(i, leaf.nbytes, pinned=_is_cuda(leaf.source))
                for i, leaf in enumerate(leaves)]
        later: list[int] = []
        for i, leaf in enumerate(leaves):
            if self._pool is not None and leaf.nbytes and deferrable(leaf):
                later.append(i)
            else:
                _copy(leaf, bufs[i])
                leaf.source = None
        if not later:
            return bufs, Staging(None)
        pairs = [(leaves[i], bufs[i]) for i in later]
        ready = self._record_ready(pairs)
        assert self._pool is not None
        return bufs, Staging(self._pool.submit(self._copy_all, pairs, ready))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    # ---------------------------------------------------------------- internals
    def _record_ready(self, pairs: Sequence[tuple[TensorLeaf, np.ndarray]]) -> dict[Any, Any]:
        """On the caller's thread: an event per CUDA device on its current stream, so the
        side stream copies the values as of this call."""
        ready = {}
        for leaf, _ in pairs:
            if _is_cuda(leaf.source) and leaf.source.device not in ready:
                event = _torch().cuda.Event()
                event.record(_torch().cuda.current_stream(leaf.source.device))
                ready[leaf.source.device] = event
        return ready

    def _copy_all(self, pairs: Sequence[tuple[TensorLeaf, np.ndarray]],
                  ready: dict[Any, Any]) -> None:
        """Worker thread: CUDA leaves on a side stream into pinned buffers, CPU leaves by
        plain copies; returns when every byte has landed."""
        try:
            done = [self._copy_cuda(dev, [(lf, b) for lf, b in pairs
                                          if _is_cuda(lf.source) and lf.source.device == dev],
                                    event) for dev, event in ready.items()]
            for leaf, buf in pairs:
                if not _is_cuda(leaf.source):
                    _copy(leaf, buf)
            for event in done:
                event.synchronize()
        finally:
            for leaf, _ in pairs:
                leaf.source = None          # no reference to live tensors past staging

    def _copy_cuda(self, device: Any, pairs: list[tuple[TensorLeaf, np.ndarray]],
                   ready: Any) -> Any:
        torch = _torch()
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            stream.wait_event(ready)
            for leaf, buf in pairs:
                src = leaf.source
                dst = torch.from_numpy(buf).view(src.dtype).reshape(src.shape)
                src.record_stream(stream)
                dst.copy_(src.detach(), non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done


def _is_cuda(x: Any) -> bool:
    return bool(getattr(x, "is_cuda", False))


def _copy(leaf: TensorLeaf, buf: np.ndarray) -> None:
    """Blocking copy of one leaf into ``buf``."""
    src = leaf.source
    if not leaf.nbytes:
        return
    if leaf.kind == "numpy":
        np.copyto(buf.view(src.dtype).reshape(src.shape), src)
        return
    torch = _torch()
    dst: Any = torch.from_numpy(buf).view(src.dtype).reshape(src.shape)
    with torch.no_grad():
        dst.copy_(src.detach())

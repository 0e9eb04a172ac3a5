"""Host staging buffers: the snapshot of a rank's tensors taken at ``capture``.

Buffers are allocated once per (leaf index, size) and reused at every later capture, so
the steady state allocates no state-sized memory. GPU tensors are staged into *pinned*
buffers on a side CUDA stream; CPU tensors by a worker thread (``torch`` and NumPy copies
release the GIL), so staging overlaps the next forward/backward.

Only leaves the caller marks *deferrable* are copied in the background — tensors whose only
writer is an optimizer guarded by :meth:`Staging.wait` (see ``Checkpointer.wait_staged``).
Everything else (module buffers such as BatchNorm statistics, which the next forward
changes) is copied before :meth:`Stager.start` returns, and so is every leaf without a
version counter: NumPy arrays and torch inference tensors.

**Torn snapshots are refused, not written.** A deferred tensor may still be changed in place
by the training script before its copy has landed (weight clipping, model averaging,
re-initialisation under ``torch.no_grad()`` right after ``save``). :meth:`Stager.start`
records every torch leaf's version counter (``tensor._version``, bumped by every in-place
op on the tensor or on any view of it, ``detach()`` and ``state_dict()`` views included,
also under ``no_grad`` and ``inference_mode``) and the worker re-checks it once the bytes
have landed (CPU: after each copy, CUDA: once the side stream's event has synchronised),
and again for every leaf when the whole batch has landed. A changed counter fails the
staging with :class:`TornSnapshotError`, so the rank votes no, the step is aborted and
the previous committed step stays; the next ``save`` works normally. Reading the counter
is O(1) per tensor: no pass over the bytes.

Only in-place torch ops on the tensor or on a view of it are seen. Not seen:
``p.data.mul_(0)`` (``p.data`` is a new tensor with its own version counter, bumping
neither ``p._version`` nor that of ``p.detach()``), writes through ``tensor.numpy()`` or
memory shared with ``torch.from_numpy``, and extensions that write through ``data_ptr()``;
call ``ckpt.wait_staged()`` before such changes. A change still running on another thread
at the moment the last copy lands may also escape the check. Models that change their
parameters in the forward pass (``nn.Embedding(max_norm=...)``) must call
``ckpt.wait_staged()`` after ``save``, or their checkpoints may be aborted.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ftkit import passes
from ftkit.buffers import aligned_empty
from ftkit.capture.flatten import TensorLeaf, _torch
from ftkit.errors import FtkitError

log = logging.getLogger(__name__)


class TornSnapshotError(FtkitError):
    """A tensor changed in place between ``save`` and the end of its background copy, so
    its staged bytes may mix old and new values. Local to the rank that staged it; the
    checkpointer turns it into that rank's "no" vote (the step is aborted). The program
    changes the tensor at the same place of its loop after a relaunch: it recurs."""

    recurs = True

    def __init__(self, path: str, step: int | None) -> None:
        self.path, self.step = path, step
        at = f" (step {step})" if step is not None else ""
        super().__init__(f"tensor {path}{at} changed in place while its snapshot was being "
                         f"staged; call ckpt.wait_staged() before modifying parameters "
                         f"outside optimizer.step()")


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
        self._grow(index)
        buf = self._buffers[index]
        if buf.nbytes != nbytes or (pinned and self._owners[index] is None and nbytes):
            owner = None
            if pinned and nbytes:
                owner = _torch().empty(nbytes, dtype=_torch().uint8, pin_memory=True)
                buf = owner.numpy()
            else:
                buf = aligned_empty(nbytes)      # copies into it run at full speed
            self._buffers[index], self._owners[index] = buf, owner
            self.allocated_bytes += nbytes
        return buf

    def capture(self, leaves: list[TensorLeaf]) -> list[np.ndarray]:
        """Copy every leaf's bytes into its staging buffer now; returns the buffers in order."""
        bufs, staging = self.start(leaves, lambda leaf: False)
        staging.wait()
        return bufs

    def start(self, leaves: list[TensorLeaf], deferrable: Callable[[TensorLeaf], bool],
              step: int | None = None, into: Any = None) -> tuple[list[np.ndarray], Staging]:
        """Stage ``leaves``: the non-deferrable ones before returning, the rest in the
        background. Returns the buffers (complete once the :class:`Staging` is done; its
        error is a :class:`TornSnapshotError` naming the leaf and ``step`` if a deferred
        tensor changed in place before its copy landed). Leaves without a version counter
        (NumPy, inference tensors) are never deferred. Raises ``TornSnapshotError`` itself
        if another thread changes a leaf while it is copied here.

        ``into`` (a reserved slot, :class:`ftkit.storage.slots.Reservation`): CPU leaves
        are copied straight into their place in it and get no staging buffer; CUDA leaves
        are staged into pinned buffers as always. Leaves copied in the background (and every
        leaf of a stager without a worker) are hashed as they land (``into.sums``); a
        background stager copies the others on the caller's thread without hashing them
        (the training loop waits for a plain copy only): the write hashes them in place."""
        del self._buffers[len(leaves):], self._owners[len(leaves):]
        bufs = [self._destination(i, leaf, into) for i, leaf in enumerate(leaves)]
        for leaf in leaves:
            leaf.version = _version(leaf.source) if leaf.kind == "torch" else None
        later: list[int] = []
        for i, leaf in enumerate(leaves):
            if (self._pool is not None and leaf.nbytes and leaf.version is not None
                    and deferrable(leaf)):
                later.append(i)
            else:
                _stage(leaf, bufs[i], i, into if self._pool is None else None)
                _check_unchanged(leaf, step)
                leaf.source = None
        if not later:
            return bufs, Staging(None)
        pairs = [(leaves[i], bufs[i]) for i in later]
        ready = self._record_ready(pairs)
        assert self._pool is not None
        return bufs, Staging(self._pool.submit(self._copy_all, pairs, ready, step,
                                               {id(leaves[i]): i for i in later}, into))

    def _destination(self, index: int, leaf: TensorLeaf, into: Any) -> np.ndarray:
        """Where leaf ``index`` is staged: its place in the reserved slot ``into`` (a CPU
        leaf; its own staging buffer is released), else its staging buffer."""
        if into is None or _is_cuda(leaf.source):
            return self.buffer(index, leaf.nbytes, pinned=_is_cuda(leaf.source))
        self._grow(index)
        self._buffers[index], self._owners[index] = np.empty(0, dtype=np.uint8), None
        view: np.ndarray = into.view(index)
        return view

    def _grow(self, index: int) -> None:
        """Make room for leaf ``index`` in the per-leaf buffer lists (empty buffers)."""
        while len(self._buffers) <= index:
            self._buffers.append(np.empty(0, dtype=np.uint8))
            self._owners.append(None)

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
                  ready: dict[Any, Any], step: int | None, index: dict[int, int],
                  into: Any) -> None:
        """Worker thread: CUDA leaves on a side stream into pinned buffers, CPU leaves by
        plain copies; returns when every byte has landed and no leaf's version counter
        moved since :meth:`start` (else raises :class:`TornSnapshotError`)."""
        try:
            done = [self._copy_cuda(dev, [(lf, b) for lf, b in pairs
                                          if _is_cuda(lf.source) and lf.source.device == dev],
                                    event) for dev, event in ready.items()]
            for leaf, buf in pairs:
                if not _is_cuda(leaf.source):
                    _stage(leaf, buf, index[id(leaf)], into)
                    _check_unchanged(leaf, step)      # fail fast: skip the other copies
            for event in done:
                event.synchronize()
            for leaf, _ in pairs:     # CUDA leaves once landed; CPU ones changed meanwhile
                _check_unchanged(leaf, step)
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
                passes.count("copy", leaf.nbytes)
            done = torch.cuda.Event()
            done.record(stream)
        return done


def _is_cuda(x: Any) -> bool:
    return bool(getattr(x, "is_cuda", False))


def _version(t: Any) -> int | None:
    """The version counter in-place ops on ``t`` (or any view of it) bump; None for
    inference tensors, which have none."""
    return None if t.is_inference() else int(t._version)


def _check_unchanged(leaf: TensorLeaf, step: int | None) -> None:
    """Raise (and log) :class:`TornSnapshotError` if ``leaf``'s tensor changed in place
    since :meth:`Stager.start` recorded its version."""
    if leaf.version is None or leaf.source._version == leaf.version:
        return
    error = TornSnapshotError(leaf.path, step)
    log.warning("%s", error)
    raise error


def _stage(leaf: TensorLeaf, buf: np.ndarray, index: int, into: Any) -> None:
    """Copy one CPU leaf into ``buf`` (its staging buffer, or its place in a reserved slot).
    With ``into``, the slot ``buf`` lies in, hash it as it lands (a strided tensor is laid
    out by torch, then hashed); without, a plain copy."""
    if into is None:
        copy_leaf(leaf, buf)
        return
    src = host_bytes(leaf.source) if leaf.nbytes else np.empty(0, dtype=np.uint8)
    if src is None:
        copy_leaf(leaf, buf)
        into.hash_in_place(index)
    else:
        into.copy_in(index, src)


def host_bytes(x: Any) -> np.ndarray | None:
    """A flat read-only uint8 view of a CPU tensor's or array's memory (None when it is
    not contiguous or torch cannot show it as NumPy)."""
    try:
        if isinstance(x, np.ndarray):
            return x.reshape(-1).view(np.uint8) if x.flags.c_contiguous else None
        if not x.is_contiguous() or x.is_conj() or x.is_neg():
            return None
        view: np.ndarray = x.detach().reshape(-1).view(_torch().uint8).numpy()
        return view
    except Exception:  # noqa: BLE001 - any tensor torch cannot show as bytes: copy it
        return None


def copy_leaf(leaf: TensorLeaf, buf: np.ndarray) -> None:
    """Blocking copy of one leaf into ``buf``."""
    src = leaf.source
    if not leaf.nbytes:
        return
    passes.count("copy", leaf.nbytes)
    if leaf.kind == "numpy":
        raw = host_bytes(src)
        if raw is not None:             # every byte, a structured dtype's padding too
            np.copyto(buf, raw)
            return
        if src.dtype.names is not None:     # field by field: padding would be stale bytes
            buf.fill(0)
        np.copyto(buf.view(src.dtype).reshape(src.shape), src)
        return
    torch = _torch()
    dst: Any = torch.from_numpy(buf).view(src.dtype).reshape(src.shape)
    with torch.no_grad():
        dst.copy_(src.detach())

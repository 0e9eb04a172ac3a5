"""Restoring into GPU tensors: one reused pinned host buffer, then one host-to-device copy.

A saved tensor whose live counterpart is a CUDA tensor (:func:`device_target`) is read from
the shard in pieces into a pinned host buffer, hashed as the bytes land
(:meth:`ftkit.storage.shard.Shard.read_through`), and each piece is copied to the live tensor
asynchronously on a side CUDA stream. The buffer has two halves used in turn: reading piece
i + 1 into one half overlaps the copy of piece i out of the other, and a half is reused only
after its copy's event has completed. The buffer is allocated on the first piece and reused
for every later tensor of the restore, so a restore allocates ``2 * piece`` bytes of pinned
memory however large the state; no pageable staging copy, no fresh tensor per leaf.

A restore of a GPU state makes two passes over its bytes: the read (with the checksum) and
the host-to-device copy. On a failed checksum the live tensor has been overwritten, exactly
as a CPU tensor read in place: the caller loads another step over all of them or raises
(``ftkit.recovery.restore.try_load``). :meth:`DeviceLanding.finish` must be called before
the state is used or the buffer dropped. The same code runs on CPU tensors (synchronous
copies, no pinning), which is how it is tested without a GPU. Local.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ftkit import passes

#: bytes per piece (each half of the pinned buffer)
PIECE = 16 << 20


def overwritable(x: Any, device: str) -> bool:
    """``x`` is a torch tensor on ``device`` (``"cpu"``, ``"cuda"``) whose bytes a restore
    may overwrite in place: contiguous, dense, not an inference tensor, no lazy conjugate or
    negative bit, not 0-d."""
    return (getattr(x, "device", None) is not None and x.device.type == device
            and x.is_contiguous() and not (x.is_inference() or x.is_sparse or x.is_quantized
                                           or x.is_conj() or x.is_neg() or x.dim() == 0))


def device_target(x: Any) -> Any | None:
    """``x`` as a flat uint8 torch view when it is a CUDA tensor a restore may overwrite
    (:func:`overwritable`), else None."""
    try:
        if not overwritable(x, "cuda"):
            return None
        import torch
        return x.detach().reshape(-1).view(torch.uint8)
    except Exception:  # noqa: BLE001 - anything torch cannot show as bytes: a new buffer
        return None


class DeviceLanding:
    """Pieces of a tensor read into a reused (pinned, when CUDA is available) host buffer
    and copied into ``target`` (a flat uint8 torch view, :func:`device_target`)."""

    def __init__(self, piece: int = PIECE) -> None:
        self.piece = piece
        self._host: list[Any] = []               # two torch uint8 host tensors
        self._views: list[np.ndarray] = []       # their NumPy views
        self._events: list[Any] = [None, None]
        self._stream: Any = None
        self._turn = 0
        self._target: Any = None

    def start(self, target: Any) -> None:
        """The following pieces belong to ``target`` (flat uint8 torch tensor)."""
        self._target = target

    def buffer(self, offset: int, n: int) -> np.ndarray:
        """The half of the host buffer for the next piece (``n`` bytes of the target at
        ``offset``), once its previous copy is done."""
        if not self._host:
            self._allocate()
        event = self._events[self._turn]
        if event is not None:
            event.synchronize()
            self._events[self._turn] = None
        return self._views[self._turn][:n]

    def land(self, offset: int, piece: np.ndarray) -> None:
        """Copy ``piece`` (the current half) to the target's bytes at ``offset``."""
        import torch
        src = self._host[self._turn][:len(piece)]
        dst = self._target[offset:offset + len(piece)]
        if dst.is_cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=dst.device)
            self._stream.wait_stream(torch.cuda.current_stream(dst.device))
            with torch.cuda.stream(self._stream):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            self._events[self._turn] = event
        else:
            dst.copy_(src)
        passes.count("copy", len(piece))
        self._turn ^= 1

    def finish(self) -> None:
        """Wait for every copy (the live tensors hold the bytes after this)."""
        for i, event in enumerate(self._events):
            if event is not None:
                event.synchronize()
                self._events[i] = None
        if self._stream is not None:
            self._stream.synchronize()

    def _allocate(self) -> None:
        import torch
        pin = torch.cuda.is_available()
        self._host = [torch.empty(self.piece, dtype=torch.uint8, pin_memory=pin)
                      for _ in range(2)]
        self._views = [h.numpy() for h in self._host]

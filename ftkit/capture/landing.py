"""Where a restored tensor's bytes land, piece by piece, when the reading may be given up.

A PFS read runs on a thread under a no-progress deadline
(:func:`ftkit.recovery.pfs_restore.with_deadline`): when the file system hangs, the
restore gives the read up and goes on (an older step, another level) while the thread may
still be stuck in ``pread`` — and may wake up any time later. Such a thread must never write
into the live tensors again: it would overwrite the step restored meanwhile, silently, while
training runs.

So every byte that lands in live memory passes a :class:`Gate`. A piece is read into memory
the reading owns (a private bounce buffer of :data:`PIECE` bytes, reused for every tensor,
so it stays in cache; or the pinned buffer of a :class:`DeviceLanding` for a GPU tensor),
hashed there, and copied into the live tensor while holding the gate's lock, only if the gate
is still open. :meth:`Gate.close` takes the same lock, so once it returns no byte more lands
(a copy in progress finishes first: a memory copy, it cannot hang). A new buffer that no
live tensor shares (a tensor the live state does not have) is read into directly: nobody
else sees it. Local.
"""
from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from ftkit import passes
from ftkit.buffers import BOUNCE, aligned_empty
from ftkit.capture.devicecopy import DeviceLanding

#: bytes per piece of a live host tensor (the bounce buffer: a few MiB stay in cache; its
#: copies into live memory are fast at any alignment, :data:`ftkit.buffers.BOUNCE`)
PIECE = BOUNCE


class Abandoned(Exception):
    """The reading was given up (its gate is closed): nothing more lands in live memory."""


class Gate:
    """Open until :meth:`close`; a reader copies into live memory only inside
    :meth:`passage`, which raises :class:`Abandoned` once the gate is closed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """No byte lands in live memory after this returns (waits for a copy under way)."""
        with self._lock:
            self._closed = True

    @contextlib.contextmanager
    def passage(self) -> Iterator[None]:
        with self._lock:
            if self._closed:
                raise Abandoned("the read was given up (deadline passed): its bytes are "
                                "dropped, the live state is not touched")
            yield


class GatedLanding:
    """The :class:`ftkit.storage.shard.Landing` of one restore's tensors, one after another:
    :meth:`start` each with its destination (from :func:`ftkit.capture.inplace.destination`),
    then its pieces in order; :meth:`finish` before the state is used."""

    def __init__(self, gate: Gate | None = None, piece: int = PIECE) -> None:
        self.gate = gate if gate is not None else Gate()
        self.piece = piece
        self._bounce: list[np.ndarray] = []     # the second one only for a piece read ahead
        self._out: collections.deque[int] = collections.deque()   # handed out, not landed
        self._device: DeviceLanding | None = None
        self._dest: Any = None
        self._mode = "direct"

    def start(self, dest: Any, live: bool) -> None:
        """The next pieces belong to ``dest``: a flat uint8 NumPy array (a live tensor's
        bytes when ``live``, else a new buffer) or a flat uint8 CUDA tensor (always live)."""
        self._dest = dest
        self._out.clear()           # a read given up earlier has no piece in flight now
        if not isinstance(dest, np.ndarray):
            if self._device is None:
                self._device = DeviceLanding(self.piece)
            self._device.start(dest)
            self._mode = "device"
        else:
            self._mode = "bounce" if live else "direct"

    def buffer(self, offset: int, n: int) -> np.ndarray:
        """Where the ``n`` bytes of the destination at ``offset`` are read first."""
        if self._mode == "direct":
            out: np.ndarray = self._dest[offset:offset + n]
            return out
        if self._mode == "device":
            assert self._device is not None
            return self._device.buffer(offset, n)
        turn = 1 if 0 in self._out else 0      # the first one, unless it holds a piece
        if turn == len(self._bounce):
            self._bounce.append(aligned_empty(self.piece))
        self._out.append(turn)
        return self._bounce[turn][:n]

    @property
    def ahead(self) -> bool:
        """May the next piece's buffer be asked for before this one landed (a host
        destination: one bounce buffer more; a GPU's pair of host buffers is used in turn
        only by :meth:`land`)."""
        return self._mode != "device"

    def land(self, offset: int, piece: np.ndarray) -> None:
        """``piece`` (from :meth:`buffer`) holds the destination's bytes at ``offset``:
        copy it there through the gate (a new buffer already holds them)."""
        if self._mode == "direct":
            return
        if self._mode == "bounce":
            self._out.popleft()                    # pieces land in the order asked for
        with self.gate.passage():
            if self._mode == "device":
                assert self._device is not None
                self._device.land(offset, piece)
            else:
                np.copyto(self._dest[offset:offset + len(piece)], piece)
                passes.count("copy", len(piece))

    def finish(self) -> None:
        """Wait for every copy to a GPU (the live tensors hold the bytes after this)."""
        if self._device is not None:
            self._device.finish()

"""Move whole files between ranks over MPI without staging them in Python memory.

The sender maps its file read-only and posts ``Isend`` of views (no copy); the receiver
takes chunks into two reused buffers and writes each while the next one arrives; then fsync
and an atomic rename. Messages are cut into chunks of at most CHUNK bytes.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ftkit.comm.dist import DistComm
from ftkit.storage.shard import _write_all, fsync_dir

CHUNK = 8 << 20
TAG_SIZE, TAG_DATA = 7301, 7302


@contextlib.contextmanager
def mapped(path: Path) -> Iterator[np.ndarray]:
    """Read-only uint8 view of a whole file (empty array for an empty file)."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            yield np.empty(0, dtype=np.uint8)
            return
        # MAP_POPULATE: fault the whole file in at once instead of a page at a time
        mm = mmap.mmap(fh.fileno(), 0, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                       prot=mmap.PROT_READ)
        view = np.frombuffer(mm, dtype=np.uint8)
        try:
            yield view
        finally:
            del view
            with contextlib.suppress(BufferError):
                mm.close()


def chunks(view: np.ndarray) -> list[np.ndarray]:
    return [view[i:i + CHUNK] for i in range(0, len(view), CHUNK)] or [view[:0]]


class FileSend:
    """Post the sends of one file to ``dest``; keep the object alive until completion."""

    def __init__(self, comm: MPI.Comm, path: Path, dest: int) -> None:
        self._ctx = mapped(path)
        self.view = self._ctx.__enter__()
        self.size = np.array([len(self.view)], dtype=np.int64)
        self.reqs = [comm.Isend([self.size, MPI.INT64_T], dest, TAG_SIZE)]
        self.reqs += [comm.Isend([c, MPI.BYTE], dest, TAG_DATA) for c in chunks(self.view)]

    def close(self) -> None:
        self._ctx.__exit__(None, None, None)


class FileRecv:
    """Receive one file from ``source`` into ``path``: the size first, then chunks into two
    reused buffers (one receiving while the other is written), then fsync and rename.
    Writing through ``write(2)`` avoids a page fault per page of a freshly mapped file."""

    def __init__(self, comm: MPI.Comm, path: Path, source: int) -> None:
        self.comm, self.path, self.source = comm, path, source
        self.tmp = path.with_name(f".{path.name}.tmp")
        self.size = np.zeros(1, dtype=np.int64)
        self.reqs = [comm.Irecv([self.size, MPI.INT64_T], source, TAG_SIZE)]
        self._fd: int | None = None
        self._bufs: list[np.ndarray] = []
        self._next = 0            # offset of the next chunk to post
        self._pending: tuple[MPI.Request, np.ndarray] | None = None
        self.done = False

    def start(self) -> None:
        """After the size arrived: create the destination and post the first chunk."""
        self._fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        n = min(CHUNK, int(self.size[0]))
        self._bufs = [np.empty(n, dtype=np.uint8), np.empty(n, dtype=np.uint8)]
        self._post()

    def _post(self) -> None:
        size = int(self.size[0])
        n = min(CHUNK, size - self._next)
        buf = self._bufs[(self._next // CHUNK) % 2][:n]
        self._pending = (self.comm.Irecv([buf, MPI.BYTE], self.source, TAG_DATA), buf)
        self._next += n

    def poll(self) -> bool:
        """Progress: when the chunk in flight arrived, post the next and write this one."""
        if self.done:
            return True
        assert self._pending is not None and self._fd is not None
        req, buf = self._pending
        if not req.Test():
            return False
        if self._next < int(self.size[0]):
            self._post()
        else:
            self._pending = None
            self.done = True
        _write_all(self._fd, buf)
        return self.done

    def finish(self) -> None:
        """fsync and rename into place."""
        assert self._fd is not None
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)

    def abandon(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.tmp.unlink(missing_ok=True)


def exchange(dc: DistComm, sends: list[tuple[Path, int]], recvs: list[tuple[Path, int]],
             phase: str, step: int) -> None:
    """Send and receive whole files point-to-point (each pair of ranks exchanges at most one
    file per direction per call). Every rank named as a peer must call with the matching
    entry; ranks with nothing to do may skip the call."""
    out = [FileSend(dc.comm, path, dest) for path, dest in sends]
    into = [FileRecv(dc.comm, path, source) for path, source in recvs]
    try:
        dc.waitall([r for x in into for r in x.reqs], phase, step)
        for rx in into:
            rx.start()
        sent = [r for x in out for r in x.reqs]
        deadline = time.monotonic() + dc.timeout
        # poll every receiver on every pass (a list, not a short-circuiting generator)
        while not (all([rx.poll() for rx in into]) and MPI.Request.Testall(sent)):  # noqa: C419
            if time.monotonic() > deadline:
                raise dc.timeout_error(phase, step)
            time.sleep(0)
        for rx in into:
            rx.finish()
    except BaseException:
        for rx in into:
            rx.abandon()
        raise
    finally:
        for tx in out:
            tx.reqs = []
            tx.close()


def recv_buffer(dc: DistComm, source: int, phase: str, step: int) -> np.ndarray:
    """Receive one file sent with :class:`FileSend` into memory (size, then chunks)."""
    size = np.zeros(1, dtype=np.int64)
    dc.waitall([dc.comm.Irecv([size, MPI.INT64_T], source, TAG_SIZE)], phase, step)
    buf = np.empty(int(size[0]), dtype=np.uint8)
    dc.waitall([dc.comm.Irecv([c, MPI.BYTE], source, TAG_DATA) for c in chunks(buf)],
               phase, step, spin=True)
    return buf

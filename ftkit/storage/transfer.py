"""Move whole files between ranks over MPI without staging them in Python memory.

The sender maps its file read-only and posts ``Isend`` of views; the receiver creates the
destination (temp name), sizes it, maps it writable and posts ``Irecv`` straight into the
map; then fsync and an atomic rename. Messages are cut into chunks of at most CHUNK bytes.
"""
from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ftkit.comm.dist import DistComm
from ftkit.storage.shard import fsync_dir

CHUNK = 256 << 20
TAG_SIZE, TAG_DATA = 7301, 7302


@contextlib.contextmanager
def mapped(path: Path) -> Iterator[np.ndarray]:
    """Read-only uint8 view of a whole file (empty array for an empty file)."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            yield np.empty(0, dtype=np.uint8)
            return
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
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
    """Receive one file from ``source`` into ``path`` (two steps: size, then data)."""

    def __init__(self, comm: MPI.Comm, path: Path, source: int) -> None:
        self.comm, self.path, self.source = comm, path, source
        self.tmp = path.with_name(f".{path.name}.tmp")
        self.size = np.zeros(1, dtype=np.int64)
        self.reqs = [comm.Irecv([self.size, MPI.INT64_T], source, TAG_SIZE)]
        self._fd: int | None = None
        self._mm: mmap.mmap | None = None

    def post_data(self) -> list[MPI.Request]:
        """After the size arrived: map the destination and post the data receives."""
        size = int(self.size[0])
        self._fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(self._fd, size)
        if size == 0:
            view = np.empty(0, dtype=np.uint8)
        else:
            self._mm = mmap.mmap(self._fd, size)
            view = np.frombuffer(self._mm, dtype=np.uint8)
        self.reqs = [self.comm.Irecv([c, MPI.BYTE], self.source, TAG_DATA)
                     for c in chunks(view)]
        return self.reqs

    def finish(self) -> None:
        """Flush, fsync and rename into place."""
        if self._mm is not None:
            self._mm.flush()
            with contextlib.suppress(BufferError):
                self._mm.close()
        assert self._fd is not None
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)

    def abandon(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
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
        data = [req for x in into for req in x.post_data()]
        dc.waitall(data + [r for x in out for r in x.reqs], phase, step, spin=True)
        for rx in into:
            rx.reqs = []
            rx.finish()
    except BaseException:
        for rx in into:
            rx.abandon()
        raise
    finally:
        for tx in out:
            tx.reqs = []
            tx.close()

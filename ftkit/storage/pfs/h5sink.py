"""The file object libhdf5 writes a new HDF5 file through, so that a failing file system
cannot kill the job.

With h5py's default (``sec2``) driver, a write error — a full parallel file system (ENOSPC),
a quota (EDQUOT), an I/O error (EIO), a directory that vanished — leaves the HDF5 file
open inside libhdf5 with metadata it could not flush. Every later attempt to close it retries
the flush and fails again, including the destructor of whichever h5py object drops the last
reference, on whatever thread and at whatever moment garbage collection runs: the error
surfaces outside any error handling and aborts the MPI job.

:func:`write_new_file` writes through h5py's ``fileobj`` driver into an :class:`H5Sink`
instead. The sink writes with ``pwrite`` on a descriptor ftkit owns and keeps the first
``OSError`` (raised into libhdf5, so the write in progress fails at once). Once the writer
gives up on the file (:meth:`H5Sink.discard`), every further write and truncate is dropped, so
closing the file always succeeds inside the writer's own error handling; the caller removes
the file. Nothing of the abandoned file can fail later.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ftkit import passes


class H5Sink:
    """A seekable binary file over descriptor ``fd`` for h5py's ``fileobj`` driver
    (``seek``/``tell``/``read``/``readinto``/``write``/``truncate``/``flush``). Not
    thread-safe: one writer at a time (h5py serialises calls into libhdf5)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pos = 0
        self.error: OSError | None = None    # the first write error
        self.discarding = False

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_SET:
            self.pos = pos
        elif whence == os.SEEK_CUR:
            self.pos += pos
        else:
            self.pos = os.fstat(self.fd).st_size + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, size: int = -1) -> bytes:
        if size < 0:
            size = max(0, os.fstat(self.fd).st_size - self.pos)
        data = os.pread(self.fd, size, self.pos)
        self.pos += len(data)
        return data

    def readinto(self, buf: Any) -> int:
        n = os.preadv(self.fd, [buf], self.pos)
        self.pos += n
        passes.count("read", n)
        return n

    def write(self, buf: Any) -> int:
        n = self.write_at(buf, self.pos)
        self.pos += n
        return n

    def write_at(self, buf: Any, pos: int) -> int:
        """Write all of ``buf`` at ``pos`` (the position is not moved): libhdf5's writes,
        and a dataset's raw bytes written at their place by ftkit (``hdf5._write_raw``)."""
        view = memoryview(buf).cast("B")
        n = len(view)
        if not self.discarding:
            if self.error is not None:
                raise self.error
            try:
                done = 0
                while done < n:
                    done += os.pwrite(self.fd, view[done:], pos + done)
                passes.count("write", n)
            except OSError as exc:
                self.error = exc
                raise
        return n

    def truncate(self, size: int | None = None) -> int:
        size = self.pos if size is None else size
        if not self.discarding:
            if self.error is not None:
                raise self.error
            try:
                os.ftruncate(self.fd, size)
            except OSError as exc:
                self.error = exc
                raise
        return size

    def flush(self) -> None:
        """Nothing is buffered here (durability: the caller fsyncs the descriptor)."""

    def discard(self) -> None:
        """The file is abandoned: from now on writes and truncates are dropped."""
        self.discarding = True


def write_new_file(fd: int, fill: Callable[[Any, H5Sink], None], where: str) -> None:
    """Create an HDF5 file on the empty file open at ``fd`` (read-write) and let
    ``fill(h5, sink)`` write into the open h5py File (``sink``: the file under it, for raw
    data written at its place); close it and fsync ``fd``. On any failure the file is
    closed inside this call with every further write dropped (nothing of it can fail later,
    from a destructor or the garbage collector, on any thread) and the error is raised: the
    file system's own ``OSError`` (errno and ``where`` named) when a write failed, else what
    ``fill`` raised. The caller removes the file then."""
    import h5py
    sink = H5Sink(fd)
    h5 = None
    try:
        h5 = h5py.File(sink, "w")
        fill(h5, sink)
        h5.close()
        os.fsync(fd)
    except BaseException as exc:
        sink.discard()
        if h5 is not None:
            h5.close()
        err = sink.error if sink.error is not None else exc
        if isinstance(err, OSError) and err.errno is not None and not err.filename:
            raise OSError(err.errno, f"{err.strerror or err} (writing {where})") from exc
        raise

"""A verified PFS dataset's bytes, read piece by piece from its file into a landing.

h5py reads a dataset into a new array: a restore would then copy it into the live tensor
(a second pass over every byte, a page fault per page of the new array, a second copy of
the state in memory) and could not be followed by a deadline piece by piece. ftkit's
datasets are plain — contiguous (earlier versions wrote tensors above 64 MiB in chunks of
rows: chunked along dimension 0 only), no filters, their data inside their own file
(:func:`h5files.check_storage`, checked before any byte is read) — so their bytes lie at
file offsets libhdf5 reports. :func:`spans` lists
them; :func:`read_dataset` reads each piece with ``preadv`` into the landing's buffer
(:class:`ftkit.storage.shard.Landing`), hashes it while it is in cache and lands it — a
large dataset's next piece read meanwhile on a helper thread. A
dataset stored any other way (compact, other chunk shapes, a type not laid out on disk as
NumPy lays it out in memory) is read through h5py once and handed over in the same pieces.

The bytes are trusted only through their checksum, which the caller compares: libhdf5's
offsets come from metadata already checked against the step's COMMITTED file digests.
Local.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import xxhash

from ftkit import passes
from ftkit.storage.pfs.hdf5 import raw_bytes
from ftkit.storage.shard import XXH3, Landing

#: (offset in the file, offset in the tensor's bytes, length)
Span = tuple[int, int, int]
#: pieces of a dataset from which the next one is read ahead on a helper thread
AHEAD_MIN = 3


def _h5py() -> Any:
    import h5py
    return h5py


def spans(ds: Any, nbytes: int) -> list[Span] | None:
    """Where the ``nbytes`` bytes of ``ds`` lie in its file, in tensor order, when they can
    be read straight from it (their layout on disk is NumPy's in memory); None when h5py
    must read the dataset."""
    dt = ds.dtype
    if (dt.kind not in "biufc" or not dt.isnative or ds.id.get_type().get_size() != dt.itemsize
            or nbytes != ds.size * dt.itemsize):
        return None
    h5d = _h5py().h5d
    layout = ds.id.get_create_plist().get_layout()
    if layout == h5d.CONTIGUOUS:
        offset = ds.id.get_offset()
        if offset is None:
            return [] if nbytes == 0 else None
        return [(int(offset), 0, nbytes)]
    if layout == h5d.CHUNKED and ds.ndim and tuple(ds.chunks[1:]) == tuple(ds.shape[1:]):
        return _row_chunks(ds, nbytes)
    return None


def _row_chunks(ds: Any, nbytes: int) -> list[Span] | None:
    """The spans of a dataset chunked along dimension 0 only: every chunk unfiltered, the
    chunks covering the rows once, in order (None otherwise)."""
    rows, total = int(ds.chunks[0]), int(ds.shape[0])
    if total == 0:
        return [] if nbytes == 0 else None
    row = nbytes // total
    infos = sorted((ds.id.get_chunk_info(i) for i in range(ds.id.get_num_chunks())),
                   key=lambda info: tuple(info.chunk_offset))
    out: list[Span] = []
    at = 0
    for info in infos:
        length = min(rows, total - at) * row
        if (tuple(info.chunk_offset) != (at, *[0] * (ds.ndim - 1)) or info.filter_mask
                or info.size < length):
            return None
        out.append((int(info.byte_offset), at * row, length))
        at += rows
    return out if at >= total else None


def read_dataset(fd: int | None, ds: Any, nbytes: int, landing: Landing) -> str:
    """Read the ``nbytes`` bytes of ``ds`` into ``landing`` in pieces of at most
    ``landing.piece`` bytes, in order; return their checksum (``xxh3-64:...``, as the
    dataset's ``checksum`` attribute writes it). ``fd``: the dataset's file, open for
    reading (None: read through h5py). OSError / ValueError when the bytes cannot be read."""
    where = spans(ds, nbytes) if fd is not None else None
    if where is None:
        raw = raw_bytes(ds[()])
        if raw.nbytes != nbytes:
            raise ValueError(f"read {raw.nbytes} bytes, expected {nbytes}")
        where = [(0, 0, nbytes)]

        def fill(out: np.ndarray, pos: int) -> None:
            np.copyto(out, raw[pos:pos + len(out)])
    else:
        def fill(out: np.ndarray, pos: int) -> None:
            assert fd is not None
            _pread(fd, out, pos)
    h = xxhash.xxh3_64()
    pieces = [(file_at + a, at + a, min(landing.piece, length - a))
              for file_at, at, length in where for a in range(0, length, landing.piece)]
    for at, piece in _filled(pieces, landing, fill):
        h.update(piece.data)
        landing.land(at, piece)
    passes.count("read", nbytes)
    return XXH3 + h.hexdigest()


def _filled(pieces: list[Span], landing: Landing, fill: Callable[[np.ndarray, int], None]
            ) -> Iterator[tuple[int, np.ndarray]]:
    """``(offset in the tensor, buffer)`` of every piece, read into the landing's buffers in
    order. With :data:`AHEAD_MIN` pieces or more and a landing whose buffers alternate
    (``ahead``), the next piece is read on a helper thread while the caller hashes and lands
    this one (``preadv`` releases the GIL): the disk never waits for the CPU. A read still
    running when the caller gives up ends before this returns."""
    if len(pieces) < AHEAD_MIN or not getattr(landing, "ahead", False):
        for file_at, at, n in pieces:
            buf = landing.buffer(at, n)
            fill(buf, file_at)
            yield at, buf
        return
    with cf.ThreadPoolExecutor(1, thread_name_prefix="ftkit-read") as reader:
        def ahead(k: int) -> tuple[np.ndarray, cf.Future[None]]:
            file_at, at, n = pieces[k]
            buf = landing.buffer(at, n)            # in order, on the caller's thread
            return buf, reader.submit(fill, buf, file_at)
        buf, pending = ahead(0)
        for k in range(len(pieces)):
            pending.result()
            this = buf
            if k + 1 < len(pieces):
                buf, pending = ahead(k + 1)
            yield pieces[k][1], this


def read_range(fd: int, where: list[Span], lo: int, out: np.ndarray) -> None:
    """Bytes ``lo .. lo + len(out)`` of a dataset whose bytes lie at ``where``
    (:func:`spans`) into ``out`` (flat uint8). OSError on a short read."""
    hi = lo + len(out)
    for file_at, at, length in where:
        a, b = max(lo, at), min(hi, at + length)
        if a < b:
            _pread(fd, out[a - lo:b - lo], file_at + a - at)
    passes.count("read", len(out))


def _pread(fd: int, out: np.ndarray, pos: int) -> None:
    """All of ``out`` from offset ``pos`` of ``fd``; OSError when the file ends early."""
    if os.preadv(fd, [out.data], pos) != len(out):
        raise OSError(f"short read at offset {pos} (the file ends early)")


class BlockSums:
    """The xxh3-64 of every ``size``-byte block of a byte stream fed in pieces of any size
    (a dataset's ``block_checksums``, recomputed by ``ftkit verify``)."""

    def __init__(self, size: int) -> None:
        self.size, self.left = size, size
        self.sums: list[int] = []
        self.h = xxhash.xxh3_64()

    def update(self, data: memoryview) -> None:
        data = data.cast("B")
        while len(data):
            take = min(self.left, len(data))
            self.h.update(data[:take])
            data, self.left = data[take:], self.left - take
            if not self.left:
                self._close()

    def _close(self) -> None:
        self.sums.append(self.h.intdigest())
        self.h, self.left = xxhash.xxh3_64(), self.size

    def done(self) -> list[int]:
        """Every block's digest (the last one may be short)."""
        if self.left != self.size:
            self._close()
        return self.sums

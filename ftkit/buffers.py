"""Host buffers that the kernel fills at full speed.

Bulk bytes reach ftkit's own memory through the kernel: ``preadv`` from node-local shards
and PFS files, and MPI receives, which Open MPI's shared-memory transport copies with
``process_vm_readv`` (single copy, CMA). Whether that copy runs at memory speed depends on
where the *destination* starts: NumPy allocates a large array with ``malloc``, whose block
starts 16 bytes past a page boundary, and on the x86-64 machine measured here (AMD EPYC,
``rep movsb`` copies) the kernel's copy from a 64-byte-aligned source (a page-cache page;
the tensors of a shard or an HDF5 file start at multiples of 64) into such a buffer runs at
a third of its speed (256 MiB by ``preadv`` from tmpfs in 4 MiB pieces: 0.132 s into a
buffer at offset 16, 0.044 s at offsets 0, 32 or 48, or at 16 from a file offset of 16; an
MPI receive of 64 MiB: 0.026 s vs 0.0075 s). The C library's ``memcpy`` of 256 KiB pieces
into such memory is as slow; in 4 MiB pieces it takes a streaming path that is not.
Copies *out of* misaligned memory (writes, sends) are not affected. So every buffer ftkit
allocates to be filled by a read or a receive comes from :func:`aligned_empty` /
:func:`aligned_zeros` (page-aligned), and a read into memory it does not own (a live tensor)
goes through an aligned bounce when that memory is misaligned (:func:`misaligned`), copied
out in pieces of :data:`BOUNCE`. This module imports only NumPy.
"""
from __future__ import annotations

import numpy as np

#: where ftkit's own buffers start (a page: also what ``O_DIRECT`` needs)
PAGE = 4096
#: a destination aligned to this many bytes is filled at full speed
FAST_ALIGN = 64
#: bytes per copy out of a bounce into misaligned memory: a copy this large takes the C
#: library's streaming path, which is fast at any alignment (one of 256 KiB is as slow as
#: the kernel's: 0.095 s per 256 MiB vs 0.022 s in pieces of 4 MiB)
BOUNCE = 4 << 20


def aligned_empty(nbytes: int) -> np.ndarray:
    """A new flat uint8 array of ``nbytes`` starting on a page boundary (uninitialised)."""
    base = np.empty(nbytes + PAGE, dtype=np.uint8)
    at = -base.ctypes.data % PAGE
    return base[at:at + nbytes]


def aligned_zeros(nbytes: int) -> np.ndarray:
    """:func:`aligned_empty`, zero-filled."""
    buf = aligned_empty(nbytes)
    buf.fill(0)
    return buf


def misaligned(buf: np.ndarray) -> bool:
    """True when the kernel would fill ``buf`` slowly (it does not start on
    :data:`FAST_ALIGN` bytes)."""
    return bool(buf.ctypes.data % FAST_ALIGN)

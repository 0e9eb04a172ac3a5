"""The disk's bounds of ``hdf5_vs_dcp.py`` (buffered and ``O_DIRECT`` writes, cold reads)
and dropping a file's cached pages, so every read figure reads the disk."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def fs_write(path: Path, views: list[Any]) -> None:
    """The file-system bound: write(2) every tensor's bytes into one file, fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for v in views:
            mv = memoryview(v)
            while mv:
                mv = mv[os.write(fd, mv):]
        os.fsync(fd)
    finally:
        os.close(fd)


#: pieces of the O_DIRECT bound (as ftkit's flush writes them)
DIRECT_PIECE = 4 << 20


def aligned_copy(views: list[Any]) -> Any:
    """The state's bytes once more, in page-aligned anonymous memory (O_DIRECT needs it)."""
    import mmap

    import numpy as np
    n = sum(v.nbytes for v in views)
    buf = np.frombuffer(mmap.mmap(-1, max(n, 1)), dtype=np.uint8)[:n]
    at = 0
    for v in views:
        buf[at:at + v.nbytes] = v
        at += v.nbytes
    return buf


def fs_write_direct(path: Path, buf: Any) -> None:
    """The other file-system bound: the same bytes written with O_DIRECT (whole 4 KiB blocks,
    the tail without), fsync: no page cache, no write-back."""
    head = buf.nbytes - buf.nbytes % 4096
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        for at in range(0, head, DIRECT_PIECE):
            os.pwrite(fd, buf[at:min(at + DIRECT_PIECE, head)], at)
    finally:
        os.close(fd)
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, buf[head:], head)
        os.fsync(fd)
    finally:
        os.close(fd)


def fs_read(path: Path, views: list[Any]) -> None:
    """The file-system bound: readinto(2) the file straight into the live tensors."""
    with open(path, "rb", buffering=0) as fh:
        for v in views:
            mv = memoryview(v)
            while mv:
                n = fh.readinto(mv)
                if not n:
                    raise EOFError(path)
                mv = mv[n:]


#: pieces of the node-local bound (a node-local restore reads a shard in these)
LOCAL_PIECE = 256 << 10


def local_read(path: Path, views: list[Any], *, verify: bool) -> None:
    """The node-local bound: the file (on tmpfs: memory) read straight into the live tensors
    with ``preadv`` in :data:`LOCAL_PIECE` pieces, as a node-local restore reads a shard;
    with ``verify``, each piece also hashed (xxh3-64) while it is in cache, as the restore
    checks every byte it loads."""
    import xxhash
    fd = os.open(path, os.O_RDONLY)
    try:
        at, h = 0, xxhash.xxh3_64()
        for v in views:
            for a in range(0, v.nbytes, LOCAL_PIECE):
                part = v[a:a + LOCAL_PIECE]
                if os.preadv(fd, [part.data], at) != part.nbytes:
                    raise EOFError(path)
                if verify:
                    h.update(part.data)
                at += part.nbytes
    finally:
        os.close(fd)


def drop_pages(host: Any, *paths: Path) -> None:
    """Every host: its first rank drops the cached pages of every file under ``paths``
    (fsync, then ``POSIX_FADV_DONTNEED``; no privilege needed), so the next read of them
    reads the disk. Collective over ``host`` (the ranks of this host), then over the world
    by the caller's barrier."""
    if host.rank == 0:
        for root in paths:
            files = [root] if root.is_file() else \
                [Path(d) / f for d, _, names in os.walk(root) for f in names]
            for path in files:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    host.Barrier()

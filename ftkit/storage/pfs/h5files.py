"""HDF5 files of the PFS level as untrusted input: what may be opened, what a dataset may be
backed by, and byte digests checked *before* libhdf5 parses a file (docs/formats.md).

libhdf5 was not written for hostile or damaged files: a flipped byte in a file's metadata can
make it loop forever or crash the process, and an HDF5 file can point outside itself (external
links, external raw storage, virtual datasets). So the PFS level records, in each step's
``COMMITTED``, a *file digest* of every HDF5 file it wrote:

* ``size``: the file's length;
* ``raw``: the byte ranges ``[offset, length]`` holding tensor data (each tensor carries its own
  xxh3-64 checksum, verified when it is read);
* ``meta``: xxh3-64 over every other byte, in file order (superblock, object headers, B-trees,
  heaps, attributes, free space).

:func:`check_file` verifies size and ``meta`` with plain reads before h5py opens the file, so a
changed byte is either caught there or lies in a tensor's data and is caught by that tensor's
checksum: libhdf5 only ever parses metadata ftkit wrote. Where no digest exists (a file given
to the CLI on its own), the CLI reads in a sandboxed child process instead.

Datasets are accepted only with plain storage in the same file (contiguous, chunked without
filters, or compact) that lies inside the file (:func:`check_storage`).
"""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

import xxhash

from ftkit.errors import CorruptCheckpointError

NODE_FILE = re.compile(r"node-(\d{1,9})\.h5")
RANK_FILE = re.compile(r"rank-(\d{1,9})\.h5")
#: the one file of a step written by all ranks together (``FTKIT_PFS_FILES=shared``)
SHARED_FILE = "ranks.h5"
_READ = 16 << 20
XXH3 = "xxh3-64:"


def _h5py() -> Any:
    import h5py
    return h5py


def regular_file(path: Path, *, step: int | None = None, rank: int | None = None) -> int:
    """The size of ``path``, which must be a regular file and not a symlink
    (CorruptCheckpointError naming it otherwise: a FIFO would block the reader forever, a
    symlink could point anywhere)."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise CorruptCheckpointError(str(path), f"cannot read: {exc.strerror or exc}",
                                     rank=rank, step=step, level="pfs") from exc
    if not stat.S_ISREG(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else \
            "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise CorruptCheckpointError(str(path), f"is {kind}; checkpoint files must be regular "
                                     f"files", rank=rank, step=step, level="pfs")
    return int(st.st_size)


def open_regular(path: Path, *, step: int | None = None, rank: int | None = None) -> int:
    """``path`` opened read-only for plain reads (``preadv``): not through a symlink, never
    blocking on a FIFO, and a regular file once open (CorruptCheckpointError naming it
    otherwise). The caller closes the descriptor."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise CorruptCheckpointError(str(path), f"cannot read: {exc.strerror or exc}",
                                     rank=rank, step=step, level="pfs") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptCheckpointError(str(path), "is not a regular file; checkpoint files "
                                     "must be regular files", rank=rank, step=step,
                                     level="pfs")
    return fd


def open_file(path: Path, digest: Any = None, *, check: bool = False,
              step: int | None = None, rank: int | None = None) -> tuple[Any, int]:
    """(h5py file open read-only, size) of ``path``, after checking it is a regular file
    (not a symlink, FIFO or device) — with ``check``, against its recorded ``digest``
    (:func:`check_file`). Raises CorruptCheckpointError naming the file."""
    size = check_file(path, digest, step=step, rank=rank) if check else \
        regular_file(path, step=step, rank=rank)
    try:
        return _h5py().File(path, "r", locking=False), size
    except Exception as exc:
        raise CorruptCheckpointError(str(path), f"cannot read as HDF5: {type(exc).__name__}: "
                                     f"{exc}", rank=rank, step=step, level="pfs") from exc


def node_file_name(name: Any) -> str | None:
    """``name`` when it is a node file name the PFS level writes (``node-<id>.h5``: no
    directory part), else None."""
    return name if isinstance(name, str) and NODE_FILE.fullmatch(name) else None


def rank_file_name(name: Any, rank: int) -> str | None:
    """``name`` when it is the name of ``rank``'s own file (``rank-<r>.h5``: no directory
    part, that rank's number), else None."""
    m = RANK_FILE.fullmatch(name) if isinstance(name, str) else None
    return name if m is not None and int(m.group(1)) == rank else None


def shared_file_name(name: Any) -> str | None:
    """``name`` when it is the name of a step's shared file (``ranks.h5``), else None."""
    return name if name == SHARED_FILE else None


def step_file(name: str) -> bool:
    """True for the names of the HDF5 data files of a step (node, rank and shared files)."""
    return bool(NODE_FILE.fullmatch(name) or RANK_FILE.fullmatch(name)) or name == SHARED_FILE


# --------------------------------------------------------------------------- storage

def check_storage(ds: Any, file_size: int, nbytes: int) -> None:
    """A dataset's raw data must live in its own file, unfiltered, inside the file's
    ``file_size`` bytes, and cover its ``nbytes``: no external raw storage (a dataset backed
    by ``/etc/passwd``), no virtual dataset (data from other files), no filters (a
    decompression bomb), no unallocated 8 GiB dataset in an 8 KiB file (reading it would
    allocate 8 GiB of fill values). Checked from the metadata alone, before any data is read.
    ValueError naming the problem."""
    h5d = _h5py().h5d
    if ds.is_virtual:
        raise ValueError("is a virtual dataset (its data would come from other files)")
    plist = ds.id.get_create_plist()
    if plist.get_external_count():
        raise ValueError("has external raw storage (its data lives in another file)")
    if plist.get_nfilters():
        raise ValueError("has I/O filters (compression or others); ftkit writes none")
    layout = plist.get_layout()
    if layout not in (h5d.CONTIGUOUS, h5d.CHUNKED, h5d.COMPACT):
        raise ValueError(f"has an unknown storage layout ({layout})")
    stored = 0
    for offset, size in _extents(ds, layout, h5d):
        if offset < 0 or size < 0 or offset + size > file_size:
            raise ValueError(f"declares {size} bytes of data at offset {offset}, past the end "
                             f"of the {file_size}-byte file")
        stored += size
    if layout == h5d.COMPACT:
        stored = int(ds.id.get_storage_size())
    if stored < nbytes:
        raise ValueError(f"needs {nbytes} bytes but only {stored} bytes of data are stored "
                         f"in the {file_size}-byte file")


def _extents(ds: Any, layout: int, h5d: Any) -> list[tuple[int, int]]:
    """(offset, length) of a dataset's raw data in its file (compact data lives in the object
    header: no extent; unallocated storage: none)."""
    if layout == h5d.CONTIGUOUS:
        offset = ds.id.get_offset()
        return [] if offset is None else [(int(offset), int(ds.id.get_storage_size()))]
    if layout == h5d.CHUNKED:
        out = []
        for i in range(ds.id.get_num_chunks()):
            info = ds.id.get_chunk_info(i)
            out.append((int(info.byte_offset), int(info.size)))
        return out
    return []


def raw_extents(h5: Any) -> list[list[int]]:
    """Sorted, merged ``[offset, length]`` ranges of every dataset's raw data in an open file
    (hard-linked objects only; the file's own writer calls it)."""
    h5d = _h5py().h5d
    found: list[tuple[int, int]] = []

    def visit(_name: str, obj: Any) -> None:
        if hasattr(obj, "dtype") and obj.file.id == h5.id:
            found.extend(_extents(obj, obj.id.get_create_plist().get_layout(), h5d))
    h5.visititems(visit)
    merged: list[list[int]] = []
    for offset, size in sorted(found):
        if size <= 0:
            continue
        if merged and offset <= merged[-1][0] + merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], offset + size - merged[-1][0])
        else:
            merged.append([offset, size])
    return merged


# --------------------------------------------------------------------------- digests

def _hash_gaps(fd: int, size: int, raw: list[list[int]]) -> str:
    """xxh3-64 of every byte of the open file ``fd`` (``size`` bytes) outside ``raw``."""
    h = xxhash.xxh3_64()
    pos = 0
    for offset, length in [*raw, [size, 0]]:
        while pos < offset:
            chunk = os.pread(fd, min(_READ, offset - pos), pos)
            if not chunk:
                raise EOFError(f"file ends at {pos}, expected {size} bytes")
            h.update(chunk)
            pos += len(chunk)
        pos = max(pos, offset + length)
    return XXH3 + h.hexdigest()


def file_digest(path: Path) -> dict[str, Any]:
    """The digest of an HDF5 file ftkit just wrote (``{"size", "raw", "meta"}``, see the
    module doc). Opens it with h5py to find the raw-data ranges, then hashes the rest."""
    with _h5py().File(path, "r", locking=False) as h5:
        raw = raw_extents(h5)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        return {"size": size, "raw": raw, "meta": _hash_gaps(fd, size, raw)}
    finally:
        os.close(fd)


def _valid_ranges(raw: Any, size: int) -> bool:
    pos = 0
    for item in raw if isinstance(raw, list) else [None]:
        if not (isinstance(item, list) and len(item) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in item)):
            return False
        offset, length = item
        if offset < pos or length <= 0 or offset + length > size:
            return False
        pos = offset + length
    return True


def check_file(path: Path, digest: Any, *, step: int | None = None,
               rank: int | None = None) -> int:
    """Verify ``path`` against its recorded ``digest`` before anything parses it: a regular
    file of the recorded size whose bytes outside the raw-data ranges hash to ``meta``.
    Returns the size. Raises CorruptCheckpointError naming the file (and step/rank when
    given)."""
    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(str(path), why, rank=rank, step=step, level="pfs")
    size = regular_file(path, step=step, rank=rank)
    if not (isinstance(digest, dict) and isinstance(digest.get("size"), int)
            and isinstance(digest.get("meta"), str)
            and _valid_ranges(digest.get("raw"), digest["size"])):
        raise bad(f"its digest in COMMITTED is malformed: {str(digest)[:200]}")
    if size != digest["size"]:
        raise bad(f"is {size} bytes, COMMITTED recorded {digest['size']} (truncated or "
                  f"changed after the step was committed)")
    fd = open_regular(path, step=step, rank=rank)
    try:
        got = _hash_gaps(fd, size, digest["raw"])
    except (OSError, EOFError) as exc:
        raise bad(f"cannot read: {exc}") from exc
    finally:
        os.close(fd)
    if got != digest["meta"]:
        raise bad(f"HDF5 metadata digest mismatch: COMMITTED recorded {digest['meta']}, the "
                  f"file's bytes outside its tensor data give {got} (damaged or changed after "
                  f"the step was committed); not opened")
    return size

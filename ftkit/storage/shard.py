"""The ``.ftk`` shard format: one rank's state at one step, self-describing, no pickle.

Layout (little endian)::

    0   8   magic  b"FTKSHRD\\0"
    8   4   format version (uint32)
    12  4   header length H (uint32)
    16  8   xxh3-64 of the header bytes (uint64)
    24  H   header: UTF-8 JSON
    ..      zero padding to a multiple of ALIGN
    ..      tensor bytes, each starting at a multiple of ALIGN (offsets in the header)

The header holds the format version, job, step, rank, world size, topology coordinates, the
JSON skeleton of the state tree and one entry per tensor: path, kind, dtype, shape, offset,
nbytes and ``xxh3-64`` checksum. Files are written to a temporary name, fsynced and renamed,
so a shard either exists complete or not at all; reads are memory-mapped.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Self

import numpy as np
import xxhash

from ftkit.capture.flatten import TensorLeaf
from ftkit.errors import CorruptCheckpointError

MAGIC = b"FTKSHRD\0"
VERSION = 1
ALIGN = 64
_PREAMBLE = struct.Struct("<8sIIQ")


def checksum(buf: Any) -> str:
    """Checksum string of a buffer (``xxh3-64:<hex>``)."""
    return "xxh3-64:" + xxhash.xxh3_64_hexdigest(memoryview(buf))


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def build_header(meta: dict[str, Any], tree: Any, leaves: list[TensorLeaf],
                 buffers: list[np.ndarray]) -> tuple[bytes, list[int]]:
    """Header bytes and data offsets for ``leaves`` whose bytes are ``buffers`` (pure)."""
    entries: list[dict[str, Any]] = [{"path": lf.path, "kind": lf.kind, "dtype": lf.dtype, "shape": list(lf.shape),
                "nbytes": lf.nbytes, "checksum": checksum(buf)}
               for lf, buf in zip(leaves, buffers)]
    # offsets depend on the header length, which depends on the offsets' digits: iterate
    offsets = [0] * len(entries)
    for _ in range(4):
        for e, off in zip(entries, offsets):
            e["offset"] = off
        head = json.dumps({"format": VERSION, **meta, "tree": tree, "tensors": entries},
                          separators=(",", ":")).encode()
        pos = _align(_PREAMBLE.size + len(head))
        new = []
        for e in entries:
            new.append(pos)
            pos = _align(pos + e["nbytes"])
        if new == offsets:
            return head, offsets
        offsets = new
    raise AssertionError("shard header offsets did not converge")


def write_shard(path: Path, meta: dict[str, Any], tree: Any, leaves: list[TensorLeaf],
                buffers: list[np.ndarray]) -> int:
    """Atomically write a shard to ``path`` (temp file, fsync, rename). Returns its size."""
    head, offsets = build_header(meta, tree, leaves, buffers)
    start = _PREAMBLE.pack(MAGIC, VERSION, len(head), xxhash.xxh3_64_intdigest(head)) + head

    def pieces() -> Iterator[Any]:
        pos = len(start)
        yield start
        for off, buf in zip(offsets, buffers):
            yield bytes(off - pos)
            yield memoryview(buf).cast("B")  # type: ignore[arg-type]
            pos = off + buf.nbytes
    return write_atomic(path, pieces())


def write_atomic(path: Path, pieces: Iterable[Any]) -> int:
    """Write ``pieces`` (buffers) to ``path`` atomically: a private temp file in the same
    directory, fsync, rename, fsync of the directory. Returns the bytes written; on error
    the temp file is removed and ``path`` is untouched."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        size = sum(_write_all(fd, piece) for piece in pieces)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return size


def _write_all(fd: int, data: Any) -> int:
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])
    return done


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename inside it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


XXH3 = "xxh3-64:"


class ShardFormatError(ValueError):
    """A shard's preamble or header is malformed (the reason, without file or rank)."""


def header_length(preamble: bytes, size: int) -> int:
    """Check the preamble of a ``size``-byte shard (magic, version, header bounds); return
    the header length. Raises ShardFormatError."""
    magic, version, hlen, _ = _PREAMBLE.unpack_from(preamble, 0)
    if magic != MAGIC:
        raise ShardFormatError(f"not an ftkit shard (magic {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise ShardFormatError(f"shard format version {version}, this ftkit reads version "
                               f"{VERSION}")
    if _PREAMBLE.size + hlen > size:
        raise ShardFormatError(f"header of {hlen} bytes runs past the end of the {size}-byte "
                               f"file (truncated)")
    return int(hlen)


def parse_header(head: bytes, size: int) -> tuple[dict[str, Any], list[tuple[int, int, str, str]]]:
    """Validate preamble + header bytes ``head`` of a ``size``-byte shard: header checksum,
    JSON, required keys, and tensor ranges that lie after the header, inside the file and
    do not overlap. Returns the header and the ranges ``(offset, end, checksum, path)`` in
    file order. Raises ShardFormatError."""
    hsum = _PREAMBLE.unpack_from(head, 0)[3]
    raw = bytes(head[_PREAMBLE.size:])
    if xxhash.xxh3_64_intdigest(raw) != hsum:
        raise ShardFormatError("header checksum mismatch")
    try:
        header = json.loads(raw)
        spans = sorted((int(t["offset"]), int(t["offset"]) + int(t["nbytes"]),
                        str(t["checksum"]), str(t["path"])) for t in header["tensors"])
        header["tree"], header["rank"], header["step"], header["world"]
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
        raise ShardFormatError(f"malformed shard header: {exc!r}") from exc
    end = len(head)
    for off, stop, digest, name in spans:
        if off < end or stop < off or stop > size:
            raise ShardFormatError(
                f"tensor {name} at bytes {off}..{stop} overlaps the header or another "
                f"tensor, or runs past the end of the {size}-byte file (truncated?)")
        if not digest.startswith(XXH3):
            raise ShardFormatError(f"tensor {name} has an unknown checksum {digest!r}")
        end = stop
    return header, spans


class Shard:
    """A validated, memory-mapped shard. ``open`` checks the preamble and header only;
    :meth:`verify` checks every tensor's checksum; :meth:`array` returns a zero-copy view."""

    def __init__(self, path: Path, buf: Any, header: dict[str, Any]) -> None:
        self.path, self._mm, self.header = path, buf, header

    @classmethod
    def open(cls, path: Path, *, rank: int | None = None, step: int | None = None,
             level: str = "local") -> Shard:
        """Map ``path`` and validate its preamble and header (raises CorruptCheckpointError)."""
        try:
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                head = fh.read(len(MAGIC))
                if head != MAGIC[:len(head)] or not head:
                    raise CorruptCheckpointError(
                        str(path), f"not an ftkit shard (magic {head!r}, expected {MAGIC!r})",
                        rank=rank, step=step, level=level)
                if size < _PREAMBLE.size:
                    raise CorruptCheckpointError(
                        str(path), f"file is {size} bytes, shorter than a shard preamble "
                        f"(truncated?)", rank=rank, step=step, level=level)
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise CorruptCheckpointError(str(path), f"cannot read: {exc}", rank=rank,
                                         step=step, level=level) from exc
        return cls.parse(mm, path, rank=rank, step=step, level=level)

    @classmethod
    def parse(cls, buf: Any, path: Path, *, rank: int | None = None, step: int | None = None,
              level: str = "local") -> Shard:
        """Validate a shard held in any buffer (a map, or bytes received over MPI); ``path``
        names it in errors."""
        def bad(reason: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(str(path), reason, rank=rank, step=step, level=level)
        size = len(memoryview(buf))
        if size < _PREAMBLE.size:
            raise bad(f"{size} bytes, shorter than a shard preamble (truncated?)")
        try:
            hlen = header_length(bytes(memoryview(buf)[:_PREAMBLE.size]), size)
            header, _ = parse_header(bytes(memoryview(buf)[:_PREAMBLE.size + hlen]), size)
        except ShardFormatError as exc:
            raise bad(str(exc)) from None
        shard = cls(path, buf, header)
        shard.check_identity(rank=rank, step=step, level=level)
        return shard

    @classmethod
    def check(cls, path: Path, *, rank: int, step: int, world: int,
              level: str = "local") -> None:
        """Open ``path`` and verify it completely: preamble, header, identity (rank, step,
        world size) and every tensor's checksum. Raises CorruptCheckpointError."""
        with cls.open(path, rank=rank, step=step, level=level) as shard:
            shard.check_identity(rank=rank, step=step, world=world, level=level)
            shard.verify(level=level)

    def check_identity(self, *, rank: int | None, step: int | None, world: int | None = None,
                       level: str = "local") -> None:
        """Raise CorruptCheckpointError if the shard is not the expected rank/step/world."""
        h = self.header
        for key, want in (("rank", rank), ("step", step), ("world", world)):
            if want is not None and h.get(key) != want:
                what = {"world": "world size"}.get(key, key)
                raise CorruptCheckpointError(
                    str(self.path), f"shard has {what} {h.get(key)}, expected {want}",
                    rank=rank, step=step, level=level)

    @property
    def tensors(self) -> list[dict[str, Any]]:
        return self.header["tensors"]

    def raw(self, index: int) -> np.ndarray:
        """Zero-copy uint8 view of tensor ``index`` (read-only)."""
        t = self.tensors[index]
        return np.frombuffer(self._mm, dtype=np.uint8, count=t["nbytes"], offset=t["offset"])

    def bad_tensors(self) -> list[str]:
        """Paths of tensors whose checksum does not match (full read of the data)."""
        return [t["path"] for i, t in enumerate(self.tensors)
                if checksum(self.raw(i)) != t["checksum"]]

    def verify(self, *, level: str = "local") -> None:
        """Raise CorruptCheckpointError naming the first bad tensors, if any."""
        bad = self.bad_tensors()
        if bad:
            raise CorruptCheckpointError(
                str(self.path), f"checksum mismatch in {len(bad)} tensor(s): "
                f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}",
                rank=self.header.get("rank"), step=self.header.get("step"), level=level)

    def close(self) -> None:
        if isinstance(self._mm, mmap.mmap):
            try:
                self._mm.close()
            except BufferError:
                pass  # views still alive; the map is released when they are collected

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def leaves_of(header: dict[str, Any]) -> list[TensorLeaf]:
    """TensorLeaf descriptions of a shard header's tensors."""
    return [TensorLeaf(t["path"], t["kind"], t["dtype"], tuple(t["shape"]), t["nbytes"])
            for t in header["tensors"]]


def iter_shard_files(directory: Path) -> Iterable[Path]:
    return sorted(p for p in directory.glob("*.ftk") if p.is_file())

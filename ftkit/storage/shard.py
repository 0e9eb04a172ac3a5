"""The ``.ftk`` shard format: one rank's state at one step, self-describing, no pickle.

Layout (little endian)::

    0   8   magic  b"FTKSHRD\\0"
    8   4   format version (uint32)
    12  4   header length H (uint32)
    16  8   xxh3-64 of the header bytes (uint64)
    24  H   header: UTF-8 JSON
    ..      zero padding to a multiple of ALIGN
    ..      tensor bytes, each starting at a multiple of ALIGN (offsets in the header);
            tensors of PAGE_MIN bytes or more at a multiple of PAGE (so a mapped shard can
            be written to a file with ``O_DIRECT`` straight from the mapping; readers only
            require ALIGN)

The header holds the format version, job, step, rank, world size, topology coordinates, the
JSON skeleton of the state tree and one entry per tensor: path, kind, dtype, shape, offset,
nbytes and ``xxh3-64`` checksum. Files are written to a temporary name, fsynced and renamed,
so a shard either exists complete or not at all; reads are memory-mapped.
"""
from __future__ import annotations

import json
import mmap
import os
import re
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol, Self

import numpy as np
import xxhash

from ftkit import passes
from ftkit.buffers import BOUNCE, aligned_empty, misaligned
from ftkit.capture.flatten import (
    MAX_DEPTH,
    DecodeError,
    TensorLeaf,
    check_tree,
    exceeds_depth,
    leaf_nbytes,
    short_repr,
    torch_dtype,
)
from ftkit.capture.slices import unshare
from ftkit.errors import CorruptCheckpointError
from ftkit.fs import open_regular, write_atomic

MAGIC = b"FTKSHRD\0"
VERSION = 1
#: the header format of a shard shared by DP replicas (a ``share`` table: slices of the
#: replicated tensors, :mod:`ftkit.capture.slices`); its framing is VERSION's
SHARED = 2
ALIGN = 64
PAGE = 4096                   # large tensors' alignment (O_DIRECT's, any block size <= 4096)
PAGE_MIN = 64 << 10           # tensors of this many bytes or more start at a PAGE multiple
READ_CHUNK = 256 << 10        # read_into hashes what it read while it is still in cache
_PREAMBLE = struct.Struct("<8sIIQ")


def checksum(buf: Any) -> str:
    """Checksum string of a buffer (``xxh3-64:<hex>``); a ``hash`` pass over it."""
    view = memoryview(buf)
    passes.count("hash", view.nbytes)
    return "xxh3-64:" + xxhash.xxh3_64_hexdigest(view)


def _align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def build_header(meta: dict[str, Any], tree: Any, leaves: list[TensorLeaf],
                 buffers: list[np.ndarray]) -> tuple[bytes, list[int]]:
    """Header bytes and data offsets for ``leaves`` whose bytes are ``buffers`` (a ``hash``
    pass over them)."""
    return layout(meta, tree, leaves, [checksum(buf) for buf in buffers])


def layout(meta: dict[str, Any], tree: Any, leaves: list[TensorLeaf],
           sums: list[str]) -> tuple[bytes, list[int]]:
    """Header bytes and data offsets of a shard of ``leaves`` with checksums ``sums``
    (pure). Every checksum string has the same length, so the header's length and the
    offsets do not depend on their values (:mod:`ftkit.storage.slots` lays a shard out
    with placeholders, then fills them in).

    The header is ``{"format":1,<meta>,"tree":<tree>,"tensors":[<entry>,...]}`` (compact
    JSON), each entry ``{"path","kind","dtype","shape","nbytes","checksum","offset"}``. It is
    serialised once but for the offsets, whose digits its length depends on: the offsets are
    iterated on lengths alone (a capture lays out a shard on the training thread)."""
    head = json.dumps({"format": SHARED if "share" in meta else VERSION, **meta, "tree": tree,
                       "tensors": []},
                      separators=(",", ":"))
    opening, closing = head[:-2], head[-2:]              # ...,"tensors":[   and   ]}
    entries = [_entry_json(lf, digest) for lf, digest in zip(leaves, sums)]
    fixed = len(opening) + len(closing) + sum(len(e) + 2 for e in entries) - bool(entries)
    offsets = [0] * len(entries)
    for _ in range(8):
        pos = _align(_PREAMBLE.size + fixed + sum(len(str(off)) for off in offsets))
        new = []
        for lf in leaves:
            pos = _align(pos, PAGE if lf.nbytes >= PAGE_MIN else ALIGN)
            new.append(pos)
            pos = _align(pos + lf.nbytes)
        if new == offsets:
            text = opening + ",".join(f"{e}{off}}}" for e, off in zip(entries, offsets))
            return (text + closing).encode(), offsets
        offsets = new
    raise AssertionError("shard header offsets did not converge")


def _entry_json(lf: TensorLeaf, digest: str) -> str:
    """One tensor's header entry as compact JSON, up to its offset's digits (exactly what
    ``json.dumps`` writes for the same dict)."""
    quote = json.encoder.encode_basestring_ascii         # type: ignore[attr-defined]
    shape = ",".join(str(int(d)) for d in lf.shape)
    return (f'{{"path":{quote(lf.path)},"kind":{quote(lf.kind)},"dtype":{quote(lf.dtype)},'
            f'"shape":[{shape}],"nbytes":{int(lf.nbytes)},"checksum":{quote(digest)},'
            f'"offset":')


def preamble(head: bytes) -> bytes:
    """The preamble (magic, version, header length and checksum) followed by ``head``."""
    return _PREAMBLE.pack(MAGIC, VERSION, len(head), xxhash.xxh3_64_intdigest(head)) + head


def write_shard(path: Path, meta: dict[str, Any], tree: Any, leaves: list[TensorLeaf],
                buffers: list[np.ndarray]) -> int:
    """Atomically write a shard to ``path`` (temp file, fsync, rename). Returns its size."""
    head, offsets = build_header(meta, tree, leaves, buffers)
    start = preamble(head)

    def pieces() -> Iterator[Any]:
        pos = len(start)
        yield start
        for off, buf in zip(offsets, buffers):
            yield bytes(off - pos)
            yield memoryview(buf).cast("B")  # type: ignore[arg-type]
            pos = off + buf.nbytes
    return write_atomic(path, pieces())


XXH3 = "xxh3-64:"
_CHECKSUM = re.compile(r"xxh3-64:[0-9a-f]{16}")
_INT_MAX = 2 ** 63 - 1
#: JSON nesting of a header: 3 levels per skeleton level (node, items, [key, node]) + a few
HEADER_DEPTH = 3 * MAX_DEPTH + 8
_REQUIRED = ("format", "rank", "step", "world", "tree", "tensors")
_ENTRY = ("path", "kind", "dtype", "shape", "nbytes", "offset", "checksum")
Span = tuple[int, int, str, str]          # offset, end, checksum, path


class ShardFormatError(ValueError):
    """A shard's preamble or header is malformed (the reason, without file). ``rank`` and
    ``step`` are what the header claims, when it got far enough to say (else None)."""

    def __init__(self, reason: str, *, rank: int | None = None,
                 step: int | None = None) -> None:
        super().__init__(reason)
        self.rank, self.step = rank, step


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


def parse_header(head: bytes, size: int) -> tuple[dict[str, Any], list[Span]]:
    """Validate preamble + header bytes ``head`` of a ``size``-byte shard completely: header
    checksum; UTF-8 JSON nested at most HEADER_DEPTH levels; identity ints; every tensor
    entry (allowed kind and dtype, ``nbytes == prod(shape) * itemsize``, an ALIGN-ed offset
    after the header, inside the file, no two ranges overlapping, an xxh3-64 checksum); the
    tree (:func:`~ftkit.capture.flatten.check_tree`: grammar, depth, every tensor used
    once; or ``null``: tensors without a state, as in parity files). Every integer must be
    a plain int in 0..2**63-1 (``world`` may be -1: parity files). Returns the header and
    the ranges ``(offset, end, checksum, path)`` in file order. Raises ShardFormatError,
    and nothing else."""
    hsum = _PREAMBLE.unpack_from(head, 0)[3]
    raw = bytes(head[_PREAMBLE.size:])
    if xxhash.xxh3_64_intdigest(raw) != hsum:
        raise ShardFormatError("header checksum mismatch")
    header = _load_json(raw)
    rank, step = _claimed(header, "rank"), _claimed(header, "step")
    try:
        return header, _check_header(header, len(head), size)
    except ShardFormatError as exc:
        exc.rank, exc.step = rank, step
        raise
    except Exception as exc:       # a gap in the checks above must still read as corrupt
        raise ShardFormatError(f"unexpected error validating the header: "
                               f"{type(exc).__name__}: {exc}", rank=rank, step=step) from exc


def _load_json(raw: bytes) -> Any:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:      # UnicodeDecodeError is a ValueError
        why = " ".join(str(exc).split())
        raise ShardFormatError(f"malformed shard header: {type(exc).__name__}: "
                               f"{why[:200]}") from None
    if exceeds_depth(header, HEADER_DEPTH):
        raise ShardFormatError(f"malformed shard header: JSON nested deeper than "
                               f"{HEADER_DEPTH} levels")
    return header


def _claimed(header: Any, key: str) -> int | None:
    value = header.get(key) if isinstance(header, dict) else None
    return value if type(value) is int and 0 <= value <= _INT_MAX else None


def _int(value: Any, what: str) -> int:
    if type(value) is not int or not 0 <= value <= _INT_MAX:
        raise ShardFormatError(f"{what} {short_repr(value)} is not an int in 0..2**63-1")
    return value


def _check_header(header: Any, hend: int, size: int) -> list[Span]:
    if not isinstance(header, dict):
        raise ShardFormatError(f"malformed shard header: {short_repr(header)} is not an object")
    missing = [k for k in _REQUIRED if k not in header]
    if missing:
        raise ShardFormatError(f"malformed shard header: no {', '.join(missing)}")
    fmt = header["format"]
    if type(fmt) is not int or fmt not in (VERSION, SHARED):
        raise ShardFormatError(f"header format {short_repr(fmt)}, expected {VERSION} (or "
                               f"{SHARED}: shared by DP replicas)")
    if (fmt == SHARED) != ("share" in header):
        raise ShardFormatError(f"header format {fmt} {'without' if fmt == SHARED else 'with'} "
                               f"a share table")
    _int(header["rank"], "rank")
    _int(header["step"], "step")
    world = header["world"]
    if not (type(world) is int and (world == -1 or 1 <= world <= _INT_MAX)):
        raise ShardFormatError(f"world size {short_repr(world)} is not a positive int (or -1 "
                               f"in a parity file)")
    if not isinstance(header["tensors"], list):
        raise ShardFormatError("malformed shard header: tensors is not a list")
    entries = [_entry(i, t) for i, t in enumerate(header["tensors"])]
    spans = _spans(sorted(span for span, _ in entries), hend, size)
    if header["tree"] is not None:          # null: raw tensors, e.g. parity (see check)
        try:
            check_tree(header["tree"], tree_leaves(header, [leaf for _, leaf in entries]))
        except DecodeError as exc:
            raise ShardFormatError(str(exc)) from None
    return spans


def _entry(i: int, t: Any) -> tuple[Span, TensorLeaf]:
    """One validated tensor entry: its byte range and its description."""
    if not isinstance(t, dict) or not all(k in t for k in _ENTRY):
        raise ShardFormatError(f"tensor entry {i} is not an object with {', '.join(_ENTRY)}")
    path = t["path"]
    if not isinstance(path, str):
        raise ShardFormatError(f"tensor entry {i} has path {short_repr(path)}, not a string")
    name = f"{path} (entry {i})"
    try:
        want = leaf_nbytes(t["kind"], t["dtype"], t["shape"])
    except DecodeError as exc:
        raise ShardFormatError(f"tensor {name}: {exc}") from None
    nbytes = _int(t["nbytes"], f"tensor {name}: nbytes")
    offset = _int(t["offset"], f"tensor {name}: offset")
    if nbytes != want:
        raise ShardFormatError(f"tensor {name}: nbytes {nbytes}, but {t['kind']} "
                               f"{t['dtype']} of shape {t['shape']} is {want} bytes")
    if offset % ALIGN:
        raise ShardFormatError(f"tensor {name}: offset {offset} is not a multiple of {ALIGN}")
    digest = t["checksum"]
    if not isinstance(digest, str) or not _CHECKSUM.fullmatch(digest):
        raise ShardFormatError(f"tensor {name} has an unknown checksum {short_repr(digest)}")
    return ((offset, offset + nbytes, digest, path),
            TensorLeaf(path, t["kind"], t["dtype"], tuple(t["shape"]), nbytes))


def _spans(spans: list[Span], hend: int, size: int) -> list[Span]:
    """Check ranges sorted by offset: after the header (ending at ``hend``), not
    overlapping, inside the ``size``-byte file."""
    end, last = hend, "the header"
    for off, stop, _, name in spans:
        if off < end:
            raise ShardFormatError(f"tensor {name} at bytes {off}..{stop} overlaps {last} "
                                   f"(which ends at byte {end})")
        if stop > size:
            raise ShardFormatError(f"tensor {name} at bytes {off}..{stop} runs past the end "
                                   f"of the {size}-byte file (truncated?)")
        end, last = stop, f"tensor {name}"
    return spans


class Landing(Protocol):
    """Where :meth:`Shard.read_through` puts a tensor's bytes, piece by piece."""

    piece: int

    def buffer(self, offset: int, n: int) -> np.ndarray:
        """A writable uint8 buffer of ``n`` bytes (<= piece) for the next piece: the
        tensor's bytes from ``offset``."""

    def land(self, offset: int, piece: np.ndarray) -> None:
        """``piece`` (from :meth:`buffer`) holds the tensor's bytes from ``offset``."""


class Shard:
    """A validated, memory-mapped shard. ``open`` checks the preamble and header only;
    :meth:`verify` checks every tensor's checksum; :meth:`array` returns a zero-copy view."""

    def __init__(self, path: Path, buf: Any, header: dict[str, Any],
                 fd: int | None = None) -> None:
        self.path, self._mm, self.header = path, buf, header
        self._fd = fd                 # the open file, for read_into (None: a buffer only)

    @classmethod
    def open(cls, path: Path, *, rank: int | None = None, step: int | None = None,
             level: str = "local") -> Shard:
        """Map ``path`` and validate its preamble and header (raises CorruptCheckpointError,
        and nothing else). A symbolic link, FIFO or device under the name is refused, never
        followed or read (:func:`open_regular`)."""
        try:
            fd = open_regular(path, rank=rank, step=step, level=level)
            with open(fd, "rb") as fh:
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
                keep = os.dup(fh.fileno())
        except OSError as exc:
            raise CorruptCheckpointError(str(path), f"cannot read: {exc}", rank=rank,
                                         step=step, level=level) from exc
        try:
            shard = cls.parse(mm, path, rank=rank, step=step, level=level)
        except BaseException:
            os.close(keep)
            mm.close()
            raise
        shard._fd = keep
        return shard

    @classmethod
    def parse(cls, buf: Any, path: Path, *, rank: int | None = None, step: int | None = None,
              level: str = "local") -> Shard:
        """Validate a shard held in any buffer (a map, or bytes received over MPI); ``path``
        names it in errors, with the expected ``rank``/``step`` (or, when None, those the
        header claims). Raises CorruptCheckpointError, and nothing else."""
        size = len(memoryview(buf))
        if size < _PREAMBLE.size:
            raise CorruptCheckpointError(str(path), f"{size} bytes, shorter than a shard "
                                         f"preamble (truncated?)", rank=rank, step=step,
                                         level=level)
        try:
            hlen = header_length(bytes(memoryview(buf)[:_PREAMBLE.size]), size)
            header, _ = parse_header(bytes(memoryview(buf)[:_PREAMBLE.size + hlen]), size)
        except ShardFormatError as exc:
            raise CorruptCheckpointError(
                str(path), str(exc), rank=exc.rank if rank is None else rank,
                step=exc.step if step is None else step, level=level) from None
        shard = cls(path, buf, header)
        shard.check_identity(rank=rank, step=step, level=level)
        return shard

    @classmethod
    def check(cls, path: Path, *, rank: int, step: int, world: int,
              level: str = "local", data: bool = True) -> None:
        """Open ``path`` and verify it: preamble, header, identity (rank, step, world size),
        a state tree, that this torch has every torch dtype it names and (``data``) every
        tensor's checksum: a rank's shard that restore can load. Without ``data`` no tensor
        byte is read (the load verifies them as it reads). Raises CorruptCheckpointError."""
        with cls.open(path, rank=rank, step=step, level=level) as shard:
            shard.check_identity(rank=rank, step=step, world=world, level=level)
            if shard.header["tree"] is None:
                raise CorruptCheckpointError(str(path), "no state tree (tree is null)",
                                             rank=rank, step=step, level=level)
            if data:
                shard.verify(level=level)
            for t in shard.tensors:
                try:
                    if t["kind"] == "torch":
                        torch_dtype(t["dtype"])
                except DecodeError as exc:
                    raise CorruptCheckpointError(str(path), f"tensor {t['path']}: {exc}",
                                                 rank=rank, step=step, level=level) from None

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

    def read_into(self, index: int, dest: np.ndarray) -> bool:
        """Read tensor ``index`` into ``dest`` (a writable uint8 array of its size) in one
        pass, hashing each chunk as it lands (still in cache); True when the checksum
        matches. From the file with ``preadv`` (no page faults on a mapping) when the shard
        was opened from one, else from the buffer. OSError when the file cannot be read."""
        t, h = self.tensors[index], xxhash.xxh3_64()
        self._read_range(index, 0, dest[:t["nbytes"]], h)
        passes.count("copy", t["nbytes"])      # the hash rides on the copy's pass
        return XXH3 + h.hexdigest() == t["checksum"]

    def read_through(self, index: int, landing: Landing) -> bool:
        """Read tensor ``index`` in pieces of at most ``landing.piece`` bytes, each into
        ``landing.buffer(offset, n)`` and then handed to ``landing.land(offset, piece)`` (e.g. copied
        to a GPU), hashing as :meth:`read_into` does; True when the checksum matches. The
        landing may still be using earlier pieces when this returns. OSError when the file
        cannot be read."""
        t, h = self.tensors[index], xxhash.xxh3_64()
        n = t["nbytes"]
        for at in range(0, n, landing.piece):
            piece = landing.buffer(at, min(landing.piece, n - at))
            self._read_range(index, at, piece, h)
            landing.land(at, piece)
        passes.count("copy", n)
        return XXH3 + h.hexdigest() == t["checksum"]

    def _read_range(self, index: int, start: int, out: np.ndarray, h: Any) -> None:
        """Bytes ``start .. start + len(out)`` of tensor ``index`` into ``out``, fed to the
        hash ``h`` chunk by chunk as they land; through an aligned bounce when ``out`` is
        misaligned (:mod:`ftkit.buffers`: e.g. a NumPy array's own memory)."""
        t = self.tensors[index]
        base = t["offset"] + start
        if self._fd is not None and misaligned(out):
            self._read_bounced(base, out, h, t["path"])
            return
        for a in range(0, len(out), READ_CHUNK):
            part = out[a:a + READ_CHUNK]
            if self._fd is None:
                np.copyto(part, self.raw(index)[start + a:start + a + len(part)])
            elif os.preadv(self._fd, [part.data], base + a) != len(part):
                raise OSError(f"{self.path}: short read of tensor {t['path']}")
            h.update(part.data)

    def _read_bounced(self, base: int, out: np.ndarray, h: Any, what: str) -> None:
        """File bytes from ``base`` into the misaligned ``out``: read into an aligned
        bounce, hashed there, copied out in :data:`~ftkit.buffers.BOUNCE` pieces."""
        assert self._fd is not None
        bounce = aligned_empty(min(BOUNCE, len(out)))
        for a in range(0, len(out), BOUNCE):
            part = out[a:a + BOUNCE]
            got = bounce[:len(part)]
            if os.preadv(self._fd, [got.data], base + a) != len(part):
                raise OSError(f"{self.path}: short read of tensor {what}")
            h.update(got.data)
            np.copyto(part, got)

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
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
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
    """TensorLeaf descriptions of a shard header's tensors (the file's entries)."""
    return [TensorLeaf(t["path"], t["kind"], t["dtype"], tuple(t["shape"]), t["nbytes"])
            for t in header["tensors"]]


def tree_leaves(header: dict[str, Any], entries: list[TensorLeaf] | None = None
                ) -> list[TensorLeaf]:
    """The state's tensors the header's tree indexes: its entries (``entries``, else
    :func:`leaves_of`), or for a shard shared by DP replicas the whole entries and the
    replicated tensors it holds slices of (:func:`ftkit.capture.slices.unshare`;
    DecodeError when that table does not decode)."""
    entries = leaves_of(header) if entries is None else entries
    if header.get("format") != SHARED:
        return entries
    return unshare(header.get("share"), entries)[0]


def iter_shard_files(directory: Path) -> Iterable[Path]:
    return sorted(p for p in directory.glob("*.ftk") if p.is_file())

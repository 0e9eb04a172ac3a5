"""Move whole files between ranks over MPI without staging them in Python memory.

The sender posts ``Isend`` of views of its file (its mapped slot, or the file mapped
read-only: no copy). The receiver takes the chunks straight into a claimed slot of its own,
:data:`WINDOW` receives in flight, each chunk checked the moment it lands (still in cache:
the check rides on the receive, it is not a second pass over the bytes); without a slot,
into two reused buffers, writing each while the next one arrives, then fsync and an atomic
rename. Messages are cut into chunks of at most CHUNK bytes.

A received shard is never trusted unverified: with :class:`Verify`, :class:`StreamCheck`
checks the bytes as they stream in (the header from the first chunk(s), then every tensor's
checksum over its byte range as the range arrives, and that padding is zero), so a copy
corrupted in transfer is refused without a second pass over the file. Each transfer uses a
fresh tag (:meth:`DistComm.bulk_tag`); a failed exchange cancels or parks every request it
posted (:meth:`DistComm.release`), so it cannot swallow or feed a later exchange.
"""
from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from mpi4py import MPI

from ftkit import passes
from ftkit.buffers import aligned_empty
from ftkit.comm.dist import DistComm
from ftkit.errors import CorruptCheckpointError
from ftkit.fs import create_temp, open_regular, rename_into_place, write_all
from ftkit.storage.shard import (
    _PREAMBLE,
    XXH3,
    Shard,
    ShardFormatError,
    header_length,
    parse_header,
)
from ftkit.storage.slots import Slots

#: bytes per message: small enough that a chunk just received is still in cache when it is
#: checked, large enough that per-message costs vanish (256 per 256 MiB)
CHUNK = 1 << 20
#: chunk receives in flight at once when receiving straight into a slot
WINDOW = 8


@contextlib.contextmanager
def mapped(path: Path, *, rank: int | None = None, step: int | None = None,
           level: str = "local") -> Iterator[np.ndarray]:
    """Read-only uint8 view of a whole regular file (empty array for an empty file). A
    symbolic link or anything else that is not a regular file is never followed or read:
    CorruptCheckpointError naming ``path`` (and ``rank``, ``step``, ``level``)."""
    with open(open_regular(path, rank=rank, step=step, level=level), "rb") as fh:
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
            with contextlib.suppress(BufferError):   # views still alive: unmapped at GC
                mm.close()


def chunks(view: np.ndarray) -> list[np.ndarray]:
    return [view[i:i + CHUNK] for i in range(0, len(view), CHUNK)] or [view[:0]]


# ------------------------------------------------------------------ verification
@dataclasses.dataclass(frozen=True)
class Verify:
    """How received files are checked: each must be a shard of ``step`` of a ``world``-rank
    job, owned by rank ``owner(source)`` (default: the sending rank); ``level`` names the
    level in errors. ``tamper`` is the fault-injection hook (``Faults.corrupt_buffer``),
    called on every received chunk before it is checked."""

    level: str
    step: int
    world: int | None = None
    owner: Callable[[int], int] | None = None
    tamper: Callable[[np.ndarray], object] | None = None

    def rank_of(self, source: int) -> int:
        return source if self.owner is None else self.owner(source)


class StreamCheck:
    """Verify one ``.ftk`` shard from its bytes in file order, as they arrive.

    :meth:`feed` takes consecutive pieces of the file (any sizes); it reads the preamble and
    header from the first piece(s) (magic, version, header checksum, identity, bounds),
    then hashes each tensor's byte range as it streams past and compares the checksum the
    moment the range is complete; the padding between tensors must be zero, so every byte
    of the file is covered. :meth:`finish` checks that nothing is missing. Both raise
    :class:`CorruptCheckpointError` naming the file, the source rank, the shard's rank, the
    step and the level."""

    def __init__(self, path: Path, size: int, *, source: int, rank: int, step: int,
                 world: int | None, level: str, damage: str | None = None,
                 counted: bool = True) -> None:
        """``damage``: how errors describe a mismatch (default: corrupted in transfer from
        ``source``, or on it after it was written). ``counted``: the checksum is a ``hash``
        pass of its own (False where it rides on a receive: each piece is checked right
        after it landed, while it is in cache)."""
        self.path, self.size, self.source = path, size, source
        self.damage = damage or (f"corrupted in transfer from rank {source} (or on it "
                                 f"after it was written)")
        self.rank, self.step, self.world, self.level = rank, step, world, level
        self.pos = 0                                     # bytes fed so far
        self.header: dict[str, Any] | None = None
        self.counted = counted
        self._head = bytearray()
        self._need = _PREAMBLE.size                      # header bytes needed next
        self._spans: list[tuple[int, int, str, str]] = []  # offset, end, checksum, path
        self._i = 0
        self._hash = xxhash.xxh3_64()

    def bad(self, reason: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(str(self.path), f"{self.damage}: {reason}",
                                      rank=self.rank, step=self.step, level=self.level)

    def feed(self, piece: np.ndarray) -> None:
        """Check the next ``len(piece)`` bytes of the file."""
        start, n = self.pos, len(piece)
        if start + n > self.size:
            raise self.bad(f"more than the {self.size} bytes announced")
        self.pos += n
        used = 0
        while self.header is None and used < n:
            take = min(n - used, self._need - len(self._head))
            self._head += piece[used:used + take].tobytes()
            used += take
            while self.header is None and len(self._head) == self._need:
                self._parse_head()
        if used < n:
            self._data(piece[used:], start + used)

    def finish(self) -> None:
        """Raise unless the whole shard arrived and checked out."""
        if self.header is None:
            raise self.bad(f"{self.pos} bytes, the shard header is incomplete (truncated)")
        self._close_spans(self.pos)
        if self.pos != self.size or self._i < len(self._spans):
            raise self.bad(f"{self.pos} of {self.size} bytes arrived (truncated)")

    def _parse_head(self) -> None:
        try:
            if len(self._head) == _PREAMBLE.size:
                self._need = _PREAMBLE.size + header_length(bytes(self._head), self.size)
                if self._need > _PREAMBLE.size:
                    return
            header, spans = parse_header(bytes(self._head), self.size)
        except ShardFormatError as exc:
            raise self.bad(str(exc)) from None
        try:
            Shard(self.path, None, header).check_identity(
                rank=self.rank, step=self.step, world=self.world, level=self.level)
        except CorruptCheckpointError as exc:
            raise self.bad(exc.reason) from None
        self.header, self._spans = header, spans

    def _data(self, piece: np.ndarray, pos: int) -> None:
        """Bytes at and after the header: padding (must be zero) and tensor ranges."""
        while len(piece):
            self._close_spans(pos)
            off, end = self._spans[self._i][:2] if self._i < len(self._spans) else \
                (self.size, self.size)
            if pos < off:
                k = min(off - pos, len(piece))
                if piece[:k].any():
                    raise self.bad(f"non-zero padding in bytes {pos}..{pos + k}")
            else:
                k = min(end - pos, len(piece))
                self._hash.update(piece[:k].data)
                if self.counted:
                    passes.count("hash", k)
            pos += k
            piece = piece[k:]
        self._close_spans(pos)

    def _close_spans(self, pos: int) -> None:
        """Compare the checksum of every tensor that ends at ``pos``."""
        while self._i < len(self._spans) and self._spans[self._i][1] == pos:
            _, _, want, name = self._spans[self._i]
            got = XXH3 + self._hash.hexdigest()
            self._hash.reset()
            self._i += 1
            if got != want:
                raise self.bad(f"checksum mismatch in tensor {name}")


# ------------------------------------------------------------------ one file each way
class FileSend:
    """The sends of one file to ``dest``: a size message, then the chunks (views of the
    mapped file, no copy), all with one tag (MPI keeps their order). ``view``: the file's
    bytes already mapped (a slot of this rank), sent without mapping the file again."""

    def __init__(self, path: Path, dest: int, tag: int, view: np.ndarray | None = None
                 ) -> None:
        self.path, self.dest, self.tag, self._view = path, dest, tag, view
        self.reqs: list[MPI.Request] = []
        self.size = np.zeros(1, dtype=np.int64)
        self._ctx: contextlib.AbstractContextManager[np.ndarray] | None = None
        self._chunks: list[np.ndarray] = []

    @property
    def nbytes(self) -> int:
        return int(self.size[0])

    def post(self, comm: MPI.Comm) -> None:
        view = self._view
        if view is None:
            self._ctx = mapped(self.path)
            view = self._ctx.__enter__()
        self.size[0] = len(view)
        self._chunks = chunks(view)
        self.reqs = [comm.Isend([self.size, MPI.INT64_T], self.dest, self.tag)]
        self.reqs += [comm.Isend([c, MPI.BYTE], self.dest, self.tag) for c in self._chunks]
        passes.count("send", len(view))

    def buffers(self) -> list[np.ndarray]:
        return [self.size, *self._chunks]

    def close(self) -> None:
        """Unmap the file (deferred while a released request still holds a chunk)."""
        self._chunks, self._view = [], None
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None


class FileRecv:
    """Receive one file from ``source`` into ``path``: the size first, then the bytes, then
    flush and publish. With ``slots`` (a :class:`~ftkit.storage.slots.Slots` of this rank),
    straight into a free slot of the file's size: the chunks' receives are posted into
    their places in the mapped slot, :data:`WINDOW` in flight, each chunk checked as it
    lands while it is in cache (no buffer, no second write, no second pass), and the slot
    is published as ``path`` (a hard link, as for local shards). Without slots,
    or when none is free: chunks into two
    reused buffers (one receiving while the other is checked and written), then fsync and
    rename. The temp file is a fresh private name (:func:`~ftkit.fs.create_temp`),
    so a planted ``.<name>.tmp`` link is never written through; it is removed on every
    failure (:meth:`abandon`). Writing through ``write(2)`` avoids a page fault per page of
    a freshly mapped file. With ``verify``, each chunk is checked by a :class:`StreamCheck` before it is
    written; after a mismatch the rest of the stream is drained (so the sender completes)
    but nothing more is written, and :meth:`finish` raises."""

    def __init__(self, comm: MPI.Comm, path: Path, source: int, tag: int,
                 verify: Verify | None = None, slots: Slots | None = None) -> None:
        self.comm, self.path, self.source, self.tag = comm, path, source, tag
        self.verify = verify
        self.slots = slots
        self.slot: Path | None = None               # the claimed slot (direct mode)
        self._landing: list[tuple[MPI.Request, np.ndarray]] = []   # direct: in order
        self._posted = 0                            # direct: chunk receives posted so far
        self.tmp: Path | None = None                # created by start()
        self.size = np.zeros(1, dtype=np.int64)
        self.size_req: MPI.Request | None = None
        self.check: StreamCheck | None = None
        self.error: CorruptCheckpointError | None = None
        self._fd: int | None = None
        self._bufs: list[np.ndarray] = []
        self._next = 0            # offset of the next chunk to post
        self._pending: tuple[MPI.Request, np.ndarray] | None = None
        self.done = False

    @property
    def nbytes(self) -> int:
        return int(self.size[0])

    def post_size(self) -> MPI.Request:
        self.size_req = self.comm.Irecv([self.size, MPI.INT64_T], self.source, self.tag)
        return self.size_req

    def start(self) -> None:
        """After the size arrived: create the destination and post the first chunk."""
        self.size_req = None
        claimed = self._claim()
        if self.verify is not None:
            v = self.verify          # straight into a slot, each chunk checked as it lands
            self.check = StreamCheck(self.path, self.nbytes, source=self.source,
                                     rank=v.rank_of(self.source), step=v.step, world=v.world,
                                     level=v.level, counted=claimed is None)
        if claimed is not None:
            self.slot, view = claimed
            self._bufs = chunks(view)               # every chunk's place in the slot
            self._fill()
            return
        self._fd, self.tmp = create_temp(self.path)
        n = min(CHUNK, self.nbytes)
        self._bufs = [aligned_empty(n), aligned_empty(n)]
        self._post()

    def _claim(self) -> tuple[Path, np.ndarray] | None:
        """A free slot of the file's size, or None (no slots, none free, or none can be
        allocated now: the file is written as a plain one)."""
        if self.slots is None or not self.nbytes:
            return None
        try:
            return self.slots.claim(self.nbytes)
        except OSError:
            return None

    def _post(self) -> None:
        n = min(CHUNK, self.nbytes - self._next)
        buf = self._bufs[(self._next // CHUNK) % 2][:n]
        self._pending = (self.comm.Irecv([buf, MPI.BYTE], self.source, self.tag), buf)
        self._next += n

    def poll(self) -> bool:
        """Progress: when the chunk in flight arrived, post the next and take this one."""
        if self.done:
            return True
        if self.slot is not None:
            return self._poll_direct()
        assert self._pending is not None
        req, buf = self._pending
        if not req.Test():
            return False
        if self._next < self.nbytes:
            self._post()
        else:
            self._pending = None
            self.done = True
        self._take(buf)
        return self.done

    def _fill(self) -> None:
        """Post the receives of the next chunks until WINDOW are in flight (direct mode)."""
        while len(self._landing) < WINDOW and self._posted < len(self._bufs):
            c = self._bufs[self._posted]
            self._posted += 1
            self._landing.append((self.comm.Irecv([c, MPI.BYTE], self.source, self.tag), c))

    def _poll_direct(self) -> bool:
        """Check every chunk that has landed, in file order, right away (in cache), then
        post the next receives."""
        while self._landing and self._landing[0][0].Test():
            self._take(self._landing.pop(0)[1])
            self._fill()
        self.done = not self._landing
        return self.done

    def _take(self, buf: np.ndarray) -> None:
        if self.verify is not None and self.verify.tamper is not None:
            self.verify.tamper(buf)
        passes.count("recv", len(buf))
        if self.error is not None:
            return                                   # draining a refused stream
        try:
            if self.check is not None:
                self.check.feed(buf)
        except CorruptCheckpointError as exc:
            self.error = exc
            self.abandon()
            return
        if self.slot is None:
            assert self._fd is not None
            write_all(self._fd, buf)

    def pending(self) -> list[MPI.Request]:
        return [r for r in (self.size_req, self._pending[0] if self._pending else None)
                if r is not None] + [r for r, _ in self._landing]

    def buffers(self) -> list[np.ndarray]:
        return [self.size, *self._bufs]

    def finish(self) -> None:
        """Raise if the file was refused; else fsync and rename into place."""
        if self.error is not None:
            raise self.error
        if self.check is not None:
            self.check.finish()
        if self.slot is not None:
            assert self.slots is not None
            self.slots.publish(self.slot, self.path)
            return
        assert self._fd is not None and self.tmp is not None
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        tmp, self.tmp = self.tmp, None
        rename_into_place(tmp, self.path)

    def abandon(self) -> None:
        """Close and remove the temp file, if any (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.tmp is not None:
            self.tmp.unlink(missing_ok=True)
            self.tmp = None


# ------------------------------------------------------------------------- calls
def exchange(dc: DistComm, sends: list[tuple[Path, int]], recvs: list[tuple[Path, int]],
             phase: str, step: int, *, verify: Verify | None = None,
             views: dict[Path, np.ndarray] | None = None,
             slots: dict[int, Slots] | None = None) -> None:
    """Send and receive whole files point-to-point (each pair of ranks exchanges at most one
    file per direction per call). Every rank named as a peer must call with the matching
    entry (and the same ``step``); ranks with nothing to do may skip the call.

    Sizes travel under ``FTKIT_TIMEOUT``; the files under :meth:`DistComm.bulk_deadline` of
    the bytes this rank sends and receives. With ``verify``, every received file is checked
    while it streams in; a file that fails is not kept and the call raises its
    CorruptCheckpointError once every transfer of the call has completed. On any error every
    request the call posted is released (cancelled, or parked until MPI is done with it) and
    no partial file is left. ``views``: files to send whose bytes are already mapped (by
    path); ``slots``: where to receive each source's file directly (by source rank)."""
    views, slots = views or {}, slots or {}
    dc.reap()
    tags: dict[tuple[int, int], int] = {}

    def tag(src: int, dst: int) -> int:        # one tag per pair (a file to itself: one)
        if (src, dst) not in tags:
            tags[src, dst] = dc.bulk_tag(step, src, dst)
        return tags[src, dst]
    out = [FileSend(path, dest, tag(dc.rank, dest), views.get(path)) for path, dest in sends]
    into = [FileRecv(dc.comm, path, source, tag(source, dc.rank), verify, slots.get(source))
            for path, source in recvs]
    try:
        sizes = [rx.post_size() for rx in into]
        for tx in out:
            tx.post(dc.comm)
        dc.waitall(sizes, phase, step)
        for rx in into:
            rx.start()
        nbytes = sum(tx.nbytes for tx in out) + sum(rx.nbytes for rx in into)
        sent = [r for tx in out for r in tx.reqs]
        clock = dc.deadline(nbytes)
        # poll every receiver on every pass (a list, not a short-circuiting generator)
        while not (all([rx.poll() for rx in into]) and MPI.Request.Testall(sent)):  # noqa: C419
            if clock.expired():
                raise dc.timeout_error(phase, step, nbytes=nbytes)
            time.sleep(0)
        refused = [rx.error for rx in into if rx.error is not None]
        if refused:
            raise refused[0]
        for rx in into:
            rx.finish()
    except BaseException:
        dc.release([r for tx in out for r in tx.reqs] + [r for rx in into for r in rx.pending()],
                   [b for tx in out for b in tx.buffers()]
                   + [b for rx in into for b in rx.buffers()])
        for rx in into:
            rx.abandon()
        raise
    finally:
        for tx in out:
            tx.close()


def recv_buffer(dc: DistComm, source: int, phase: str, step: int) -> np.ndarray:
    """Receive one file that ``source`` sends with :func:`exchange` (same ``step``) into
    memory: the size under ``FTKIT_TIMEOUT``, the bytes under the bulk deadline. On error
    the posted receives are released."""
    dc.reap()
    tag = dc.bulk_tag(step, source, dc.rank)
    size = np.zeros(1, dtype=np.int64)
    dc.waitall_bulk([dc.comm.Irecv([size, MPI.INT64_T], source, tag)], phase, step, 0, [size])
    buf = aligned_empty(int(size[0]))
    parts = chunks(buf)
    dc.waitall_bulk([dc.comm.Irecv([c, MPI.BYTE], source, tag) for c in parts], phase, step,
                    len(buf), [buf, *parts])
    passes.count("recv", len(buf))
    return buf

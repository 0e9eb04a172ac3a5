"""Load a lost rank's shard straight from a whole copy on another node into its live state:
no file is written on the lost node first and no byte is read twice.

The rank that holds the copy (:class:`CopySend`) sends it in *pieces* both ends derive from
the shard's header: first the file's size and the header's length, then the preamble and
header, then every tensor's bytes in header order, cut into pieces of at most :data:`PIECE`
(the padding between tensors is not sent: it holds nothing). The lost rank (:class:`RemoteShard`) checks the header as a local shard's
is checked (its checksum, then the identity: rank, step, world size) and then reads each
tensor like :class:`~ftkit.storage.shard.Shard` reads a file: the pieces' receives are posted
straight into the destination's bytes (the live tensor), :data:`FLIGHT` in flight, each
piece hashed the moment it lands (in cache); the tensor's checksum is compared at its end.
A mismatch makes ``read_into`` return False like a damaged local shard, so the restore
treats a copy damaged at rest or in transfer the same way.

Both ends use one tag from :meth:`DistComm.bulk_tag`, so messages of an earlier fetch that
failed never match a later one. The receiver reads the tensors in header order, all of them
(the restore's load does), and the sender waits for its sends only once every rank agreed
the load succeeded; otherwise it releases them (:meth:`DistComm.release`).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from mpi4py import MPI

from ftkit import passes
from ftkit.comm.dist import DistComm
from ftkit.errors import CorruptCheckpointError
from ftkit.storage.shard import (
    _PREAMBLE,
    XXH3,
    Landing,
    Shard,
    ShardFormatError,
    header_length,
    parse_header,
)

#: the phase of every wait here (a fetch is part of the load)
PHASE = "restore-load"
#: bytes per message of a streamed load, and the receives in flight: 4 MiB pieces, two at
#: a time, move 256 MiB about twice as fast here as 1 MiB pieces eight at a time (fewer
#: rendezvous; the piece just received is still mostly in cache when it is hashed)
PIECE = 4 << 20
FLIGHT = 2


def cuts(offset: int, nbytes: int, piece: int = PIECE) -> list[tuple[int, int]]:
    """The pieces ``(offset, length)`` of ``nbytes`` bytes from ``offset``: both ends cut a
    tensor the same way (an empty tensor sends nothing)."""
    return [(offset + a, min(piece, nbytes - a)) for a in range(0, nbytes, piece)]


class Sends:
    """Non-blocking sends of one stream, posted at once (``reqs``, their buffers ``keep``,
    ``nbytes`` in all), completed or released together by :meth:`finish`."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.reqs: list[MPI.Request] = []
        self.keep: list[Any] = []
        self.nbytes = 0

    def finish(self, dc: DistComm, ok: bool) -> None:
        """``ok`` (every rank loaded): wait for the sends (matched: their receiver took
        them all); else release them (:meth:`DistComm.release`). Local."""
        try:
            if ok:
                dc.waitall_bulk(self.reqs, PHASE, self.step, self.nbytes, self.keep)
            else:
                dc.release(self.reqs, self.keep)
        finally:
            self.reqs, self.keep = [], []


class CopySend(Sends):
    """The sends of the whole copy ``path`` of rank ``owner``'s shard of ``step`` to
    ``owner``: the sizes, the header, each tensor's pieces (views of the mapped copy, no
    copy made). The copy is opened (preamble, header and identity checked) before anything
    is sent; a copy that does not open raises CorruptCheckpointError and sends nothing."""

    def __init__(self, path: Path, owner: int, tag: int, *, step: int, level: str) -> None:
        super().__init__(step)
        self.path, self.owner, self.tag, self.level = path, owner, tag, level
        self._shard: Shard | None = None

    def post(self, comm: MPI.Comm) -> None:
        """Open the copy and post every send. A copy that does not open sends sizes
        (0, 0) instead, so its owner fails at once, and raises. Local."""
        try:
            shard = self._shard = Shard.open(self.path, rank=self.owner, step=self.step,
                                             level=self.level)
        except BaseException:
            self.keep = [np.zeros(2, dtype=np.int64)]
            self.reqs = [comm.Isend([self.keep[0], MPI.BYTE], self.owner, self.tag)]
            raise
        whole = np.frombuffer(shard._mm, dtype=np.uint8)
        size = len(whole)
        hend = _PREAMBLE.size + header_length(bytes(whole[:_PREAMBLE.size]), size)
        sizes = np.array([size, hend], dtype=np.int64)
        parts = [sizes, whole[:hend]] + [
            whole[at:at + n] for t in shard.tensors for at, n in cuts(t["offset"], t["nbytes"])]
        self.reqs = [comm.Isend([p, MPI.BYTE], self.owner, self.tag) for p in parts]
        self.keep = parts
        self.nbytes = hend + sum(t["nbytes"] for t in shard.tensors)
        passes.count("send", self.nbytes)

    def finish(self, dc: DistComm, ok: bool) -> None:
        """:meth:`Sends.finish`, then unmap the copy. Local."""
        try:
            super().finish(dc, ok)
        finally:
            if self._shard is not None:
                self._shard.close()
                self._shard = None


class RemoteShard(Shard):
    """A shard that ``holder`` sends from its copy (:class:`CopySend`), read tensor by tensor
    into its destinations as a local :class:`Shard` is: :meth:`read_into` and
    :meth:`read_through` receive and hash the bytes, nothing is kept here. ``path`` names
    the copy in errors."""

    def __init__(self, path: Path, header: dict[str, Any], dc: DistComm, holder: int,
                 tag: int, step: int) -> None:
        super().__init__(path, None, header)
        self.dc, self.holder, self.tag, self.step = dc, holder, tag, step

    @classmethod
    def receive(cls, dc: DistComm, holder: int, tag: int, *, path: Path, rank: int,
                step: int, world: int, level: str) -> RemoteShard:
        """Receive and check the sizes and header of this rank's shard of ``step`` from
        ``holder`` (under ``FTKIT_TIMEOUT``). CorruptCheckpointError naming ``path`` when
        the header is damaged or is not this rank's shard of ``step`` in a ``world``-rank
        job. Local (``holder`` posts the sends)."""
        sizes = np.zeros(2, dtype=np.int64)
        dc.waitall_bulk([dc.comm.Irecv([sizes, MPI.BYTE], holder, tag)], PHASE, step, 0, [sizes])
        size, hend = int(sizes[0]), int(sizes[1])

        def bad(reason: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(str(path), f"sent by rank {holder}: {reason}",
                                          rank=rank, step=step, level=level)
        if hend == 0:
            raise bad("it could not send the copy (its log says why)")
        if not _PREAMBLE.size <= hend <= size:
            raise bad(f"a header of {hend} bytes in a file of {size}")
        head = np.empty(hend, dtype=np.uint8)
        dc.waitall_bulk([dc.comm.Irecv([head, MPI.BYTE], holder, tag)], PHASE, step, hend,
                        [head])
        try:
            header_length(head[:_PREAMBLE.size].tobytes(), size)
            header, _ = parse_header(head.tobytes(), size)
        except ShardFormatError as exc:
            raise bad(str(exc)) from None
        shard = cls(path, header, dc, holder, tag, step)
        shard.check_identity(rank=rank, step=step, world=world, level=level)
        if header["tree"] is None:
            raise bad("no state tree (tree is null)")
        passes.count("recv", hend)
        return shard

    def read_into(self, index: int, dest: np.ndarray) -> bool:
        """Receive tensor ``index`` into ``dest`` (a writable uint8 array of its size),
        hashing each piece as it lands; True when the checksum matches."""
        t, h = self.tensors[index], xxhash.xxh3_64()
        out = dest[:t["nbytes"]]
        self._receive([out[a:a + n] for a, n in cuts(0, len(out))], h)
        return XXH3 + h.hexdigest() == t["checksum"]

    def read_through(self, index: int, landing: Landing) -> bool:
        """Receive tensor ``index`` piece by piece into ``landing.buffer`` and hand each to
        ``landing.land`` (e.g. copied to a GPU), hashing as :meth:`read_into` does."""
        t, h = self.tensors[index], xxhash.xxh3_64()
        for at, n in cuts(0, t["nbytes"], min(PIECE, landing.piece)):
            piece = landing.buffer(at, n)
            self._receive([piece], h)
            landing.land(at, piece)
        return XXH3 + h.hexdigest() == t["checksum"]

    def _receive(self, parts: list[np.ndarray], h: Any) -> None:
        receive_hashed(self.dc, self.holder, self.tag, parts, h, self.step)

    def close(self) -> None:
        """Nothing is mapped or open."""


def receive_hashed(dc: DistComm, source: int, tag: int, parts: list[np.ndarray], h: Any,
                   step: int, phase: str = PHASE) -> None:
    """Receive ``parts`` from ``source`` in order (its sends of the same cuts, one ``tag``),
    FLIGHT in flight, each fed to the hash ``h`` the moment it lands (in cache); under the
    bulk deadline of their bytes (ProtocolTimeout, the receives released). Local."""
    nbytes = sum(len(p) for p in parts)
    clock = dc.deadline(nbytes)
    flight: list[tuple[MPI.Request, np.ndarray]] = []
    nxt = 0
    try:
        while nxt < len(parts) or flight:
            while len(flight) < FLIGHT and nxt < len(parts):
                flight.append((dc.comm.Irecv([parts[nxt], MPI.BYTE], source, tag),
                               parts[nxt]))
                nxt += 1
            if flight[0][0].Test():
                h.update(flight.pop(0)[1].data)
            elif clock.expired():
                raise dc.timeout_error(phase, step, nbytes=nbytes)
            else:
                time.sleep(0)            # let the checkpoint thread run
    except BaseException:
        dc.release([r for r, _ in flight], [p for _, p in flight])
        raise
    passes.count("recv", nbytes)

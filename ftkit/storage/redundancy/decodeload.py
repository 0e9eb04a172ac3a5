"""Decode a lost set member's shard from its erasure set piece by piece as it streams in,
with bounded buffers: straight into its live state (a restore), or into a node-local slot
(a rebuild on disk). No whole-shard buffer, no reduction over whole segments.

Both ends derive the same plan from the layout
(:class:`~ftkit.storage.redundancy.stripes.Layout`) and every member's report: the lost
member's file is its ``m`` data segments in order, cut into pieces of at most
:data:`~ftkit.storage.redundancy.fetch.PIECE`; for the piece at file offset ``F`` each
*contributor* (a member whose data or parity segment of that stripe the decode chose) sends
the same range of its segment — a view of its mapped shard or parity file, no copy. The lost
member (:class:`DecodedShard`) receives every contributor's piece into a small buffer,
:data:`FLIGHT` pieces in flight, sums them with their GF(256) coefficients (XOR when all are
1: XOR and one-parity Reed–Solomon; ``gf256.mad_into`` otherwise) into the piece of its
file, and routes the bytes in file order: the first ones are the preamble and header (checked like a local shard's: header
checksum, rank, step, world size), then each tensor's range goes into its destination (the
live tensor), hashed as it lands and compared with the tensor's recorded checksum at its end.
Memory: ``(FLIGHT + 1) x (contributors + 1)`` pieces. A wrong or damaged contribution fails a
tensor's checksum (or the header's), like a damaged local shard.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from mpi4py import MPI

from ftkit import passes
from ftkit.buffers import aligned_empty
from ftkit.comm.dist import DistComm
from ftkit.errors import CorruptCheckpointError
from ftkit.fs import create_temp, rename_into_place, write_all
from ftkit.storage.redundancy import gf256
from ftkit.storage.redundancy.fetch import FLIGHT, PIECE, Sends
from ftkit.storage.redundancy.stripes import Layout, piece_of
from ftkit.storage.redundancy.transfer import StreamCheck
from ftkit.storage.shard import (
    _PREAMBLE,
    XXH3,
    Landing,
    Shard,
    ShardFormatError,
    header_length,
    parse_header,
)
from ftkit.storage.slots import Slots

PHASE = "restore-load"
#: a contribution: (owner member index, "d" data segment or "p" parity slot, its index,
#: its GF(256) coefficient)
Term = tuple[int, str, int, int]


@dataclasses.dataclass(frozen=True)
class Piece:
    """One piece of the lost member's file: ``n`` bytes at file offset ``at``, found at
    ``offset`` of each contributor's segment ``terms``."""

    at: int
    n: int
    offset: int
    terms: tuple[Term, ...]


def decode_terms(layout: Layout, lost: int, lost_all: Sequence[int],
                 data_ok: Sequence[bool], parity_ok: Sequence[bool]
                 ) -> list[tuple[Term, ...]] | None:
    """For each data segment q of member ``lost`` (its stripes in order), the segments and
    GF(256) coefficients whose sum is it (all 1 for XOR: their XOR); None when a stripe
    cannot be decoded. ``lost_all``: every lost member of the set. Pure."""
    out: list[tuple[Term, ...]] = []
    for t in range(layout.k):
        dm, hold = layout.data_members(t), layout.holders(t)
        if lost not in dm:
            continue
        plan = layout.decode_rows(t, {x for x, mem in enumerate(dm)
                                      if data_ok[mem] and mem not in lost_all},
                                  {j for j, h in enumerate(hold) if parity_ok[h]})
        if plan is None:
            return None
        chosen, inv = plan
        terms = []
        for c, (kind, idx) in zip(inv[dm.index(lost)], chosen):
            if c:
                owner = dm[idx] if kind == "d" else hold[idx]
                terms.append((owner, "d", layout.seg_index(owner, t), c) if kind == "d" else
                             (owner, "p", layout.parity_slot(owner, t), c))
        out.append(tuple(terms))
    return out


def pieces(terms: list[tuple[Term, ...]], seg: int, size: int) -> list[Piece]:
    """The pieces of a ``size``-byte file of segments of ``seg`` bytes (both ends)."""
    out: list[Piece] = []
    for q, ts in enumerate(terms):
        for o in range(0, seg, PIECE):
            at = q * seg + o
            if at >= size:
                return out
            out.append(Piece(at, min(PIECE, seg - o, size - at), o, ts))
    return out


class DecodedSend(Sends):
    """This member's contributions to lost member ``lost``'s pieces: non-blocking sends of
    views of its segments (``mine[(kind, index)]``), all posted at once."""

    def __init__(self, dc: DistComm, lost: int, plan: list[Piece], tag: int, step: int
                 ) -> None:
        super().__init__(step)
        self.dc, self.lost, self.plan, self.tag = dc, lost, plan, tag

    def post(self, mine: dict[tuple[str, int], np.ndarray]) -> None:
        me = self.dc.rank
        for piece in self.plan:
            for owner, kind, idx, _ in piece.terms:
                if owner == me:
                    view = piece_of(mine[(kind, idx)], piece.offset, piece.n)
                    self.reqs.append(self.dc.comm.Isend([view, MPI.BYTE], self.lost, self.tag))
                    self.keep.append(view)
                    self.nbytes += piece.n
        passes.count("send", self.nbytes)


def _combine(terms: Sequence[Term], bufs: list[np.ndarray]) -> np.ndarray:
    """The sum over GF(256) of the received pieces ``bufs[i]`` times their terms'
    coefficients, in place: in a piece whose coefficient is 1 when there is one (XOR: no
    multiplication at all), else in the spare buffer ``bufs[len(terms)]``."""
    ones = [i for i, term in enumerate(terms) if term[3] == 1]
    if ones:
        first, out = ones[0], bufs[ones[0]]
    else:
        first, out = 0, gf256.scale_into(bufs[len(terms)], terms[0][3], bufs[0])
    for i, term in enumerate(terms):
        if i != first:
            gf256.mad_into(out, term[3], bufs[i])
    return out


class _Stream:
    """The lost member's file bytes, in order, from the contributors' pieces (summed)."""

    def __init__(self, dc: DistComm, plan: list[Piece], tags: dict[int, int], step: int
                 ) -> None:
        self.dc, self.plan, self.tags, self.step = dc, plan, tags, step
        width = max((len(p.terms) for p in plan), default=1) + 1     # + the sum
        self._ring = [[aligned_empty(PIECE) for _ in range(width)] for _ in range(FLIGHT + 1)]
        self._flight: deque[tuple[Piece, list[MPI.Request], list[np.ndarray]]] = deque()
        self._next = 0                              # index of the next piece to post
        self._cur: tuple[int, np.ndarray] | None = None    # the current piece: at, bytes
        self._clock = dc.deadline(sum(p.n * len(p.terms) for p in plan))

    def _fill(self) -> None:
        while len(self._flight) < FLIGHT and self._next < len(self.plan):
            piece = self.plan[self._next]
            bufs = [b[:piece.n] for b in self._ring[self._next % (FLIGHT + 1)]]
            reqs = [self.dc.comm.Irecv([b, MPI.BYTE], owner, self.tags[owner])
                    for b, (owner, *_) in zip(bufs, piece.terms)]
            self._flight.append((piece, reqs, bufs))
            self._next += 1

    def _advance(self) -> bool:
        """Make the next piece current; False at the end of the file."""
        self._fill()
        if not self._flight:
            self._cur = None
            return False
        piece, reqs, bufs = self._flight[0]
        while not MPI.Request.Testall(reqs):
            if self._clock.expired():
                raise self.dc.timeout_error(PHASE, self.step,
                                            nbytes=sum(p.n for p in self.plan))
            time.sleep(0)
        self._flight.popleft()
        self._cur = (piece.at, _combine(piece.terms, bufs))
        passes.count("recv", piece.n * len(piece.terms))
        return True

    def take(self, a: int, b: int) -> Iterator[np.ndarray]:
        """Views of the file's bytes ``a .. b`` in order (each valid until the next);
        ``a`` never goes back."""
        while a < b:
            if self._cur is None or self._cur[0] + len(self._cur[1]) <= a:
                if not self._advance():
                    raise EOFError(f"the file ends before byte {b}")
                continue
            at, buf = self._cur
            lo, hi = a - at, min(b, at + len(buf)) - at
            yield buf[lo:hi]
            a = at + hi

    def drain(self) -> None:
        """Receive whatever is left (so every contributor's sends complete); the buffers
        are let go."""
        while self._advance():
            pass
        self._ring = []

    def release(self) -> None:
        """After an error: release the receives in flight (their buffers kept until MPI is
        done with them, :meth:`DistComm.release`) and let the buffers go."""
        self.dc.release([r for _, reqs, _ in self._flight for r in reqs],
                        [b for _, _, bufs in self._flight for b in bufs])
        self._flight.clear()
        self._ring, self._cur = [], None


class DecodedShard(Shard):
    """The lost member's shard decoded from its set's pieces (:class:`_Stream`), read tensor
    by tensor like a local :class:`Shard`; tensors must be read in file order (the restore
    reads them in header order, which is the file's)."""

    def __init__(self, path: Path, header: dict[str, Any], stream: _Stream) -> None:
        super().__init__(path, None, header)
        self.stream = stream

    @classmethod
    def receive(cls, dc: DistComm, plan: list[Piece], tags: dict[int, int], *, size: int,
                path: Path, rank: int, step: int, world: int, level: str) -> DecodedShard:
        """Decode and check the preamble and header of this rank's shard of ``step`` (a
        ``size``-byte file) from the pieces of ``plan``, each contributor's with its tag
        (``tags[owner]``). CorruptCheckpointError naming ``path`` when they do not check
        or are not this rank's shard; also when the tensors are not in file order."""
        stream = _Stream(dc, plan, tags, step)

        def bad(reason: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(str(path), f"decoded from {level} parity: {reason}",
                                          rank=rank, step=step, level=level)
        try:
            pre = b"".join(v.tobytes() for v in stream.take(0, _PREAMBLE.size))
            hend = _PREAMBLE.size + header_length(pre, size)
            head = pre + b"".join(v.tobytes() for v in stream.take(_PREAMBLE.size, hend))
            header, _ = parse_header(head, size)
        except (ShardFormatError, EOFError) as exc:
            stream.release()
            raise bad(str(exc)) from None
        shard = cls(path, header, stream)
        offsets = [t["offset"] for t in header["tensors"]]
        try:
            shard.check_identity(rank=rank, step=step, world=world, level=level)
            if offsets != sorted(offsets) or header["tree"] is None:
                raise bad("tensors not in file order, or no state tree")
        except CorruptCheckpointError:
            stream.release()
            raise
        return shard

    def read_into(self, index: int, dest: np.ndarray) -> bool:
        t, h = self.tensors[index], xxhash.xxh3_64()
        pos = 0
        for view in self._take(t):
            dest[pos:pos + len(view)] = view
            h.update(view.data)
            pos += len(view)
        passes.count("copy", t["nbytes"])
        return XXH3 + h.hexdigest() == t["checksum"]

    def read_through(self, index: int, landing: Landing) -> bool:
        t, h = self.tensors[index], xxhash.xxh3_64()
        pos = 0
        for view in self._take(t):
            for a in range(0, len(view), landing.piece):
                part = view[a:a + landing.piece]
                buf = landing.buffer(pos, len(part))
                np.copyto(buf, part)
                h.update(part.data)
                landing.land(pos, buf)
                pos += len(part)
        return XXH3 + h.hexdigest() == t["checksum"]

    def _take(self, t: dict[str, Any]) -> Iterator[np.ndarray]:
        try:
            yield from self.stream.take(t["offset"], t["offset"] + t["nbytes"])
        except EOFError as exc:
            raise CorruptCheckpointError(str(self.path), str(exc), rank=self.header["rank"],
                                         step=self.header["step"]) from None

    def finish(self, ok: bool) -> None:
        """After the load: receive the rest of the file (``ok``) or release the receives."""
        if ok:
            self.stream.drain()
        else:
            self.stream.release()

    def close(self) -> None:
        """Nothing is mapped or open."""


class ErasureStream:
    """One load of set members ``lost`` decoded straight into their live state, on one member
    of the set (``level``: an ``ErasureLevel``; its communicator, layout and segments): the
    pieces it contributes are sent, its own shard is decoded when it is lost. ``header``:
    an intact parity header of the set (segment size, every member's size)."""

    def __init__(self, level: Any, step: int, lost: list[int], data_ok: list[bool],
                 parity_ok: list[bool], header: dict[str, Any]) -> None:
        self.level, self.step, self.lost = level, step, lost
        self.data_ok, self.parity_ok = data_ok, parity_ok
        self.seg, self.sizes = int(header["seg"]), [int(n) for n in header["sizes"]]
        self.sends: list[DecodedSend] = []
        self.shard: DecodedShard | None = None
        self._maps = contextlib.ExitStack()

    def _plan(self, member: int) -> list[Piece]:
        terms = decode_terms(self.level.layout, member, self.lost, self.data_ok,
                             self.parity_ok)
        assert terms is not None            # the cover said every lost member streams
        return pieces(terms, self.seg, self.sizes[member])

    def _incoming(self) -> tuple[list[Piece], dict[int, int]]:
        """This (lost) member's pieces and the tag of each contributor (one bulk tag per
        pair, as the contributors take it in :meth:`post`). Local."""
        dc = self.level.sdc
        plan = self._plan(dc.rank)
        owners = sorted({owner for p in plan for owner, *_ in p.terms})
        return plan, {o: dc.bulk_tag(self.step, o, dc.rank) for o in owners}

    def post(self) -> None:
        """Post the sends of this member's contributions (views of its mapped shard and
        parity). Local."""
        lv, dc = self.level, self.level.sdc
        me = dc.rank
        plans = {x: self._plan(x) for x in self.lost}
        mine = None
        for x, plan in plans.items():
            if not any(owner == me for p in plan for owner, *_ in p.terms):
                continue
            if mine is None:
                mine = lv._my_segments(self._maps, self.step, self.data_ok[me],
                                       self.parity_ok[me], self.seg)
            send = DecodedSend(dc, x, plan, dc.bulk_tag(self.step, me, x), self.step)
            self.sends.append(send)
            send.post(mine)

    def open(self, world: int) -> DecodedShard | None:
        """This member's shard, decoded as it streams (header checked), or None when it is
        not lost. Local (the contributors post their sends)."""
        lv, dc = self.level, self.level.sdc
        me = dc.rank
        if me not in self.lost:
            return None
        rank = lv.members[me]
        where = Path(f"rank {rank}'s shard of step {self.step} decoded from {lv.name} set "
                     f"{lv.set_id}")
        plan, tags = self._incoming()
        self.shard = DecodedShard.receive(dc, plan, tags, size=self.sizes[me], path=where,
                                          rank=rank, step=self.step, world=world,
                                          level=lv.name)
        return self.shard

    def rebuild(self) -> None:
        """Decode the lost members' shards into their node-local slots (or plain files when
        no slot is free), each checked as it lands (:func:`receive_file`), with bounded
        buffers. Every member of the set calls; a lost member raises CorruptCheckpointError
        when its decoded shard does not check."""
        lv, dc = self.level, self.level.sdc
        me, ok = dc.rank, False
        self.post()
        try:
            if me in self.lost:
                path = lv.local.shard_path(self.step)
                check = StreamCheck(path, self.sizes[me], source=me, rank=lv.members[me],
                                    step=self.step, world=None, level=lv.name, counted=False,
                                    damage=f"decoded from {lv.name} parity of set "
                                           f"{lv.set_id} (a member's data or parity is "
                                           f"damaged)")
                lv.local.ensure_step_dir(self.step)
                receive_file(_Stream(dc, *self._incoming(), self.step), self.sizes[me], path,
                             lv.local.slots, check)
            ok = True
        finally:
            for send in self.sends:
                send.finish(self.level.sdc, ok)
            self.sends = []
            self._maps.close()

    def finish(self, ok: bool) -> None:
        """Receive the rest of the decoded file or release it; complete or release the
        sends; unmap. Local."""
        try:
            if self.shard is not None:
                self.shard.finish(ok)
            for send in self.sends:
                send.finish(self.level.sdc, ok)
        finally:
            self.sends, self.shard = [], None
            self._maps.close()


def receive_file(stream: _Stream, size: int, path: Path, slots: Slots,
                 check: StreamCheck) -> None:
    """Write the ``size`` bytes of ``stream`` as ``path``: into a claimed slot of ``slots``
    (published once complete), else a private temp file (fsynced, renamed into place);
    every piece checked by ``check`` before it is kept. After a mismatch the rest is still
    received (so every contributor's sends complete) but nothing more is kept, and the
    CorruptCheckpointError is raised; nothing is published then. Local."""
    claimed = None
    with contextlib.suppress(OSError):
        claimed = slots.claim(size)
    fd, tmp = create_temp(path) if claimed is None else (None, None)
    error: CorruptCheckpointError | None = None
    try:
        pos = 0
        for view in stream.take(0, size):
            if error is None:
                try:
                    check.feed(view)
                except CorruptCheckpointError as exc:
                    error = exc
            if error is None:
                if claimed is not None:
                    claimed[1][pos:pos + len(view)] = view
                else:
                    write_all(fd, view)     # type: ignore[arg-type]
            pos += len(view)
        stream.drain()
        if error is not None:
            raise error
        check.finish()
        if claimed is not None:
            slots.publish(claimed[0], path)
        else:
            assert fd is not None and tmp is not None
            os.fsync(fd)
            os.close(fd)
            fd = None
            rename_into_place(tmp, path)
            tmp = None
    except BaseException:
        stream.release()
        raise
    finally:
        if fd is not None:
            os.close(fd)
        if tmp is not None:
            tmp.unlink(missing_ok=True)

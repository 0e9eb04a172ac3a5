"""XOR and Reed–Solomon levels: parity of an erasure set, spread over its members.

Layout and code: :mod:`ftkit.storage.redundancy.stripes`. Encoding is a ring reduce-scatter
of partial sums (:meth:`ErasureLevel._reduce_parity`): XOR sends views of the mapped shard
(no copy), RS scaled copies. Decoding streams: the members a stripe's decode chose send views
of their segments to the lost member, which sums them with their GF(256) coefficients as
they land, into its live state or a slot (:mod:`ftkit.storage.redundancy.decodeload`).

``step-<s>/<xor|rs>-<set>-<index>.ftk`` is written with the shard format: its ``p`` parity
segments are checksummed tensors and its header records the set, the size and the whole-file
checksum of every member's shard, so a rebuilt shard is verified before it is used.

Parity is computed in memory from partial sums received over MPI, and its file checksum is
computed from that memory, so the checksum alone cannot reveal a partial sum corrupted in
transfer. Encoding therefore checks every parity segment end to end before it is written:
each member publishes the :func:`fold` of its data segments (the XOR of their
:data:`FOLD`-byte blocks, computed in one pass), and the holder compares the fold of the
parity it received with the same combination of the members' folds. The fold is linear over
GF(256) byte by byte, so ``fold(sum c_x * d_x) = sum c_x * fold(d_x)`` holds exactly for XOR
and RS; any corruption confined to fewer than FOLD consecutive bytes (a flipped bit or byte,
a garbled word) changes the fold, so such a parity makes ``encode`` raise on its holder,
which votes no: a parity corrupted in transfer is never covered by COMMITTED. (Damage after
the write is caught at restore by the file's checksum.)
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from mpi4py import MPI

from ftkit import passes
from ftkit.buffers import aligned_empty
from ftkit.capture.flatten import TensorLeaf
from ftkit.comm.dist import DistComm
from ftkit.comm.placement import set_of
from ftkit.errors import CorruptCheckpointError
from ftkit.faults import Faults
from ftkit.storage.level import Cover, Redundancy, Report, ranks_text
from ftkit.storage.local import LocalLevel
from ftkit.storage.redundancy import gf256
from ftkit.storage.redundancy.decodeload import ErasureStream, decode_terms
from ftkit.storage.redundancy.fetch import FLIGHT, PIECE, cuts
from ftkit.storage.redundancy.stripes import Layout, piece_of, segments
from ftkit.storage.redundancy.transfer import StreamCheck, mapped
from ftkit.storage.shard import ALIGN, READ_CHUNK, XXH3, Shard, write_shard
from ftkit.storage.site import Site
from ftkit.storage.slots import Reservation, Slots

log = logging.getLogger(__name__)
#: bytes of a segment's fold (a multiple of 8; segments are multiples of ALIGN bytes)
FOLD = 512
#: words per row of :func:`fold`'s first, wide reduction (a multiple of FOLD // 8)
_WIDE = 1024


def fold(seg: np.ndarray) -> np.ndarray:
    """XOR of the FOLD-byte blocks of ``seg`` (the last one zero-padded): FOLD bytes.
    Linear over GF(256) in every byte: ``fold(c * a ^ b) == c * fold(a) ^ fold(b)``.
    Whole :data:`_WIDE`-word rows are XORed together first (one wide accumulator: numpy
    reduces long rows ~1.5x faster than FOLD-byte ones), then folded; XOR is associative,
    so the result is the same."""
    words, lane = seg.view(np.uint64), FOLD // 8
    wide = len(words) // _WIDE * _WIDE
    if wide:
        acc = np.bitwise_xor.reduce(words[:wide].reshape(-1, _WIDE), axis=0)
        words = np.concatenate([acc, words[wide:]]) if wide < len(words) else acc
    whole = len(words) // lane * lane
    out = np.zeros(lane, dtype=np.uint64)
    if whole:
        np.bitwise_xor.reduce(words[:whole].reshape(-1, lane), axis=0, out=out)
    tail = words[whole:]
    out[:len(tail)] ^= tail
    return out.view(np.uint8)


def fold_and_checksum(seg: np.ndarray) -> tuple[np.ndarray, str]:
    """:func:`fold` of ``seg`` and its checksum string, in one pass (each
    :data:`~ftkit.storage.shard.READ_CHUNK` piece hashed and folded while it is in cache;
    counted as the ``hash`` pass)."""
    h, out = xxhash.xxh3_64(), np.zeros(FOLD, dtype=np.uint8)
    step = READ_CHUNK - READ_CHUNK % FOLD
    for a in range(0, len(seg), step):
        piece = seg[a:a + step]
        h.update(piece.data)
        np.bitwise_xor(out, fold(piece), out=out)
    passes.count("hash", len(seg))
    return out, XXH3 + h.hexdigest()


def scan(data: np.ndarray, m: int, s: int, check: StreamCheck) -> tuple[str, list[bytes]]:
    """One pass over a shard's bytes, :data:`~ftkit.storage.shard.READ_CHUNK` at a time while
    each piece is in cache: ``check`` verifies it (header, every tensor's checksum, zero
    padding: CorruptCheckpointError), and it yields the whole-file checksum and the
    :func:`fold` of each of the ``m`` segments of ``s`` bytes (the zero tail adds nothing)."""
    whole, folds = xxhash.xxh3_64(), []
    for q in range(m):
        acc = np.zeros(FOLD, dtype=np.uint8)
        end = min((q + 1) * s, len(data))
        for a in range(q * s, end, READ_CHUNK):
            piece = data[a:min(a + READ_CHUNK, end)]
            check.feed(piece)
            whole.update(piece.data)
            if len(piece) % 8:                  # only a shard's last piece: pad its tail
                piece = np.concatenate([piece, np.zeros(-len(piece) % 8, np.uint8)])
            np.bitwise_xor(acc, fold(piece), out=acc)
        folds.append(acc.tobytes())
    check.finish()              # counted its one ``hash`` pass (the other sums ride on it)
    return XXH3 + whole.hexdigest(), folds


def segment_size(sizes: list[int], m: int) -> int:
    longest = max(sizes) if sizes else 0
    per = max(1, -(-longest // m))
    return -(-per // ALIGN) * ALIGN


def _words(seg: np.ndarray) -> list[object]:
    """MPI buffer of a segment as 64-bit words: BXOR on words is ~8x faster than on bytes
    (segments are multiples of ALIGN bytes and start at aligned offsets)."""
    return [seg.view(np.uint64), MPI.UINT64_T]


def _partial(prev: np.ndarray | None, term: tuple[np.ndarray, int] | None,
             out: np.ndarray) -> np.ndarray:
    """One piece of the partial sum a member sends on: ``prev`` (the piece received, None
    on the first hop) plus ``c * seg`` of its ``term`` (None: it adds nothing), in ``out``
    unless it is the member's own bytes unchanged (the first hop of XOR sends a view of its
    shard)."""
    if term is None:
        if prev is None:
            out.fill(0)
        else:
            np.copyto(out, prev)
            passes.count("copy", len(out))
        return out
    seg, c = term
    if prev is None:
        return seg if c == 1 else gf256.scale_into(out, c, seg)
    if c == 1:
        np.bitwise_xor(prev.view(np.uint64), seg.view(np.uint64), out=out.view(np.uint64))
    else:
        np.copyto(out, prev)
        gf256.mad_into(out, c, seg)
    passes.count("encode", len(out))
    return out


def parity_ok(report: Report, level: str) -> bool:
    """Does ``report`` hold ``level``'s parity intact (a header, not an error or nothing)?"""
    held = report.get(level)
    return isinstance(held, dict) and "error" not in held


class ErasureCover(Cover):
    """The erasure sets of one level (``sets[i]``: the ranks of set i, on different nodes)
    and its parity count: a set rebuilds its lost members while enough of its data and
    parity blocks remain in every stripe they touch."""

    kind = "parity"

    def __init__(self, name: str, sets: Sequence[Sequence[int]], parity: int) -> None:
        self.name, self.sets, self.parity = name, [list(m) for m in sets], parity

    def solve(self, reports: Sequence[Report], have: list[bool],
              node_name: Sequence[str]) -> tuple[dict[int, list[int]], list[str]]:
        """``{set id: lost member indices}`` of the sets that can decode. Pure."""
        part: dict[int, list[int]] = {}
        why: list[str] = []
        for sid, members in enumerate(self.sets):
            idx = [i for i, r in enumerate(members) if not have[r]]
            if not idx:
                continue
            p_ok = [parity_ok(reports[r], self.name) for r in members]
            if _solvable(Layout(len(members), self.parity), idx, [have[r] for r in members],
                         p_ok):
                part[sid] = idx
                for i in idx:
                    have[members[i]] = True
            else:
                gone = [members[i] for i in idx]
                why.append(f"{self.name}: set {sid} {members} lost the shards of "
                           f"{ranks_text(gone, node_name)} and {p_ok.count(False)} parity "
                           f"block(s); it tolerates {self.parity} lost member(s)")
        return part, why

    def rebuilt(self, part: dict[int, list[int]]) -> list[int]:
        return [self.sets[sid][i] for sid, idx in part.items() for i in idx]

    def streams(self, part: dict[int, list[int]], reports: Sequence[Report]
                ) -> dict[int, str] | None:
        """Lost members load straight from their set, decoded as the pieces stream in
        (:mod:`ftkit.storage.redundancy.decodeload`). Pure."""
        out: dict[int, str] = {}
        for sid, idx in part.items():
            members = self.sets[sid]
            data_ok = [i not in idx for i in range(len(members))]
            p_ok = [parity_ok(reports[r], self.name) for r in members]
            lay = Layout(len(members), self.parity)
            if any(decode_terms(lay, i, idx, data_ok, p_ok) is None for i in idx):
                return None
            out.update({members[i]: f"{self.name} set {sid}" for i in idx})
        return out


def _solvable(layout: Layout, lost_idx: list[int], data_ok: list[bool],
              parity_ok_: list[bool]) -> bool:
    for t in range(layout.k):
        dm = layout.data_members(t)
        if not any(mem in lost_idx for mem in dm):
            continue
        avail = sum(data_ok[mem] for mem in dm) + sum(parity_ok_[h] for h in layout.holders(t))
        if avail < layout.m:
            return False
    return True


class ErasureLevel(Redundancy):
    """One rank's membership in one erasure set (``xor``: p = 1, ``rs``: p >= 1)."""

    cover: ErasureCover

    @classmethod
    def builder(cls, name: str, size: str, parity: str | int
                ) -> Callable[[Site], ErasureLevel]:
        """The registry's builder of level ``name``: sets of the Config field ``size``,
        ``parity`` blocks (a number, or the Config field that holds it)."""
        def build(site: Site) -> ErasureLevel:
            p = parity if isinstance(parity, int) else int(getattr(site.config, parity))
            sets = site.topo.erasure_sets(int(getattr(site.config, size)), minimum=p + 1,
                                          what=name)
            sid, idx = set_of(sets, site.topo.rank)
            return cls(name, site.local, site.dc.split(sid, idx), sid, sets[sid], p,
                       site.faults, sets=sets)
        return build

    def __init__(self, name: str, local: LocalLevel, sdc: DistComm, set_id: int,
                 members: list[int], parity: int, faults: Faults, *,
                 sets: Sequence[Sequence[int]] | None = None) -> None:
        self.name = name
        self.local, self.sdc = local, sdc      # sdc: communicator of this set only
        self.set_id, self.members = set_id, members
        # every set of the job (the cover plans restores); without: the ones before are unknown
        self.cover = ErasureCover(name, sets if sets is not None else
                                  [[]] * set_id + [members], parity)
        self.index = sdc.rank
        self.layout = Layout(len(members), parity)
        self.faults = faults
        self.slots = Slots(local.root, local.rank, of=f"{name}-{set_id}")   # parity files

    def parity_path(self, step: int) -> Path:
        return self.local.step_dir(step) / f"{self.name}-{self.set_id}-{self.index}.ftk"

    # ------------------------------------------------------------------ encode
    def encode(self, step: int) -> None:
        """Compute, check and store this member's parity segments. Collective over the set;
        raises CorruptCheckpointError on a member whose parity arrived damaged, and on every
        member when one member's shard is not a regular file in its private step directory
        (a planted symbolic link is never read; no member writes parity)."""
        with contextlib.ExitStack() as stack:
            data = self._own_data(stack, step)
            sizes = self.sdc.allgather(len(data) if isinstance(data, np.ndarray) else 0,
                                       "encode", step)
            s = segment_size(sizes, self.layout.m)
            mine = self._scanned(data, s, step) if isinstance(data, np.ndarray) else data
            info = self.sdc.allgather(
                {"checksum": mine[0], "folds": [f.hex() for f in mine[1]], "problem": None}
                if isinstance(mine, tuple) else {"problem": mine.reason}, "encode", step)
            self._refuse_unusable(step, [i["problem"] for i in info])
            assert isinstance(data, np.ndarray)           # else refused above
            meta = {"job": self.local.root.parent.name, "step": step,
                    "rank": self.local.rank, "world": -1, "level": self.name,
                    "set": self.set_id, "members": self.members, "index": self.index,
                    "k": self.layout.k, "p": self.layout.p, "seg": s, "sizes": sizes,
                    "checksums": [i["checksum"] for i in info]}
            leaves = [TensorLeaf(f"parity/{j}", "numpy", "|u1", (s,), s)
                      for j in range(self.layout.p)]
            res = self._reserve(meta, leaves)
            parity = self._reduce_parity(segments(data, self.layout.m, s), s, step, res)
        sums = self._check_parity(step, parity, [[bytes.fromhex(f) for f in i["folds"]]
                                                 for i in info])
        if res is None:
            write_shard(self.parity_path(step), meta, None, leaves, parity)
            return
        res.sums[:] = sums                  # computed in the pass that checked the parity
        self.slots.finish(res, self.parity_path(step), [])

    def _reserve(self, meta: dict[str, Any], leaves: list[TensorLeaf]) -> Reservation | None:
        """A free parity slot laid out for this step's parity file, for the ring to leave
        each parity segment in (no copy, no second write); None when none may be used now
        (the parity is then received in memory and written as a plain file)."""
        try:
            return self.slots.reserve(meta, None, leaves)
        except OSError as exc:
            log.warning("rank %d: no %s parity slot (%s); writing a plain file",
                        self.local.rank, self.name, exc)
            return None

    def free(self) -> None:
        """Unmap the parity slots and free the set's communicator. Local."""
        self.close()
        self.sdc.free()

    def close(self) -> None:
        """Unmap the parity slots (their files stay). Local."""
        self.slots.close()

    def _scanned(self, data: np.ndarray, s: int, step: int
                 ) -> tuple[str, list[bytes]] | CorruptCheckpointError:
        """My shard verified in the pass that computes its whole-file checksum and segment
        folds (:func:`scan`): ``(checksum, folds)``, or why it is damaged (not raised:
        every member must reach the next collective)."""
        me, path = self.local.rank, self.local.shard_path(step)
        check = StreamCheck(path, len(data), source=me, rank=me, step=step, world=None,
                            level="local", damage="damaged after it was written")
        try:
            return scan(data, self.layout.m, s, check)
        except CorruptCheckpointError as exc:
            return exc

    def _own_data(self, stack: contextlib.ExitStack, step: int
                  ) -> np.ndarray | CorruptCheckpointError:
        """A view of my shard of ``step`` (the slot mapping its write made, else mapped as
        long as ``stack``), or why it is not usable (the error, not raised: every member
        must reach the next collective)."""
        path = self.local.shard_path(step)
        try:
            own = self._own_file(path, step, "shard")
            view = self.local.slots.view_of(own)
            if view is not None:
                return view
            return stack.enter_context(mapped(own,
                                              rank=self.local.rank, step=step,
                                              level=self.name))
        except CorruptCheckpointError as exc:
            return exc
        except OSError as exc:
            return CorruptCheckpointError(str(path), f"cannot read: {exc}",
                                          rank=self.local.rank, step=step, level=self.name)

    def _refuse_unusable(self, step: int, problems: list[str | None]) -> None:
        """Raise CorruptCheckpointError when any member's shard is unusable (``problems`` by
        set index): every member, each naming the shard(s) refused."""
        bad = {self.members[i]: why for i, why in enumerate(problems) if why is not None}
        if bad:
            mine = problems[self.index]
            raise CorruptCheckpointError(
                str(self.local.shard_path(step) if mine else self.parity_path(step)),
                mine or "no parity written: the shard of set member(s) "
                + "; ".join(f"rank {r}: {why}" for r, why in sorted(bad.items())),
                rank=self.local.rank, step=step, level=self.name)

    def _check_parity(self, step: int, parity: list[np.ndarray], folds: list[list[bytes]]
                      ) -> list[str | None]:
        """Compare the fold of each parity segment held here with the combination of the
        folds of the data segments it encodes (``folds[member][segment]``); the segments'
        checksums, computed in the same pass (by parity slot)."""
        lay, me = self.layout, self.index
        got = [fold_and_checksum(seg) for seg in parity]
        for j in range(lay.p):
            t = (me - j) % lay.k                     # stripe whose parity j I hold
            want = np.zeros(FOLD, dtype=np.uint8)
            for x, mem in enumerate(lay.data_members(t)):
                part = np.frombuffer(folds[mem][lay.seg_index(mem, t)], dtype=np.uint8)
                np.bitwise_xor(want, gf256.scale_into(np.empty(FOLD, np.uint8),
                                                      lay.coef[j][x], part), out=want)
            if not np.array_equal(got[lay.parity_slot(me, t)][0], want):
                raise CorruptCheckpointError(
                    str(self.parity_path(step)), f"parity {j} of stripe {t} does not match "
                    f"the data of set members {lay.data_members(t)} (corrupted in transfer "
                    f"from member {(me - 1) % lay.k}); not written",
                    rank=self.local.rank, step=step, level=self.name)
        return [c for _, c in got]

    def _reduce_parity(self, segs: list[np.ndarray], s: int, step: int,
                       res: Reservation | None) -> list[np.ndarray]:
        """Ring reduce-scatter (SCR's XOR pattern), one pass per parity index j: the partial
        sum of stripe t's parity j starts at its holder's successor, gathers every member's
        contribution around the ring and arrives at the holder after k - 1 hops. Each rank
        sends and receives p (k - 1) segments of s bytes, in pieces (:meth:`_hop`); XOR runs
        on 64-bit words. With a reserved parity slot ``res`` each partial sum is received
        into the parity's place in it, so the last one is the parity in its file. The
        ``corrupt`` fault of this level hits the last partial sum received (the parity)."""
        lay, me, k = self.layout, self.index, self.layout.k
        tags = (self.sdc.bulk_tag(step, me, (me + 1) % k),
                self.sdc.bulk_tag(step, (me - 1) % k, me))
        parity: list[np.ndarray] = [np.empty(0, np.uint8)] * lay.p
        ring = [aligned_empty(min(PIECE, s)) for _ in range(FLIGHT)]
        for j in range(lay.p):
            at = lay.parity_slot(me, (me - j) % k)
            inbox = res.view(at) if res is not None else aligned_empty(s)
            for hop in range(1, k):
                t = (me - hop - j) % k                  # the stripe my term joins
                dm = lay.data_members(t)
                term = (segs[lay.seg_index(me, t)], lay.coef[j][dm.index(me)]) \
                    if me in dm else None
                self._hop(hop == 1, term, inbox, ring, step, tags)
            self.faults.corrupt_buffer(inbox, level=self.name, step=step)
            parity[at] = inbox
        return parity

    def _hop(self, first: bool, term: tuple[np.ndarray, int] | None, inbox: np.ndarray,
             ring: list[np.ndarray], step: int, tags: tuple[int, int]) -> None:
        """One hop of the ring, piece by piece (:data:`PIECE` bytes, ``len(ring)`` pieces
        in flight): send my partial sum to the next member — my ``term`` (segment,
        coefficient; None: I add nothing) plus, unless ``first``, the partial sum
        ``inbox`` holds — and receive the previous member's into ``inbox``, each piece of
        it once its bytes have gone into the piece sent. No buffer of a whole segment
        besides ``inbox``. Collective over the set (every member hops together)."""
        comm, me, k = self.sdc.comm, self.index, self.layout.k
        flight: deque[tuple[list[MPI.Request], list[np.ndarray]]] = deque()
        try:
            for i, (a, n) in enumerate(cuts(0, len(inbox), len(ring[0]))):
                if len(flight) == len(ring):
                    reqs, keep = flight.popleft()
                    self.sdc.waitall_bulk(reqs, "encode", step, 2 * n, keep)
                prev = None if first else inbox[a:a + n]
                out = _partial(prev, term and (piece_of(term[0], a, n), term[1]),
                               ring[i % len(ring)][:n])
                flight.append(([comm.Isend(_words(out), (me + 1) % k, tag=tags[0]),
                                comm.Irecv(_words(inbox[a:a + n]), (me - 1) % k,
                                           tag=tags[1])], [out, inbox]))
                passes.count("send", n)
                passes.count("recv", n)
            while flight:
                reqs, keep = flight.popleft()
                self.sdc.waitall_bulk(reqs, "encode", step, 0, keep)
        except BaseException:
            self.sdc.release([r for reqs, _ in flight for r in reqs],
                             [b for _, keep in flight for b in keep])
            raise

    def discard(self, step: int) -> None:
        """Remove my uncommitted parity of ``step``: only a regular file in a private step
        directory (a linked step directory never makes ftkit unlink inside its target)."""
        path = self.parity_path(step)
        if not self.local.is_committed(step) and self.local.file_problem(path) is None:
            path.unlink(missing_ok=True)

    # ----------------------------------------------------------------- restore
    def held(self, step: int, world: int, *, data: bool = True) -> dict[str, Any] | None:
        """This member's parity file of ``step``: its header if intact, an error string if
        damaged (or not ours: a planted link is never followed), None if absent. Without
        ``data`` only the header is checked (a shard decoded from damaged parity fails its
        own verification after the rebuild). Local."""
        path = self.parity_path(step)
        try:
            if not os.path.lexists(path):
                return None
            with Shard.open(self._own_file(path, step, "parity"), rank=self.local.rank,
                            step=step, level=self.name) as shard:
                if data:
                    shard.verify(level=self.name)
                why = self._foreign(shard.header)
                if why:
                    raise CorruptCheckpointError(str(path), why, rank=self.local.rank,
                                                 step=step, level=self.name)
                return {k: shard.header[k] for k in ("seg", "sizes", "checksums")}
        except Exception as exc:  # noqa: BLE001 - any failure: the parity is unusable
            why = str(exc) if isinstance(exc, CorruptCheckpointError) else \
                f"{path} (level {self.name}, rank {self.local.rank}, step {step}): " \
                f"{type(exc).__name__}: {exc}"
            log.warning("%s parity unusable: %s", self.name, why)
            return {"error": why}

    def _own_file(self, path: Path, step: int, what: str) -> Path:
        """``path`` when it is a regular file in this node's private step directory; else
        CorruptCheckpointError naming the file, this rank, ``step`` and the level (a
        planted symbolic link is never used)."""
        problem = self.local.file_problem(path)
        if problem is not None:
            raise CorruptCheckpointError(
                str(path), f"{what} is missing" if problem == "missing" else
                f"{what} unusable: {problem}", rank=self.local.rank, step=step, level=self.name)
        return path

    def _foreign(self, h: dict[str, Any]) -> str | None:
        """Why a (validated) parity header does not belong to this member or cannot drive a
        rebuild (None when it fits): set, index, members, k, p, the parity tensors, ``seg``,
        ``sizes`` and ``checksums`` of every member."""
        if (h.get("set"), h.get("index"), h.get("members")) != (
                self.set_id, self.index, self.members):
            return "parity of another erasure set"
        lay, seg, sizes, sums = self.layout, h.get("seg"), h.get("sizes"), h.get("checksums")
        if (h.get("k"), h.get("p")) != (lay.k, lay.p):
            return f"parity of a k={h.get('k')} p={h.get('p')} code, expected k={lay.k} p={lay.p}"
        if type(seg) is not int or seg <= 0 or seg % ALIGN:
            return f"segment size {seg!r} is not a positive multiple of {ALIGN}"
        if [(t["kind"], t["dtype"], t["shape"]) for t in h["tensors"]] != \
                [("numpy", "|u1", [seg])] * lay.p:
            return f"the parity tensors are not {lay.p} segments of {seg} bytes"
        if not (isinstance(sizes, list) and len(sizes) == lay.k and all(
                type(n) is int and 0 <= n <= seg * lay.m for n in sizes)):
            return f"member sizes {str(sizes)[:80]} do not fit {lay.k} shards of segment {seg}"
        if not (isinstance(sums, list) and len(sums) == lay.k and all(
                isinstance(c, str) and c.startswith("xxh3-64:") for c in sums)):
            return f"member checksums {str(sums)[:80]} are not {lay.k} xxh3-64 checksums"
        return None

    def unusable(self, why: str) -> dict[str, Any]:
        return {"error": why}

    def reprotect(self, step: int, reports: Sequence[Report]) -> list[str]:
        """Re-encode only the sets in which a member's parity is missing or damaged (their
        members' shards are intact again); the parity of the other sets still matches.
        Every rank calls; the members of such a set encode together."""
        redo = [sid for sid, members in enumerate(self.cover.sets)
                if members and not all(parity_ok(reports[r], self.name) for r in members)]
        if self.set_id in redo:
            self.encode(step)
        return [f"{self.name}: parity of sets {redo} encoded again"] if redo else []

    def rebuild(self, step: int, part: Any, reports: Sequence[Report],
                have: Sequence[bool]) -> None:
        """Rebuild the lost members of this rank's set when ``part`` names it (``{set id:
        lost member indices}``). Every rank calls; the members of such a set decode together
        (:meth:`decode`)."""
        if self.set_id not in part:
            return
        oks = [parity_ok(reports[r], self.name) for r in self.members]
        header = next(reports[r][self.name] for r, ok in zip(self.members, oks) if ok)
        self.decode(step, part[self.set_id], [have[r] for r in self.members], oks, header)

    def stream(self, step: int, part: Any, reports: Sequence[Report]) -> ErasureStream | None:
        """This member's side of loading its set's lost members straight from the set
        (None when the set lost none)."""
        if self.set_id not in part:
            return None
        lost = part[self.set_id]
        oks = [parity_ok(reports[r], self.name) for r in self.members]
        header = next(reports[r][self.name] for r, ok in zip(self.members, oks) if ok)
        return ErasureStream(self, step, lost, [i not in lost for i in range(len(self.members))],
                             oks, header)

    def decode(self, step: int, lost: list[int], data_ok: list[bool], parity_ok: list[bool],
               header: dict[str, Any]) -> None:
        """Rebuild the shards of set members ``lost`` (set indices) into their node-local
        slots, decoded piece by piece as the contributions stream in, each checked as it
        lands (:meth:`ErasureStream.rebuild`: bounded buffers). Every member of the set
        calls with the same arguments; a lost member raises CorruptCheckpointError when
        its decoded shard does not check."""
        ErasureStream(self, step, lost, data_ok, parity_ok, header).rebuild()

    def _my_segments(self, stack: contextlib.ExitStack, step: int, data_ok: bool,
                     parity_ok: bool, s: int) -> dict[tuple[str, int], np.ndarray]:
        """Views of my intact data and parity segments (maps live as long as ``stack``)."""
        out: dict[tuple[str, int], np.ndarray] = {}
        if data_ok:
            path = self._own_file(self.local.shard_path(step), step, "shard")
            data = stack.enter_context(mapped(path, rank=self.local.rank, step=step,
                                              level=self.name))
            for q, seg in enumerate(segments(data, self.layout.m, s)):
                out[("d", q)] = seg
        if parity_ok:
            path = self._own_file(self.parity_path(step), step, "parity")
            shard = stack.enter_context(Shard.open(path, rank=self.local.rank, step=step,
                                                   level=self.name))
            for j in range(self.layout.p):
                out[("p", j)] = shard.raw(j)
        return out

"""Reused shard files ("slots") of the node-local level: no new file, no freed pages per save.

A node-local save used to write each rank's shard into a new tmpfs file and, two steps
later, unlink it: every save paid the kernel's first touch of fresh pages (~0.5 GB/s here)
and the unlink. Now each rank keeps its shard versions in files of its own,
``<node>/slots/rank-<r>.<k>.slot``, allocated once (``posix_fallocate``), mapped once and
overwritten in place by later steps. The shard of step ``s`` is published as a *hard link*
``step-<s>/rank-<r>.ftk`` to its slot, so every reader, tool and redundancy level sees the
step directories exactly as before (``docs/formats.md``).

A slot is **free** when no step directory names it: its link count is 1 (only its name
under ``slots/``). Retention, discard and ``ftkit clean`` remove step directories as before;
that drops the link and frees the slot, without freeing its pages.

**Crash safety.** (1) Only a free slot is ever written: its inode is not the shard of any
step, so overwriting it cannot touch a committed (or any other) step; only this rank
creates links to its slots, and it checks the link count right before it writes. (2) The
step's name is created (a ``link`` under a temp name, renamed into place) only after every
byte and the header are in the slot and flushed (``msync`` + ``fsync``): a crash before it
leaves the step without this rank's shard (it never votes yes), a crash after it leaves a
complete, verifiable shard in a step without ``COMMITTED``. (3) The ``COMMITTED`` record stays the only commit point. (4) A slot
whose write was interrupted is free garbage: the next save overwrites it whole.

One pass: a slot is *reserved* for a shard first (:func:`ftkit.storage.shard.layout`
reserves the header's room: its checksums have a fixed width, so the header written
afterwards has exactly that length); each tensor is then copied into its place in the
mapped slot and hashed chunk by chunk as it lands (:func:`copy_hashed`) — by the capture
itself for CPU tensors (``capture/staging.py``), or at the write from a staging buffer —
and :meth:`Slots.finish` writes the header and publishes the slot. At most
:data:`MAX_SLOTS` slots per rank; when none is free (a PFS flush still reads an older step) a
new one is made, and with the maximum reached the shard is written as a plain new file.
Local.
"""
from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from ftkit import passes
from ftkit.capture.flatten import TensorLeaf
from ftkit.fs import rename_into_place
from ftkit.storage.private import ensure_private_dir
from ftkit.storage.shard import READ_CHUNK, XXH3, checksum, layout, preamble

log = logging.getLogger(__name__)
#: directory of the slots, under the node directory (not a step directory)
SLOTS = "slots"
#: slots one rank may hold (two versions, one more while a PFS flush reads an older one,
#: one spare); beyond it a shard is written as a plain new file
MAX_SLOTS = 4
#: the checksum a reserved header holds until the tensor landed (same length as any)
PLACEHOLDER = XXH3 + "0" * 16
#: ``rank-<r>.<k>.slot`` (rank r's own shards), ``rank-<r>.<what>-<i>.<k>.slot`` (files of
#: a redundancy level rank r holds: ``partner-<q>`` the copies of rank q's shard,
#: ``xor-<set>`` / ``rs-<set>`` its parity of an erasure set)
_OF = r"[a-z]+-\d+"
_SLOT_NAME = re.compile(rf"rank-(\d+)(?:\.{_OF})?\.\d+\.slot")


class NotLanding(Exception):
    """A tensor awaited in a reservation will not land: the snapshot was given up."""


@dataclass
class _Mapped:
    """An open, mapped slot (kept across saves)."""

    fd: int
    ino: int
    mm: mmap.mmap


@dataclass
class Reservation:
    """A free slot laid out for one shard (:meth:`Slots.reserve`)."""

    slot: Path
    mapped: _Mapped
    meta: dict[str, Any]
    tree: Any
    leaves: list[TensorLeaf]
    head_len: int
    offsets: list[int]
    sums: list[str | None]          # checksum of each tensor already copied in, else None
    _landed: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _dropped: bool = False

    def copy_in(self, index: int, src: np.ndarray) -> None:
        """Copy tensor ``index``'s bytes ``src`` into its place, hashing as they land."""
        self._land(index, copy_hashed(self.view(index), src))

    def hash_in_place(self, index: int) -> None:
        """Checksum tensor ``index``'s bytes already copied into its place (a ``hash``
        pass)."""
        self._land(index, checksum(self.view(index)))

    def _land(self, index: int, digest: str) -> None:
        with self._landed:
            self.sums[index] = digest
            self._landed.notify_all()

    def drop(self) -> None:
        """The snapshot will not be completed (a failed capture, an aborted step): every
        :meth:`wait_landed` raises :class:`NotLanding` now instead of waiting on."""
        with self._landed:
            self._dropped = True
            self._landed.notify_all()

    def wait_landed(self, index: int) -> str:
        """Block until tensor ``index`` is in its place and hashed; its checksum. Raises
        :class:`NotLanding` once the reservation was dropped (:meth:`drop`). Any thread."""
        with self._landed:
            while True:
                digest = self.sums[index]
                if digest is not None:
                    return digest
                if self._dropped:
                    raise NotLanding(f"{self.slot}: the snapshot of tensor "
                                     f"{self.leaves[index].path!r} was given up")
                self._landed.wait()

    def view(self, index: int) -> np.ndarray:
        """Writable uint8 view of tensor ``index``'s bytes in the slot."""
        n = self.leaves[index].nbytes
        if not n:
            return np.empty(0, dtype=np.uint8)
        return np.frombuffer(self.mapped.mm, dtype=np.uint8, count=n,
                             offset=self.offsets[index])


class Slots:
    """The slots of one rank in one node directory."""

    def __init__(self, node_root: Path, rank: int, *, of: str | None = None) -> None:
        """Rank ``rank``'s slots for its own shards, or for one kind of redundancy file it
        holds: ``of`` is ``partner-<q>`` (copies of rank q's shard) or ``<xor|rs>-<set>``
        (its parity of that erasure set)."""
        if of is not None and not re.fullmatch(_OF, of):
            raise ValueError(f"slots of {of!r}: expected <level>-<number>")
        self.dir = node_root / SLOTS
        self.rank = rank
        self._stem = f"rank-{rank}" if of is None else f"rank-{rank}.{of}"
        self._open: dict[Path, _Mapped] = {}

    def path(self, k: int) -> Path:
        return self.dir / f"{self._stem}.{k}.slot"

    def write(self, target: Path, meta: dict[str, Any], tree: Any,
              leaves: list[TensorLeaf], buffers: list[np.ndarray]) -> bool:
        """Write the shard into a free slot and publish it as ``target`` (atomically
        replacing what ``target`` named). False, having written nothing, when no slot may
        be used (the caller writes a plain file). OSError on a failed write; ``target`` is
        then untouched."""
        res = self.reserve(meta, tree, leaves)
        if res is None:
            return False
        self.finish(res, target, buffers)
        return True

    def reserve(self, meta: dict[str, Any], tree: Any, leaves: list[TensorLeaf]
                ) -> Reservation | None:
        """A free slot laid out for this shard (header room, offsets), mapped; tensors may
        be copied into :meth:`Reservation.view` (with :func:`copy_hashed`, their checksum
        stored in ``sums``) before :meth:`finish`. None when no slot may be used. The slot
        stays free (named by no step) until :meth:`finish` publishes it; only one
        reservation of a rank is in use at a time."""
        head, offsets = layout(meta, tree, leaves, [PLACEHOLDER] * len(leaves))
        size = offsets[-1] + leaves[-1].nbytes if leaves else len(preamble(head))
        slot = self._free(size)
        if slot is None:
            return None
        return Reservation(slot, self._map(slot, size), meta, tree, leaves, len(head),
                           offsets, [None] * len(leaves))

    def claim(self, size: int) -> tuple[Path, np.ndarray] | None:
        """A free slot of ``size`` bytes, mapped: its path and a writable uint8 view of it
        (for a file received whole, e.g. a partner copy), to :meth:`publish` once complete.
        None when no slot may be used. OSError when it cannot be allocated."""
        slot = self._free(size)
        if slot is None:
            return None
        mapped = self._map(slot, size)
        view = np.frombuffer(mapped.mm, dtype=np.uint8) if size else \
            np.empty(0, dtype=np.uint8)
        return slot, view

    def publish(self, slot: Path, target: Path) -> None:
        """Flush the claimed ``slot`` and make ``target`` name it (atomically replacing what
        it named). OSError, ``target`` untouched, when the slot is no longer free."""
        mapped = self._open.get(slot)
        if mapped is None or not self._still_free(slot, mapped):
            raise OSError(f"{slot}: the claimed slot was linked or replaced meanwhile; "
                          f"not published")
        mapped.mm.flush()
        os.fsync(mapped.fd)
        _publish(slot, target)

    def view_of(self, path: Path) -> np.ndarray | None:
        """A read-only uint8 view of the file ``path`` names when it is one of the slots this
        object has mapped (a shard this rank wrote: no new mapping, no page faults), else
        None."""
        try:
            st = os.lstat(path)
        except OSError:
            return None
        for mapped in self._open.values():
            if mapped.ino == st.st_ino and len(mapped.mm) == st.st_size and st.st_size:
                view = np.frombuffer(mapped.mm, dtype=np.uint8)
                view.flags.writeable = False
                return view
        return None

    def finish(self, res: Reservation, target: Path, buffers: list[np.ndarray]) -> None:
        """Copy (and hash) every tensor not yet in the slot from ``buffers`` (hash in place
        those whose buffer is their place in the slot), write the header, flush, and publish
        the slot as ``target``. OSError: ``target`` untouched."""
        if not self._still_free(res.slot, res.mapped):
            raise OSError(f"{res.slot}: the reserved slot was linked meanwhile; not written")
        for i, buf in enumerate(buffers):
            if res.sums[i] is None and np.may_share_memory(buf, res.view(i)):
                res.hash_in_place(i)          # copied in already (async capture), unhashed
            elif res.sums[i] is None:
                res.copy_in(i, buf)
        sums = [str(x) for x in res.sums]
        final, again = layout(res.meta, res.tree, res.leaves, sums)
        if len(final) != res.head_len or again != res.offsets:
            raise AssertionError("shard header changed length with its checksums")
        mm, start = res.mapped.mm, preamble(final)
        mm[:len(start)] = start
        _zero_gaps(mm, len(start), res.offsets, [lf.nbytes for lf in res.leaves], len(mm))
        self.publish(res.slot, target)

    @staticmethod
    def _still_free(slot: Path, mapped: _Mapped) -> bool:
        try:
            st = os.lstat(slot)
        except FileNotFoundError:
            return False
        return st.st_ino == mapped.ino and st.st_nlink == 1

    def prune(self, ranks: set[int]) -> None:
        """Remove the free slots of every rank not in ``ranks`` (the ranks now on this
        node; a relaunch on another layout leaves the old ones behind). A slot a step still
        names stays until retention drops that step. Node leader; local."""
        try:
            entries = list(os.scandir(self.dir))
        except FileNotFoundError:
            return
        for entry in entries:
            match = _SLOT_NAME.fullmatch(entry.name)
            if match is None or int(match.group(1)) in ranks:
                continue
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                os.unlink(entry.path)

    def _free(self, size: int) -> Path | None:
        """A free slot (link count 1), best one of ``size`` bytes, else a new one; None
        when MAX_SLOTS exist and none is free."""
        ensure_private_dir(self.dir)
        free, taken = [], set()
        for k in range(MAX_SLOTS):
            try:
                st = os.lstat(self.path(k))
            except FileNotFoundError:
                continue
            taken.add(k)
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.geteuid():
                free.append((st.st_size != size, k))
        if free:
            return self.path(min(free)[1])
        new = next((k for k in range(MAX_SLOTS) if k not in taken), None)
        if new is None:
            log.debug("rank %d: all %d slots in use; writing a plain file", self.rank,
                      MAX_SLOTS)
        return None if new is None else self.path(new)

    def _map(self, slot: Path, size: int) -> _Mapped:
        """The slot mapped writable at ``size`` bytes (created and allocated if new,
        resized if its size differs); cached while the file stays the same inode *and*
        size (a slot truncated behind our back, e.g. a damaged shard it was published as, is
        mapped anew at its full size: writing through the old mapping would fault)."""
        m = self._open.get(slot)
        try:
            st = os.lstat(slot)
        except FileNotFoundError:
            st = None
        if m is not None and st is not None and st.st_ino == m.ino \
                and st.st_size < len(m.mm):
            log.warning("%s: the slot is %d bytes, its mapping %d: the file was truncated "
                        "(damaged) since it was written; it is mapped anew", slot,
                        st.st_size, len(m.mm))
        if m is not None and (st is None or st.st_ino != m.ino or len(m.mm) != size
                              or st.st_size != size):
            self._drop(slot)      # a mapping past the file's end would fault (SIGBUS)
            m = None
        if m is None:
            fd = os.open(slot, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                if os.fstat(fd).st_size != size:
                    os.ftruncate(fd, size)
                    os.posix_fallocate(fd, 0, size)       # pages now, not at first touch
                m = _Mapped(fd, os.fstat(fd).st_ino, mmap.mmap(fd, size))
            except BaseException:
                os.close(fd)
                if st is None:                # made here: a full disk keeps no stub
                    slot.unlink(missing_ok=True)
                raise
            self._open[slot] = m
        return m

    def _drop(self, slot: Path) -> None:
        m = self._open.pop(slot, None)
        if m is not None:
            try:
                m.mm.close()
            except BufferError:
                pass        # views of an old snapshot still alive: unmapped when collected
            os.close(m.fd)

    def close(self) -> None:
        """Unmap and close every slot (the files stay)."""
        for slot in list(self._open):
            self._drop(slot)


def _publish(slot: Path, target: Path) -> None:
    """Make ``target`` name the slot's inode atomically: a new hard link under a fresh
    temp name in ``target``'s directory, renamed over ``target`` (what it named before
    stays until then, and nothing is ever written through a link planted there)."""
    for _ in range(100):
        tmp = target.parent / f".{target.name}.{secrets.token_hex(6)}.tmp"
        try:
            os.link(slot, tmp)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"no free temp name for {target}")
    rename_into_place(tmp, target)


def copy_hashed(dst: np.ndarray, src: np.ndarray) -> str:
    """Copy ``src``'s bytes into the uint8 array ``dst`` (same length), hashing each chunk
    as it lands (still in cache); its checksum string. One ``write`` pass."""
    src = src.reshape(-1).view(np.uint8)
    h = xxhash.xxh3_64()
    for a in range(0, len(src), READ_CHUNK):
        part = dst[a:a + READ_CHUNK]
        np.copyto(part, src[a:a + READ_CHUNK])
        h.update(part.data)
    passes.count("write", len(src))
    return XXH3 + h.hexdigest()


def _zero_gaps(mm: mmap.mmap, start: int, offsets: list[int], sizes: list[int],
               size: int) -> None:
    """Zero the padding between the header and the tensors (a reused slot holds old bytes
    there), so a shard's bytes depend only on its content."""
    pos = start
    for off, n in zip(offsets, sizes):
        if off > pos:
            mm[pos:off] = bytes(off - pos)
        pos = off + n
    if size > pos:
        mm[pos:size] = bytes(size - pos)

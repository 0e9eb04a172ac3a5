"""Redundancy levels (partner copies, XOR/RS parity) and bulk transfers against a hostile
node-local tree: planted symbolic links are never written through, read or unlinked through.

``/dev/shm`` is world-writable (see ``test_local_hostile``). What the levels themselves must
do: a received copy goes to a fresh private temp file (never ``.<name>.tmp`` opened with
``O_TRUNC``, which writes through a planted link); a file is mapped or opened for reading
only when it is a regular file (``O_NOFOLLOW``, ``S_ISREG``); a linked step directory never
makes ftkit unlink inside the link's target; a planted link counts as a lost shard, copy or
parity, never as an intact one.
"""
from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from ftkit.capture.flatten import TensorLeaf
from ftkit.comm.dist import DistComm
from ftkit.errors import CorruptCheckpointError
from ftkit.faults import Faults
from ftkit.storage.local import LocalLevel
from ftkit.storage.redundancy import transfer
from ftkit.storage.redundancy.erasure import ErasureLevel
from ftkit.storage.redundancy.partner import PartnerLevel
from ftkit.storage.redundancy.transfer import Verify, exchange, mapped
from ftkit.storage.shard import Shard, checksum, write_shard
from tests.unit.test_transfer import STEP, make_shard

BAIT = b"attacker's file, never to be changed"


@pytest.fixture
def dc() -> Iterator[DistComm]:
    comm = DistComm(MPI.COMM_SELF, timeout=20.0)
    yield comm
    assert comm.reap() == 0
    comm.free()


@pytest.fixture
def bait(tmp_path: Path) -> Path:
    """A file outside the tree that a planted link points to."""
    path = tmp_path / "elsewhere" / "bait"
    path.parent.mkdir()
    path.write_bytes(BAIT)
    return path


def _temps(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def _local(tmp_path: Path) -> LocalLevel:
    level = LocalLevel(tmp_path / "base" / "job" / "node-0", rank=0, node_leader=True,
                       faults=Faults("", rank=0, node=0, attempt=0))
    level.prepare()
    return level


def _linked_step(level: LocalLevel, step: int, target: Path) -> None:
    """The step directory replaced by a link to ``target`` (planted while the tree was open)."""
    level.step_dir(step).symlink_to(target, target_is_directory=True)


# ------------------------------------------------------------------ transfers
def test_received_copy_never_written_through_a_planted_temp_link(dc: DistComm, tmp_path: Path,
                                                                 bait: Path) -> None:
    """Before: the receiver opened ``.copy.ftk.tmp`` with O_TRUNC and wrote the copy into
    the bait."""
    data = make_shard(tmp_path / "rank-0.ftk")
    planted = tmp_path / ".copy.ftk.tmp"
    planted.symlink_to(bait)
    exchange(dc, [(tmp_path / "rank-0.ftk", 0)], [(tmp_path / "copy.ftk", 0)], "encode", STEP,
             verify=Verify("partner", STEP, 1))
    assert bait.read_bytes() == BAIT
    st = os.lstat(tmp_path / "copy.ftk")
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert (tmp_path / "copy.ftk").read_bytes() == data
    assert _temps(tmp_path) == [planted.name] and planted.is_symlink()


def test_refused_copy_leaves_no_temp_file_and_the_bait_untouched(dc: DistComm, tmp_path: Path,
                                                                  bait: Path) -> None:
    """A copy corrupted in transfer is refused: its own temp file is removed, a planted
    ``.copy.ftk.tmp`` link is neither written through nor followed. Before: the bait was
    truncated and the chunks before the mismatch written into it."""
    make_shard(tmp_path / "rank-0.ftk")
    (tmp_path / ".copy.ftk.tmp").symlink_to(bait)
    faults = Faults(f"corrupt:rank=0:step={STEP}:level=partner", rank=0, node=0, attempt=0)
    verify = Verify("partner", STEP, 1,
                    tamper=lambda b: faults.corrupt_buffer(b, level="partner", step=STEP))
    with pytest.raises(CorruptCheckpointError, match="copy.ftk"):
        exchange(dc, [(tmp_path / "rank-0.ftk", 0)], [(tmp_path / "copy.ftk", 0)], "encode",
                 STEP, verify=verify)
    assert bait.read_bytes() == BAIT
    assert not os.path.lexists(tmp_path / "copy.ftk")
    assert _temps(tmp_path) == [".copy.ftk.tmp"]


def test_receiver_that_cannot_start_leaves_no_temp_file(dc: DistComm, tmp_path: Path,
                                                        bait: Path,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """A receive that fails right after its temp file was created (the first chunk cannot be
    posted) removes that temp file, and never the planted link. Before: the bait was
    truncated through ``.copy.ftk.tmp``. (A small shard: its sends complete eagerly.)"""
    make_shard(tmp_path / "rank-0.ftk", sizes=(3,))
    (tmp_path / ".copy.ftk.tmp").symlink_to(bait)

    def boom(self: transfer.FileRecv) -> None:
        raise MemoryError("no buffer")
    monkeypatch.setattr(transfer.FileRecv, "_post", boom)
    with pytest.raises(MemoryError):
        exchange(dc, [(tmp_path / "rank-0.ftk", 0)], [(tmp_path / "copy.ftk", 0)], "encode",
                 STEP)
    assert bait.read_bytes() == BAIT
    assert _temps(tmp_path) == [".copy.ftk.tmp"] and not os.path.lexists(tmp_path / "copy.ftk")


def test_mapped_refuses_a_symbolic_link(tmp_path: Path) -> None:
    """Before: the link was followed and its target sent or encoded."""
    make_shard(tmp_path / "real.ftk")
    link = tmp_path / "rank-0.ftk"
    link.symlink_to(tmp_path / "real.ftk")
    with pytest.raises(CorruptCheckpointError, match="symbolic link") as info, \
            mapped(link, rank=0, step=STEP, level="xor"):
        pass
    assert str(link) in str(info.value) and info.value.rank == 0 and info.value.step == STEP


def test_mapped_refuses_what_is_not_a_regular_file(tmp_path: Path) -> None:
    """A FIFO is refused without blocking, a directory without IsADirectoryError."""
    fifo, directory = tmp_path / "fifo.ftk", tmp_path / "dir.ftk"
    os.mkfifo(fifo)
    directory.mkdir()
    for path in (fifo, directory):
        with pytest.raises(CorruptCheckpointError, match="not a regular file") as info, \
                mapped(path):
            pass
        assert str(path) in str(info.value)


def test_sending_a_linked_file_is_refused(dc: DistComm, tmp_path: Path) -> None:
    make_shard(tmp_path / "real.ftk")
    (tmp_path / "rank-0.ftk").symlink_to(tmp_path / "real.ftk")
    dc.timeout = 0.5
    with pytest.raises(CorruptCheckpointError, match="symbolic link"):
        exchange(dc, [(tmp_path / "rank-0.ftk", 0)], [], "encode", STEP)


# ------------------------------------------------------------------ Shard.open
def test_shard_open_refuses_a_symbolic_link(tmp_path: Path) -> None:
    """Before: Shard.open followed the link and validated its target."""
    make_shard(tmp_path / "real.ftk", rank=3)
    link = tmp_path / "rank-3.ftk"
    link.symlink_to(tmp_path / "real.ftk")
    with pytest.raises(CorruptCheckpointError, match="symbolic link") as info:
        Shard.open(link, rank=3, step=STEP, level="partner")
    err = info.value
    assert (err.path, err.rank, err.step, err.level) == (str(link), 3, STEP, "partner")
    with pytest.raises(CorruptCheckpointError, match="symbolic link"):
        Shard.check(link, rank=3, step=STEP, world=1)
    fifo = tmp_path / "fifo.ftk"                 # still refused, without blocking
    os.mkfifo(fifo)
    with pytest.raises(CorruptCheckpointError, match="not a regular file") as info:
        Shard.open(fifo, rank=0, step=STEP)
    assert info.value.rank == 0 and info.value.step == STEP


# ------------------------------------------------------------------ partner
def _partner(level: LocalLevel, dc: DistComm) -> PartnerLevel:
    """Rank 0 holding rank 1's copy (partners: 0 -> 1, 1 -> 0)."""
    return PartnerLevel(level, dc, [1, 0], Faults("", rank=0, node=0, attempt=0))


def test_partner_discard_never_unlinks_through_a_linked_step_dir(dc: DistComm,
                                                                 tmp_path: Path) -> None:
    """Before: ``step-2/partner-1.ftk`` was unlinked inside the link's target."""
    level = _local(tmp_path)
    target = tmp_path / "attacker"
    target.mkdir()
    (target / "partner-1.ftk").write_bytes(BAIT)
    _linked_step(level, 2, target)
    partner = _partner(level, dc)
    level.ensure_step_dir(3)                     # a real uncommitted copy is still removed
    make_shard(partner.copy_path(3, 1), rank=1, step=3)
    for step in (2, 3):
        partner.discard(step)
    assert (target / "partner-1.ftk").read_bytes() == BAIT
    assert not os.path.lexists(partner.copy_path(3, 1))


@pytest.mark.parametrize("linked", ["copy", "step"])
def test_partner_copy_behind_a_link_is_unusable(dc: DistComm, tmp_path: Path,
                                                linked: str) -> None:
    """A valid copy reached through a planted link (the file or its step directory) is
    reported unusable, naming the link. Before: it was read through the link and reported
    intact."""
    level = _local(tmp_path)
    partner = _partner(level, dc)
    target = tmp_path / "attacker"
    target.mkdir()
    make_shard(target / "partner-1.ftk", rank=1, step=2)
    if linked == "copy":
        level.ensure_step_dir(2)
        partner.copy_path(2, 1).symlink_to(target / "partner-1.ftk")
    else:
        _linked_step(level, 2, target)
    held = partner.held(2, 1)
    assert list(held) == ["1"] and held["1"] is not None, held
    assert "symbolic link" in held["1"] and "step 2" in held["1"] and "rank 1" in held["1"], held


# ------------------------------------------------------------------ XOR / RS
def _xor(level: LocalLevel, dc: DistComm) -> ErasureLevel:
    """Member 0 of a two-member XOR set (only local methods are used)."""
    return ErasureLevel("xor", level, dc, 0, [0, 1], 1, Faults("", rank=0, node=0, attempt=0))


def _parity(path: Path, step: int) -> None:
    """A valid parity file of member 0 of ``_xor``'s set."""
    seg = 64
    meta = {"job": "unit", "step": step, "rank": 0, "world": -1, "level": "xor", "set": 0,
            "members": [0, 1], "index": 0, "k": 2, "p": 1, "seg": seg, "sizes": [10, 20],
            "checksums": [checksum(b"a"), checksum(b"b")]}
    write_shard(path, meta, None, [TensorLeaf("parity/0", "numpy", "|u1", (seg,), seg)],
                [np.arange(seg, dtype=np.uint8)])


def test_parity_discard_never_unlinks_through_a_linked_step_dir(dc: DistComm,
                                                                tmp_path: Path) -> None:
    """Before: ``step-2/xor-0-0.ftk`` was unlinked inside the link's target."""
    level = _local(tmp_path)
    target = tmp_path / "attacker"
    target.mkdir()
    (target / "xor-0-0.ftk").write_bytes(BAIT)
    _linked_step(level, 2, target)
    xor = _xor(level, dc)
    level.ensure_step_dir(3)                     # a real uncommitted parity is still removed
    _parity(xor.parity_path(3), 3)
    for step in (2, 3):
        xor.discard(step)
    assert (target / "xor-0-0.ftk").read_bytes() == BAIT
    assert not os.path.lexists(xor.parity_path(3))


@pytest.mark.parametrize("linked", ["parity", "step"])
def test_parity_behind_a_link_is_unusable(dc: DistComm, tmp_path: Path, linked: str) -> None:
    """A valid parity file reached through a planted link is an error, not a header to
    rebuild from. Before: it was read through the link and used."""
    level = _local(tmp_path)
    xor = _xor(level, dc)
    level.ensure_step_dir(1)
    _parity(xor.parity_path(1), 1)
    assert xor.held(1, 2) == {"seg": 64, "sizes": [10, 20],
                           "checksums": [checksum(b"a"), checksum(b"b")]}
    target = tmp_path / "attacker"
    target.mkdir()
    _parity(target / "xor-0-0.ftk", 2)
    if linked == "parity":
        level.ensure_step_dir(2)
        xor.parity_path(2).symlink_to(target / "xor-0-0.ftk")
    else:
        _linked_step(level, 2, target)
    held = xor.held(2, 2)
    assert held is not None and "symbolic link" in held.get("error", ""), held
    assert "step 2" in held["error"] and "level xor" in held["error"], held


def test_linked_own_shard_is_never_read_for_a_rebuild(dc: DistComm, tmp_path: Path) -> None:
    """The member's own shard, reached through a planted link, is not mapped to contribute
    its segments. Before: it was read through the link."""
    level = _local(tmp_path)
    xor = _xor(level, dc)
    level.ensure_step_dir(3)
    make_shard(tmp_path / "real.ftk", step=3)
    level.shard_path(3).symlink_to(tmp_path / "real.ftk")
    with contextlib.ExitStack() as stack, \
            pytest.raises(CorruptCheckpointError, match="symbolic link") as info:
        xor._my_segments(stack, 3, True, False, 64)
    err = info.value
    assert (err.path, err.rank, err.step, err.level) == (str(level.shard_path(3)), 0, 3, "xor")

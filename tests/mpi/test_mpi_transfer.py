"""Bulk transfers on 4 ranks: shards verified while they stream in (partner copies, XOR/RS
parity), and no request of a failed exchange left behind to swallow or feed a later one.

Every test makes all ranks reach the same collectives; a rank that is meant to "skip" an
exchange still takes part in the checks that follow it.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ftkit.capture.flatten import TensorLeaf
from ftkit.comm.dist import DistComm
from ftkit.errors import ProtocolTimeout
from ftkit.faults import Faults
from ftkit.storage.local import LocalLevel
from ftkit.storage.redundancy import transfer
from ftkit.storage.redundancy.erasure import ErasureLevel
from ftkit.storage.redundancy.transfer import Verify, exchange
from ftkit.storage.shard import Shard, write_shard
from ftkit.storage.slots import Slots

from .conftest import FtkitEnv
from .mpi_helpers import RANK, SIZE, WORLD, allgather, catch

SHORT, LONG = 1.0, 60.0


@pytest.fixture
def dc() -> Iterator[DistComm]:
    comm = DistComm(WORLD, timeout=LONG)
    yield comm
    comm.free()


@pytest.fixture
def where(ftkit_env: FtkitEnv) -> Path:
    """A directory of this rank's own."""
    path = ftkit_env.root / f"rank-{RANK}"
    path.mkdir()
    return path


def shard(path: Path, *, rank: int, step: int, version: int, nbytes: int = 300_000) -> bytes:
    """A real shard whose bytes depend on rank, step and version (same size for all)."""
    rng = np.random.default_rng([rank, step, version])
    sizes = (nbytes, 17, 0)
    bufs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    leaves = [TensorLeaf(f"t/{i}", "numpy", "|u1", (n,), n) for i, n in enumerate(sizes)]
    write_shard(path, {"job": "mpi", "step": step, "rank": rank, "world": SIZE}, None,
                leaves, bufs)
    return path.read_bytes()


def _copy_ok(path: Path, want: bytes) -> bool:
    return path.is_file() and path.read_bytes() == want


# ---------------------------------------------- point 2: no leaked requests on error
@pytest.mark.parametrize("nbytes", [100, 3_000_000])     # eager and rendezvous sends
def test_stale_send_of_a_failed_exchange_is_not_delivered_later(dc, where, nbytes):
    """Rank 1 sends to rank 0, which never joins (it failed before the call). Restore then
    retries an older step on the same DistComm: rank 0 must get the new file, not the
    stale one (before: the old file's size and bytes were delivered, or it timed out)."""
    old = shard(where / "old.ftk", rank=RANK, step=9, version=1, nbytes=nbytes)
    new = shard(where / "new.ftk", rank=RANK, step=8, version=2, nbytes=nbytes)
    assert old != new
    dc.timeout = SHORT
    if RANK == 1:
        catch(exchange, dc, [(where / "old.ftk", 0)], [], "restore-rebuild", 9)
    WORLD.Barrier()
    dc.timeout = LONG
    sends = [(where / "new.ftk", 0)] if RANK == 1 else []
    recvs = [(where / "copy.ftk", 1)] if RANK == 0 else []
    err = catch(exchange, dc, sends, recvs, "restore-rebuild", 8, verify=Verify("partner", 8))
    want = allgather(new)[1]
    got = allgather((repr(err), _copy_ok(where / "copy.ftk", want) if RANK == 0 else True))
    assert got == [("None", True)] * SIZE, got


def test_receive_of_a_failed_exchange_is_cancelled(dc, where):
    """Rank 0 waits for rank 1, which never sends: rank 0's exchange times out. Its posted
    receive must not survive (before: it swallowed the next size message, and the next
    exchange timed out)."""
    new = shard(where / "new.ftk", rank=RANK, step=6, version=2)
    dc.timeout = SHORT
    err = catch(exchange, dc, [], [(where / "lost.ftk", 1)], "restore-rebuild", 7) \
        if RANK == 0 else None
    assert RANK != 0 or isinstance(err, ProtocolTimeout), err
    WORLD.Barrier()
    dc.timeout = LONG
    sends = [(where / "new.ftk", 0)] if RANK == 1 else []
    recvs = [(where / "copy.ftk", 1)] if RANK == 0 else []
    err = catch(exchange, dc, sends, recvs, "restore-rebuild", 6)
    want = allgather(new)[1]
    got = allgather((repr(err), _copy_ok(where / "copy.ftk", want) if RANK == 0 else True,
                     sorted(p.name for p in where.iterdir())))
    assert [g[:2] for g in got] == [("None", True)] * SIZE, got
    assert not [n for n in got[0][2] if n == "lost.ftk" or n.startswith(".lost.ftk.")], got


def test_retry_of_the_same_step_after_a_receiver_error(dc, where):
    """Every rank sends to its successor; rank 0 cannot create its copy (missing directory)
    so rank 3's chunks stay pending and rank 3 times out. The same exchange is retried on
    the same DistComm: everybody gets the new bytes (before: rank 0 got the stale chunks)."""
    old = shard(where / "old.ftk", rank=RANK, step=4, version=1)
    nxt, prv = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    dest = where / ("missing" if RANK == 0 else ".") / "copy.ftk"
    dc.timeout = SHORT
    first = catch(exchange, dc, [(where / "old.ftk", nxt)], [(dest, prv)], "encode", 4)
    failed = allgather(type(first).__name__ if first else None)
    assert failed[0] == "FileNotFoundError" and failed[3] == "ProtocolTimeout", failed
    new = shard(where / "new.ftk", rank=RANK, step=4, version=2)
    dc.timeout = LONG
    err = catch(exchange, dc, [(where / "new.ftk", nxt)], [(where / "copy.ftk", prv)],
                "encode", 4, verify=Verify("partner", 4, SIZE))
    want = allgather(new)[prv]
    got = allgather((repr(err), _copy_ok(where / "copy.ftk", want)))
    assert got == [("None", True)] * SIZE, got
    assert old != new


# ------------------------------------------ point 1: verified while streaming in
def test_partner_copy_corrupted_in_transfer_is_refused(dc, where):
    """A byte of what rank 2 receives is flipped: rank 2's exchange raises naming the
    file, the source rank, the step and the level, and keeps no copy; every other rank
    (rank 1, the sender, included) completes without waiting for a deadline."""
    step = 3
    mine = shard(where / "rank.ftk", rank=RANK, step=step, version=0)
    faults = Faults(f"corrupt:rank=2:step={step}:level=partner", rank=RANK, node=RANK,
                    attempt=0)
    nxt, prv = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    verify = Verify("partner", step, SIZE,
                    tamper=lambda b: faults.corrupt_buffer(b, level="partner", step=step))
    t0 = time.monotonic()
    err = catch(exchange, dc, [(where / "rank.ftk", nxt)], [(where / "copy.ftk", prv)],
                "encode", step, verify=verify)
    seconds = time.monotonic() - t0
    want = allgather(mine)[prv]
    got = allgather((type(err).__name__ if err else None, str(err) if err else "",
                     _copy_ok(where / "copy.ftk", want), sorted(p.name for p in where.iterdir())))
    assert [g[0] for g in got] == [None, None, "CorruptCheckpointError", None], got
    msg = got[2][1]
    assert "copy.ftk" in msg and "from rank 1" in msg and "level partner" in msg, msg
    assert f"step {step}" in msg and "rank 1" in msg, msg
    assert [g[2] for g in got] == [True, True, False, True], got
    assert got[2][3] == ["rank.ftk"], got            # neither the copy nor its temp file
    assert max(allgather(seconds)) < LONG / 2


def test_copies_land_straight_in_slots_and_a_refused_one_leaves_the_slot_free(
        dc, where, monkeypatch):
    """With slots, each copy is received into a free slot of the receiver and published
    as a hard link (the same bytes, no second file); the sender's shard is sent from the
    view it already has. A copy corrupted in transfer (rank 2, step 3) is not published:
    its slot stays free and the next step's copy reuses it. Small chunks (every rank alike):
    a copy is many more chunks than the receive window holds."""
    monkeypatch.setattr(transfer, "CHUNK", 16 << 10)
    assert 300_000 > 2 * transfer.WINDOW * transfer.CHUNK
    slots = Slots(where, RANK, of=f"partner-{(RANK - 1) % SIZE}")
    nxt, prv = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    faults = Faults("corrupt:rank=2:step=3:level=partner", rank=RANK, node=RANK, attempt=0)
    outcomes = []
    for step in (3, 4):
        mine = shard(where / f"rank-{step}.ftk", rank=RANK, step=step, version=0)
        view = np.frombuffer(mine, dtype=np.uint8)
        verify = Verify("partner", step, SIZE,
                        tamper=lambda b, s=step: faults.corrupt_buffer(b, level="partner",
                                                                       step=s))
        err = catch(exchange, dc, [(where / f"rank-{step}.ftk", nxt)],
                    [(where / f"copy-{step}.ftk", prv)], "encode", step, verify=verify,
                    views={where / f"rank-{step}.ftk": view}, slots={prv: slots})
        copy = where / f"copy-{step}.ftk"
        ok = _copy_ok(copy, allgather(mine)[prv])
        outcomes.append((type(err).__name__ if err else None, ok,
                         copy.stat().st_nlink if copy.exists() else 0,
                         sorted(p.name for p in (where / "slots").iterdir())))
    slots.close()
    got = allgather(outcomes)
    stem = [f"rank-{r}.partner-{(r - 1) % SIZE}.0.slot" for r in range(SIZE)]
    for r, (third, fourth) in enumerate(got):
        assert third == ((None, True, 2, [stem[r]]) if r != 2 else
                         ("CorruptCheckpointError", False, 0, [stem[r]])), got
        # rank 2's refused copy left its slot free: step 4 reused it; the others needed a
        # second slot (the first still holds step 3's copy)
        assert fourth[:3] == (None, True, 2), got
        assert len(fourth[3]) == (1 if r == 2 else 2), got


# ------------------------------------------------------ parity checked end to end
@pytest.mark.parametrize(("level", "parity"), [("xor", 1), ("rs", 2)])
def test_parity_corrupted_in_transfer_is_refused(ftkit_env, level, parity):
    """The parity rank 2 receives at the end of the encoding ring is corrupted: rank 2's
    encode raises and writes no parity file; the other members write theirs, and those
    verify. Without the fault every member's parity is written."""
    step = 2
    local = LocalLevel(ftkit_env.node_dir(RANK), rank=RANK, node_leader=True,
                       faults=Faults("", rank=RANK, node=RANK, attempt=0))
    local.prepare()
    local.ensure_step_dir(step)
    shard(local.shard_path(step), rank=RANK, step=step, version=RANK, nbytes=50_000 + RANK)
    for spec, bad in ((f"corrupt:rank=2:step={step}:level={level}", [2]), ("", [])):
        faults = Faults(spec, rank=RANK, node=RANK, attempt=0)
        sdc = DistComm(WORLD, timeout=LONG)
        lv = ErasureLevel(level, local, sdc, 0, list(range(SIZE)), parity, faults)
        lv.parity_path(step).unlink(missing_ok=True)
        err = catch(lv.encode, step)
        sdc.free()
        got = allgather((None if err is None else str(err), lv.parity_path(step).is_file()))
        assert [r for r, g in enumerate(got) if g[0] is not None] == bad, got
        assert [g[1] for g in got] == [r not in bad for r in range(SIZE)], got
        for r in bad:
            assert f"{level}-0-{r}.ftk" in got[r][0] and "corrupted in transfer" in got[r][0]
            assert f"level {level}" in got[r][0] and f"step {step}" in got[r][0]
        if RANK not in bad:
            with Shard.open(lv.parity_path(step)) as held:
                held.verify(level=level)


def test_linked_member_shard_is_never_encoded(ftkit_env):
    """Rank 2's shard is replaced by a symbolic link to a valid copy of it elsewhere: the
    link is never read. Every member's encode raises promptly (no member waits for a
    collective the others left), rank 2's naming its shard and the link, the others naming
    rank 2; no member writes parity. Before: the link was followed and parity written."""
    step = 5
    local = LocalLevel(ftkit_env.node_dir(RANK), rank=RANK, node_leader=True,
                       faults=Faults("", rank=RANK, node=RANK, attempt=0))
    local.prepare()
    local.ensure_step_dir(step)
    path = local.shard_path(step)
    shard(path, rank=RANK, step=step, version=RANK, nbytes=40_000)
    if RANK == 2:
        elsewhere = ftkit_env.root / "elsewhere.ftk"
        path.rename(elsewhere)
        path.symlink_to(elsewhere)
    sdc = DistComm(WORLD, timeout=LONG)
    lv = ErasureLevel("xor", local, sdc, 0, list(range(SIZE)), 1,
                      Faults("", rank=RANK, node=RANK, attempt=0))
    t0 = time.monotonic()
    err = catch(lv.encode, step)
    seconds = time.monotonic() - t0
    sdc.free()
    got = allgather((type(err).__name__, str(err), os.path.lexists(lv.parity_path(step)),
                     seconds))
    assert [g[0] for g in got] == ["CorruptCheckpointError"] * SIZE, got
    assert [g[2] for g in got] == [False] * SIZE, got
    mine = got[2][1]
    assert f"step-{step}/rank-2.ftk" in mine and "symbolic link" in mine, mine
    assert "rank 2" in mine and f"step {step}" in mine and "level xor" in mine, mine
    for r in (0, 1, 3):
        assert "rank 2: " in got[r][1] and "symbolic link" in got[r][1], got[r]
        assert f"rank {r}" in got[r][1] and "no parity written" in got[r][1], got[r]
    assert max(g[3] for g in got) < LONG / 2, got

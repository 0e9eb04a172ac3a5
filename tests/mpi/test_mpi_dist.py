"""DistComm on 4 ranks: JSON collectives, failure agreement, and deadlines.

The timeout tests leave a collective pending on their (own, duplicated) communicator; the
skipping rank joins it late so nothing stays pending, and they come last in this file.
"""
from __future__ import annotations

import time

import pytest
from mpi4py import MPI

from ftkit.comm.dist import MIN_BULK_BANDWIDTH, DistComm
from ftkit.errors import CheckpointError, ProtocolTimeout

from .mpi_helpers import RANK, SIZE, WORLD, allgather, same_on_all_ranks


@pytest.fixture
def dc():
    comm = DistComm(WORLD, timeout=30.0)
    assert comm.comm != WORLD and comm.size == SIZE and comm.rank == RANK
    yield comm
    comm.free()


def payload(rank: int) -> dict:
    """JSON-able and different in size and content on every rank."""
    return {"rank": rank, "xs": list(range(rank * 1000)), "s": "é" * rank, "f": rank / 3,
            "nested": {"ok": rank % 2 == 0, "none": None}}


def test_allgather_json(dc):
    got = dc.allgather(payload(RANK), "test", 1)
    assert got == [payload(r) for r in range(SIZE)]


@pytest.mark.parametrize("root", [0, 3])
def test_gather_json(dc, root):
    got = dc.gather(payload(RANK), "test", 1, root=root)
    if RANK == root:
        assert got == [payload(r) for r in range(SIZE)]
    else:
        assert got is None
    allgather(None)


@pytest.mark.parametrize("root", [0, 2])
def test_bcast_json(dc, root):
    big = "x" * (1 << 20)
    obj = {"from": RANK, "big": big, "list": [1, 2.5, None, "é"]} if RANK == root else None
    got = dc.bcast(obj, "test", 1, root=root)
    assert got == {"from": root, "big": big, "list": [1, 2.5, None, "é"]}


def test_agree_returns_the_same_failures_everywhere(dc):
    assert dc.agree(None, "test", 1) == {}
    mine = f"disk full on rank {RANK}" if RANK in (1, 3) else None
    got = dc.agree(mine, "test", 2)
    assert got == {1: "disk full on rank 1", 3: "disk full on rank 3"}
    same_on_all_ranks(sorted(got.items()), "agreed failures")


def test_run_success_returns_local_result(dc):
    assert dc.run(lambda: RANK * 10, "test", 5) == RANK * 10


def test_run_failure_on_rank_2_raises_same_error_everywhere(dc):
    def work() -> int:
        if RANK == 2:
            raise ValueError("boom on rank 2")
        return RANK

    with pytest.raises(CheckpointError) as info:
        dc.run(work, "write-local", 7)
    exc = info.value
    assert type(exc) is CheckpointError
    assert exc.step == 7
    assert exc.failures == {2: "ValueError: boom on rank 2"}
    same_on_all_ranks((str(exc), sorted(exc.failures.items())), "CheckpointError")
    assert "write-local" in str(exc) and "rank 2" in str(exc)
    # the communicator is still in step afterwards
    assert dc.allgather(RANK, "after", 8) == list(range(SIZE))


def test_run_failures_on_several_ranks(dc):
    def work() -> None:
        if RANK != 0:
            raise OSError(f"no space (rank {RANK})")

    with pytest.raises(CheckpointError) as info:
        dc.run(work, "commit", 9)
    assert info.value.failures == {r: f"OSError: no space (rank {r})" for r in (1, 2, 3)}


def test_agree_allows_for_a_slow_writers_bytes():
    """Rank 3 is still writing its file (a 1.5 s sleep stands for the I/O) when the others
    reach the agreement: with ``allow_bytes`` their deadline is FTKIT_TIMEOUT (0.5 s here)
    plus those bytes at MIN_BULK_BANDWIDTH, so they wait for it instead of timing out."""
    dc = DistComm(WORLD, timeout=0.5)
    allow = int(MIN_BULK_BANDWIDTH * 5)                    # +5 s
    assert dc.bulk_deadline(allow) == pytest.approx(5.5)
    if RANK == 3:
        time.sleep(1.5)
    t0 = time.monotonic()
    got = dc.agree("full" if RANK == 3 else None, "flush", 9, allow_bytes=allow)
    waited = time.monotonic() - t0
    dc.free()
    assert got == {3: "full"}
    if RANK != 3:
        assert waited > 0.5, waited                        # past the control timeout
    same_on_all_ranks(got, "the agreed failures")


# ------------------------------------------------------------------- deadlines (last)
@pytest.mark.parametrize("collective", ["barrier", "allgather"])
def test_missing_rank_times_out(collective):
    """Rank 3 never enters the collective: ranks 0-2 get ProtocolTimeout after ~1 s."""
    dc = DistComm(WORLD, timeout=1.0)
    outcome = None
    if RANK != 3:
        t0 = time.monotonic()
        try:
            if collective == "barrier":
                dc.barrier("vote", 4)
            else:
                dc.allgather({"r": RANK}, "vote", 4)
            outcome = ("completed", 0.0, {}, -1)
        except ProtocolTimeout as exc:
            outcome = ("timeout", time.monotonic() - t0, exc.failures, exc.step)
            assert isinstance(exc, CheckpointError)
    WORLD.Barrier()
    # clean-up: rank 3 joins the pending operation late, so no request stays pending
    if RANK == 3:
        if collective == "barrier":
            req = dc.comm.Ibarrier()
        else:
            req = dc.comm.Iallgather([bytes(8), MPI.BYTE], [bytearray(8 * SIZE), MPI.BYTE])
        deadline = time.monotonic() + 30
        while not req.Test():
            assert time.monotonic() < deadline, "late join did not complete"
            time.sleep(0.001)
    WORLD.Barrier()
    dc.free()
    everyone = allgather(outcome)
    assert everyone[3] is None
    for r in range(3):
        kind, seconds, failures, step = everyone[r]
        assert kind == "timeout", everyone
        assert 0.95 <= seconds <= 6.0, f"rank {r} timed out after {seconds:.2f} s"
        assert step == 4
        assert list(failures) == [r]
        assert "'vote'" in failures[r] and "within 1 s" in failures[r]

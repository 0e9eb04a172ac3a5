"""``ftkit.flushes.Flushes`` with a fake PFS level: back-pressure (flush now, delay, skip),
flush failures that degrade instead of raising, a lost peer that aborts, and ``wait`` mode.
(The same policy on 4 real ranks: tests/mpi/test_mpi_backpressure.py.)"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ftkit.comm import flag
from ftkit.errors import ProtocolTimeout
from ftkit.flushes import Flushes


class _Early:
    """An early write: records whether it was given up."""

    def __init__(self, step: int) -> None:
        self.step, self.discarded = step, False

    def discard(self, wait: float = 0.0) -> None:
        self.discarded = True


class _Pfs:
    """Records the steps flushed; ``fail``: step -> exception raised instead; ``hold``: step
    -> event the flush waits for."""

    def __init__(self) -> None:
        self.flushed: list[int] = []
        self.fail: dict[int, Exception] = {}
        self.hold: dict[int, threading.Event] = {}
        self.pruned: list[int] = []
        self.adopted: list[Any] = []          # the early write each flush was given
        self.early: list[_Early] = []         # every early write started

    def write_early(self, step: int, res: Any, pool: Any, patience: float) -> _Early:
        self.early.append(_Early(step))
        return self.early[-1]

    def flush(self, step: int, early_write: Any = None) -> float:
        self.adopted.append(early_write)
        if step in self.hold:
            assert self.hold[step].wait(30), f"flush of step {step} never released"
        if step in self.fail:
            raise self.fail[step]
        self.flushed.append(step)
        return 0.01

    def step_dir(self, step: int) -> Path:
        return Path(f"/pfs/step-{step}")

    def settle(self) -> None:
        """Nothing is deleted in the background here."""


def _flushes(pfs: _Pfs, *, background: bool = False, wait_mode: bool = False
             ) -> tuple[Flushes, list[tuple[str, dict[str, Any]]], list[str]]:
    events: list[tuple[str, dict[str, Any]]] = []
    aborted: list[str] = []
    f = Flushes(pfs, rank=0, emit=lambda ev, **kw: events.append((ev, kw)),  # type: ignore[arg-type]
                abort=aborted.append, patience=lambda: 30.0, background=background,
                wait_mode=wait_mode)
    return f, events, aborted


def _wait(future: cf.Future[None], what: str) -> None:
    future.result(timeout=30)


def test_due_steps_are_flushed_delayed_skipped_then_flushed_at_finish() -> None:
    pfs = _Pfs()
    f, events, _ = _flushes(pfs)
    f.schedule(2, busy=False)                     # nothing running: flushed now
    f.schedule(3, busy=False)
    f.schedule(4, busy=True)                      # a flush runs somewhere: delayed, kept
    assert (pfs.flushed, f.delayed, f.kept) == ([2, 3], 4, {4})
    f.schedule(None, busy=True)                   # still running: still delayed
    f.schedule(6, busy=True)                      # a newer due step skips the delayed one
    assert (f.delayed, f.kept) == (6, {6})
    f.schedule(None, busy=False)                  # every flush done: the delayed one's turn
    assert (pfs.flushed, f.delayed, f.kept) == ([2, 3, 6], None, set())
    f.schedule(8, busy=True)
    f.finish(_wait)                               # wait()/close(): a delayed step is flushed
    assert (pfs.flushed, f.delayed, f.last_flushed) == ([2, 3, 6, 8], None, 8)
    assert [(ev, kw["step"]) for ev, kw in events] == [
        ("flush", 2), ("flush", 3), ("flush-delayed", 4), ("flush-skipped", 4),
        ("flush-delayed", 6), ("flush", 6), ("flush-delayed", 8), ("flush", 8)]
    assert [kw.get("superseded_by") for ev, kw in events if ev == "flush-skipped"] == [6]


def test_a_failed_flush_is_recorded_and_reported_never_raised(
        caplog: pytest.LogCaptureFixture) -> None:
    pfs = _Pfs()
    pfs.fail[4] = OSError(28, "No space left on device")
    f, events, aborted = _flushes(pfs)
    f.schedule(2, busy=False)
    f.schedule(4, busy=False)                     # fails: recorded, not raised
    assert f.failures == {4: "OSError: [Errno 28] No space left on device"}
    assert f.last_flushed == 2 and f.kept == set() and not aborted
    assert [ev for ev, _ in events] == ["flush", "flush-failed"]
    with caplog.at_level(logging.ERROR, logger="ftkit.checkpointer"):
        f.report_unflushed(last_committed=5)
    assert "committed step 5 is only on the node-local levels" in caplog.text
    assert "the newest step on the PFS is 2" in caplog.text


def test_a_lost_peer_during_a_flush_aborts() -> None:
    pfs = _Pfs()
    pfs.fail[2] = ProtocolTimeout(2, {1: "phase 'flush' did not complete"})
    f, _, aborted = _flushes(pfs)
    with pytest.raises(ProtocolTimeout):
        f.schedule(2, busy=False)
    assert len(aborted) == 1 and "flush" in aborted[0]


@pytest.fixture
def in_job() -> Iterator[None]:
    """This process runs under in-job recovery (a fresh flag, active)."""
    flag._FLAG.__init__()       # type: ignore[misc]
    flag.activate()
    yield
    flag._FLAG.__init__()       # type: ignore[misc]


def test_a_peer_lost_during_a_flush_in_job_is_no_pfs_failure(in_job: None) -> None:
    """In-job: the MPI error a peer's death causes in the flush's agreement is failure
    detection (the recovery takes over), not a PFS failure: no flush-failed, no abort."""
    from mpi4py import MPI
    pfs = _Pfs()
    pfs.fail[2] = MPI.Exception(MPI.ERR_IN_STATUS)
    pfs.fail[4] = flag.PeerLost("phase 'flush' of step 4: a peer rank failed")
    f, events, aborted = _flushes(pfs)
    threading.Timer(0.05, flag.trip, ("rank 3 died",)).start()   # the watcher confirms
    f.schedule(2, busy=False)
    f.schedule(4, busy=False)
    assert f.failures == {} and not aborted and events == [] and f.kept == set()


def test_an_mpi_error_in_job_without_a_failure_is_a_pfs_failure(
        in_job: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-job, an MPI error the watcher does not confirm as a failure is a failed flush."""
    from mpi4py import MPI
    monkeypatch.setattr(flag, "CONFIRM_S", 0.05)
    pfs = _Pfs()
    pfs.fail[2] = MPI.Exception(MPI.ERR_OTHER)
    f, events, _ = _flushes(pfs)
    f.schedule(2, busy=False)
    assert list(f.failures) == [2] and [ev for ev, _ in events] == ["flush-failed"]


def test_busy_while_a_background_flush_runs_unless_wait_mode() -> None:
    for wait_mode in (False, True):
        pfs = _Pfs()
        pfs.hold[1] = threading.Event()
        f, _, _ = _flushes(pfs, background=True, wait_mode=wait_mode)
        f.schedule(1, busy=False)
        try:
            assert f.busy() is (not wait_mode)    # wait mode: the vote never says busy
            assert f.kept == {1}                  # retention keeps the step being flushed
        finally:
            pfs.hold[1].set()
        f.finish(_wait)
        f.shutdown()
        assert pfs.flushed == [1] and not f.busy() and f.kept == set()


def test_wait_mode_starts_the_next_flush_after_the_previous_one() -> None:
    """``FTKIT_PFS_BACKPRESSURE=wait``: nothing is delayed or skipped; the caller (the
    checkpoint thread) waits for the previous flush before it starts the next."""
    pfs = _Pfs()
    pfs.hold[1] = threading.Event()
    f, events, _ = _flushes(pfs, background=True, wait_mode=True)
    f.schedule(1, busy=f.busy())
    started = threading.Thread(target=f.schedule, args=(2, f.busy()))
    started.start()
    started.join(0.2)
    assert started.is_alive()                     # waits for the flush of step 1
    pfs.hold[1].set()
    started.join(30)
    f.finish(_wait)
    f.shutdown()
    assert pfs.flushed == [1, 2] and [ev for ev, _ in events] == ["flush", "flush"]


def test_an_early_write_is_adopted_by_its_own_flush_only() -> None:
    """The flush that starts right after the commit takes the step's early write; a delayed
    flush does not (the early write is given up: the delayed flush writes from the shard),
    and no early write starts while a flush of this rank runs."""
    pfs = _Pfs()
    f, _, _ = _flushes(pfs, background=True)
    f.write_early(1, res=None)                    # type: ignore[arg-type]
    pfs.hold[1] = threading.Event()
    f.schedule(1, busy=False)
    f.discard_early()                             # what the end of the protocol does
    assert [e.step for e in pfs.early] == [1] and not pfs.early[0].discarded
    f.write_early(2, res=None)                    # type: ignore[arg-type]
    assert len(pfs.early) == 1                    # flush of step 1 still runs: none
    pfs.hold[1].set()
    f.finish(_wait)
    assert pfs.adopted == [pfs.early[0]]
    f.write_early(3, res=None)                    # type: ignore[arg-type]
    f.schedule(3, busy=True)                      # another rank's flush runs: delayed
    f.discard_early()
    assert pfs.early[1].step == 3 and pfs.early[1].discarded
    f.finish(_wait)                               # the delayed step, from its shard
    f.shutdown()
    assert pfs.flushed == [1, 3] and pfs.adopted == [pfs.early[0], None]


def test_an_early_write_that_cannot_start_is_no_error(caplog: pytest.LogCaptureFixture
                                                      ) -> None:
    """A failing start (the flush then writes the file itself) only warns; after
    ``shutdown`` (close, abandon) no early write starts."""
    pfs = _Pfs()
    f, _, _ = _flushes(pfs)

    def broken(*_: Any) -> None:
        raise RuntimeError("boom")
    pfs.write_early = broken                      # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="ftkit.checkpointer"):
        f.write_early(1, res=None)                # type: ignore[arg-type]
    assert "no early PFS write of step 1: RuntimeError: boom" in caplog.text
    f.schedule(1, busy=False)
    assert pfs.adopted == [None] and pfs.flushed == [1]
    pfs.write_early = _Pfs.write_early.__get__(pfs)     # type: ignore[method-assign]
    f.shutdown()
    f.write_early(2, res=None)                    # type: ignore[arg-type]
    assert pfs.early == []

"""A failing PFS flush degrades the job, it does not stop it (docs/protocol.md, "A failed
flush is a warning").

The flush of a step fails (an injected fault, or a damaged node-local shard that the flush
refuses to copy): every rank logs it once, rank 0 appends a ``flush-failed`` event, nothing
is raised into the training loop, later saves keep committing on the node-local levels and
the next step due at ``pfs`` is flushed as usual. ``close`` logs an ERROR when the newest
flush attempted failed; a stop request's final save still ends the ranks with status 0.

4 ranks / 2 virtual nodes (FTKIT_RANKS_PER_NODE=2).
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftkit import Checkpointer, Config
from ftkit.storage.pfs.level import PfsLevel

from .mpi_helpers import (
    RANK,
    WORLD,
    allgather,
    catch,
    error_summary,
    events,
    small_state,
    topology,
)

CKPT_LOGGER = "ftkit.checkpointer"


class Records(logging.Handler):
    """Keeps every record of one logger (the ``ftkit`` logger does not propagate)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def lines(self, needle: str) -> list[tuple[str, str]]:
        """(level, message) of every record whose message contains ``needle``."""
        return [(r.levelname, r.getMessage()) for r in self.records if needle in r.getMessage()]


@pytest.fixture
def ckpt_log() -> Iterator[Records]:
    handler = Records()
    logger = logging.getLogger(CKPT_LOGGER)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def tmp_files(root: Path) -> list[str]:
    """Temporary files left anywhere under ``root`` (rank 0's view, on every rank)."""
    found = sorted(str(p.relative_to(root)) for p in root.rglob("*.tmp")) if RANK == 0 else None
    return WORLD.bcast(found, root=0)


def committed_pfs_steps(pfs_job: Path) -> list[int]:
    steps = sorted(int(p.parent.name[5:]) for p in pfs_job.glob("step-*/COMMITTED")) \
        if RANK == 0 else None
    return WORLD.bcast(steps, root=0)


@pytest.mark.parametrize("async_,faults,cause", [
    (True, "raise:rank=1:step=2:phase=flush", "rank 1: InjectedFault"),
    # the flush refuses rank 1's damaged shard while node 0's HDF5 file is being written
    (False, "corrupt:rank=1:step=2:level=local", "node-local shard is corrupt"),
], ids=["async-raise", "sync-damaged-shard"])
def test_failed_flush_is_a_warning_and_the_next_pfs_step_is_flushed(
        ftkit_env, ckpt_log, monkeypatch, async_, faults, cause):
    """``local:1,pfs:2``, steps 1-6; the flush of step 2 fails. Steps 3-6 commit, no save and
    no close raises, every rank logs the failure once (rank 0 at WARNING), the failure is a
    ``flush-failed`` event, steps 4 and 6 are flushed and committed on the PFS, step 2 is
    not, and no temporary file is left on the PFS. The damaged shard is read by a flush
    that writes from the committed shard (no early write: a delayed flush's way); an early
    write copies the slot's bytes before the fault strikes, or refuses them
    (``test_pfs_early.py``)."""
    if "corrupt" in faults:
        monkeypatch.setattr(PfsLevel, "write_early", lambda *a, **kw: None)
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(async_=async_, levels="local:1,pfs:2",
                                              faults=faults, log_level="INFO"))
        errors = [(s, error_summary(catch(ckpt.save, s, small_state(RANK, s))))
                  for s in range(1, 7)]
        errors.append(("close", error_summary(catch(ckpt.close))))
        assert allgather(errors) == [[(s, None) for s in (*range(1, 7), "close")]] * 4
        seen = (ckpt.last_committed, sorted(ckpt.pfs_failures), ckpt.last_flushed)
        reasons = dict(ckpt.pfs_failures)
    assert allgather(seen) == [(6, [2], 6)] * 4
    assert allgather(reasons) == [reasons] * 4                  # the agreed reason
    assert "step 2" in reasons[2] and cause in reasons[2], reasons
    logged = ckpt_log.lines("PFS flush of step 2 failed")
    assert [level for level, _ in logged] == ["WARNING" if RANK == 0 else "INFO"], logged
    assert reasons[2] in logged[0][1], (logged, reasons)
    assert not ckpt_log.lines("only on the node-local levels"), ckpt_log.records
    got = events(ftkit_env.events_path)
    failed = [e for e in got if e["event"] == "flush-failed"]
    assert [(e["step"], e["level"], e["reason"]) for e in failed] == [(2, "pfs", reasons[2])]
    assert [e["step"] for e in got if e["event"] == "flush"] == [4, 6], got
    assert [e["step"] for e in got if e["event"] == "commit"] == [1, 2, 3, 4, 5, 6], got
    pfs_job = ftkit_env.pfs_dir / ftkit_env.job
    assert committed_pfs_steps(pfs_job) == [4, 6]
    assert tmp_files(ftkit_env.pfs_dir) == []


def test_close_reports_a_newest_step_that_never_reached_the_pfs(ftkit_env, ckpt_log):
    """The flush of the last step (4) fails: ``close`` does not raise, and rank 0 logs an
    ERROR naming step 4, its reason and the newest step on the PFS (2)."""
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(async_=True, levels="local:1,pfs:2",
                                              faults="raise:rank=3:step=4:phase=flush"))
        errors = [error_summary(catch(ckpt.save, s, small_state(RANK, s))) for s in (1, 2, 3, 4)]
        errors.append(error_summary(catch(ckpt.close)))
        assert allgather(errors) == [[None] * 5] * 4
        seen = (ckpt.last_committed, sorted(ckpt.pfs_failures), ckpt.last_flushed)
    assert allgather(seen) == [(4, [4], 2)] * 4
    errors_logged = [m for level, m in ckpt_log.lines("only on the node-local levels")
                     if level == "ERROR"]
    if RANK == 0:
        assert len(errors_logged) == 1, ckpt_log.records
        assert "step 4" in errors_logged[0] and "rank 3: InjectedFault" in errors_logged[0]
        assert "newest step on the PFS is 2" in errors_logged[0], errors_logged
    else:
        assert errors_logged == [], errors_logged


def test_final_save_with_a_failed_flush_exits_cleanly(ftkit_env, ckpt_log, monkeypatch):
    """A stop was requested (``$FTKIT_STOP_FILE`` exists when step 1 is decided): ``save(2)``
    takes the final checkpoint of step 2 on every level; its PFS flush fails on rank 2. Every
    rank still ends with ``SystemExit(0)`` (step 2 is committed node-locally, so a requeue on
    the same nodes resumes from it), rank 0 logs an ERROR saying so, and the ``stop`` event
    names step 2."""
    stop_file = ftkit_env.root / "stop-request"
    if RANK == 0:
        stop_file.write_text("stop\n")
    WORLD.Barrier()
    monkeypatch.setenv("FTKIT_STOP_FILE", str(stop_file))
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(async_=True, levels="local:1,pfs:4",
                                              faults="raise:rank=2:step=2:phase=flush"))
        outcome = [error_summary(catch(ckpt.save, 1, small_state(RANK, 1)))]
        try:
            ckpt.save(2, small_state(RANK, 2))
            outcome.append("returned")
        except SystemExit as exc:
            outcome.append(f"exit {exc.code}")
        except Exception as exc:  # noqa: BLE001 - compared on every rank below
            outcome.append(error_summary(exc))
        assert allgather(outcome) == [[None, "exit 0"]] * 4
        seen = (ckpt.last_committed, sorted(ckpt.pfs_failures), ckpt.last_flushed)
    assert allgather(seen) == [(2, [2], None)] * 4
    errors_logged = [m for level, m in ckpt_log.lines("only on the node-local levels")
                     if level == "ERROR"]
    assert len(errors_logged) == (1 if RANK == 0 else 0), ckpt_log.records
    got = events(ftkit_env.events_path)
    assert [e["step"] for e in got if e["event"] == "stop"] == [2], got
    assert [e["step"] for e in got if e["event"] == "flush-failed"] == [2], got

"""A failing PFS degrades a job, it does not stop it (docs/protocol.md, "A failed flush is a
warning"); a rank that hangs in a flush is still failure detection (abort, relaunch).

4 ranks / 2 virtual nodes, ``local:1,pfs:2``, 8 steps of the toy example.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.jobs import run_toy

LEVELS = "local:1,pfs:2"


@pytest.mark.timeout(240)
def test_failed_flushes_do_not_stop_the_job(
        tmp_path: Path, reference_digest: Callable[..., str]) -> None:
    """The flushes of steps 4 (fault on rank 1) and 8 (the last one, fault on rank 2) fail.
    The job still completes in its first attempt with exit 0 and the failure-free digest;
    both failures are ``flush-failed`` events; step 6 (the next step due at ``pfs``) is
    flushed and committed on the PFS, steps 4 and 8 are not and no temporary file is left;
    at close rank 0 logs an ERROR: committed step 8 is only on the node-local levels."""
    res = run_toy(tmp_path, steps=8, max_restarts=2, FTKIT_LEVELS=LEVELS,
                  FTKIT_FAULTS="raise:rank=1:step=4:phase=flush;raise:rank=2:step=8:phase=flush")
    assert res.rc == 0, res.tail()
    lines = res.attempt_lines()
    assert len(lines) == 1 and "succeeded" in lines[0], (lines, res.tail())
    assert not [ln for ln in res.stderr.splitlines() if ln.startswith("ftkit.errors.")]
    assert res.done["digest"] == reference_digest(4, 8), res.tail()
    events = res.events()
    failed = [(e["step"], e["level"]) for e in events if e["event"] == "flush-failed"]
    assert failed == [(4, "pfs"), (8, "pfs")], events
    assert [e["step"] for e in events if e["event"] == "flush"] == [2, 6], events
    assert res.committed(0) == list(range(1, 9)), events
    job = res.pfs / "e2e"
    assert sorted(p.parent.name for p in job.glob("step-*/COMMITTED")) == ["step-2", "step-6"]
    assert sorted(str(p) for p in job.rglob("*.tmp")) == [], sorted(job.rglob("*"))
    closing = [ln for ln in res.stderr.splitlines() if ln.startswith("ftkit[rank 0@")
               and " ERROR " in ln and "only on the node-local levels" in ln]
    assert len(closing) == 1, res.tail()
    assert "committed step 8" in closing[0] and "newest step on the PFS is 6" in closing[0]


@pytest.mark.timeout(240)
def test_hang_in_flush_is_still_detected(
        tmp_path: Path, reference_digest: Callable[..., str]) -> None:
    """Rank 1 hangs in the flush of step 4: that is a lost rank, not a failing PFS. Its peers
    time out in the flush's agreement, abort the world (``timeout`` event naming phase
    ``flush``), the job is relaunched from the node-local levels and ends bit-exact."""
    timeout = 6
    res = run_toy(tmp_path, steps=8, max_restarts=2, FTKIT_LEVELS=LEVELS,
                  FTKIT_TIMEOUT=str(timeout), FTKIT_FAULTS="hang:rank=1:step=4:phase=flush")
    assert res.rc == 0, res.tail()
    lines = res.attempt_lines()
    assert len(lines) == 2 and "failed" in lines[0] and "succeeded" in lines[1], lines
    timeouts = [e for e in res.events() if e["event"] == "timeout"]
    assert timeouts and all(e["attempt"] == 0 for e in timeouts), res.events()
    assert any("phase 'flush'" in e["reason"] for e in timeouts), timeouts
    assert not [e for e in res.events() if e["event"] == "flush-failed"], res.events()
    assert res.starts[1]["step"] >= 4, res.starts
    assert res.done["digest"] == reference_digest(4, 8), res.tail()

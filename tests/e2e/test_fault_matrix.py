"""Fault matrix: every protocol phase x {kill, exit, raise} on rank 0 and on a non-zero rank.

Each case runs the 4-rank toy example under ``ftkit run`` with a fault injected at step 5 of
launch attempt 0. The job must fail, be relaunched, resume from the newest committed step
(which the Koo–Toueg protocol determines exactly: a fault before the coordinator's durable
decision leaves step 4, one after it leaves step 5) and end with the failure-free digest.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.jobs import run_toy

PHASES = ["capture", "write-local", "vote", "decide", "commit"]
KINDS = ["kill", "exit", "raise"]
FAULT_STEP = 5

# representative cases that always run; the rest are marked slow (still run in CI)
FAST = {("kill", "write-local", 3), ("raise", "capture", 3), ("exit", "decide", 0),
        ("kill", "commit", 0), ("raise", "vote", 0)}


def expected_resume(phase: str, rank: int) -> int:
    """Newest committed step after a fault in ``phase`` of step 5 on ``rank``.

    The coordinator (rank 0) records the decision in ``decide`` *after* its fault hook; other
    ranks reach their ``decide`` hook only after the decision was announced.
    """
    after_decision = phase == "commit" or (phase == "decide" and rank != 0)
    return FAULT_STEP if after_decision else FAULT_STEP - 1


def _cases() -> list[object]:
    out: list[object] = []
    for kind in KINDS:
        for phase in PHASES:
            for rank in (3, 0):
                marks = [] if (kind, phase, rank) in FAST else [pytest.mark.slow]
                out.append(pytest.param(kind, phase, rank, marks=marks,
                                        id=f"{kind}-{phase}-rank{rank}"))
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind,phase,rank", _cases())
def test_fault_then_bitexact_resume(kind: str, phase: str, rank: int, tmp_path: Path,
                                    reference_digest: Callable[..., str]) -> None:
    spec = f"{kind}:rank={rank}:step={FAULT_STEP}:phase={phase}"
    res = run_toy(tmp_path, steps=8, FTKIT_FAULTS=spec)
    assert res.rc == 0, res.tail()
    lines = res.attempt_lines()
    assert len(lines) == 2 and "attempt 0" in lines[0] and "failed" in lines[0], lines
    assert "attempt 1" in lines[1] and "succeeded" in lines[1], lines
    starts = res.starts
    assert [s["attempt"] for s in starts] == [0, 1], starts
    assert starts[1]["step"] == expected_resume(phase, rank), (spec, starts, res.tail())
    assert res.done["digest"] == reference_digest(4, 8), res.tail()
    events = [e["event"] for e in res.events()]
    assert "relaunch" in events and events.count("restore") == 2, events


@pytest.mark.timeout(900)
@pytest.mark.parametrize("phase", PHASES)
def test_hang_detected_within_timeout(phase: str, tmp_path: Path,
                                      reference_digest: Callable[..., str]) -> None:
    """A rank that hangs in any phase is detected by its peers within FTKIT_TIMEOUT; the
    world is aborted (never left hanging), relaunched, and the result is still bit-exact."""
    timeout = 6
    res = run_toy(tmp_path, steps=8, FTKIT_TIMEOUT=str(timeout),
                  FTKIT_FAULTS=f"hang:rank=2:step={FAULT_STEP}:phase={phase}")
    assert res.rc == 0, res.tail()
    timeouts = [e for e in res.events() if e["event"] == "timeout"]
    assert timeouts and all(e["attempt"] == 0 for e in timeouts), res.events()
    assert any(f"phase {p!r}" in e["reason"] for e in timeouts for p in PHASES), timeouts
    first = [e for e in res.events() if e["event"] == "attempt-end" and e["attempt"] == 0]
    assert first and not first[0]["ok"], res.events()
    # detected within the protocol timeout (plus launch + training of 5 steps + teardown)
    assert first[0]["seconds"] < timeout + 45, first
    assert res.done["digest"] == reference_digest(4, 8)

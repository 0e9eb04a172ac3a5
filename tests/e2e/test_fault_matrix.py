"""Fault matrix: every protocol phase x {kill, exit, raise} on rank 0 and on a non-zero rank.

Each case runs the 4-rank toy example (2 ranks per node) under ``ftkit run`` with a fault
injected in launch attempt 0. The job must fail, be relaunched, resume from the newest
committed step (which the Koo–Toueg protocol determines exactly: a fault before the
coordinator's durable decision leaves the step before, one after it leaves the faulted step)
and end with the failure-free digest of the whole state.

Two configurations:

* ``local:1`` (fault at step 5): capture, write-local, vote, decide, commit;
* ``local:1,partner:1,pfs:3`` (fault at step 6, which is due on all three levels): the same
  phases plus ``encode`` (the partner copy; before the vote), ``announce`` (the coordinator,
  after its durable decision and before it is broadcast) and ``flush`` (the PFS write, which
  starts only once the step is committed on the node-local levels), and a whole node lost
  during a flush (its shards rebuilt from the partner copies on the other node). A ``raise``
  in ``flush`` is a failing PFS, not a failed job: that job completes in its first attempt
  (docs/protocol.md, "A failed flush is a warning").

Besides the exact resume step, every case checks that no step the coordinator reported
committed in the failed attempt is newer than the step resumed from: a committed step is
never lost.

Every rank writes its node-local shard into a reused slot file (``storage/slots.py``): from
step 3 on, a save overwrites the slot that held the committed step two steps back. The
capture copies CPU tensors straight into it, so ``capture`` strikes before that slot is
overwritten, ``write-local`` after it was overwritten and before it is published as the
step's shard, ``vote`` .. ``commit`` after; the single-level cases check that the slots were
indeed reused (at most 3 per rank after 8 saves and a relaunch).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.jobs import Result, run_toy

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


def _params(cases: list[tuple[str, str, int]], fast: set[tuple[str, str, int]]
            ) -> list[object]:
    """pytest params of (kind, phase, rank) cases; those not in ``fast`` are marked slow."""
    return [pytest.param(kind, phase, rank,
                         marks=[] if (kind, phase, rank) in fast else [pytest.mark.slow],
                         id=f"{kind}-{phase}-rank{rank}") for kind, phase, rank in cases]


def _cases() -> list[object]:
    return _params([(k, p, r) for k in KINDS for p in PHASES for r in (3, 0)], FAST)


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
    if kind == "kill":                       # the launcher's report, named in the line
        assert f"(exit 137: rank {rank} killed by SIGKILL on node " in lines[0], lines
    _assert_resumed(res, expected_resume(phase, rank), spec)
    assert res.done["digest"] == reference_digest(4, 8), res.tail()
    events = [e["event"] for e in res.events()]
    assert "relaunch" in events and events.count("restore") == 2, events
    slots = _slots_per_rank(res.local)
    assert len(slots) == 4 and max(slots.values()) <= 3, slots


def _slots_per_rank(local: Path) -> dict[str, int]:
    """Slot files of each rank under the node-local directory ``local``."""
    out: dict[str, int] = {}
    for slot in local.rglob("slots/rank-*.slot"):
        rank = slot.name.split(".")[0]
        out[rank] = out.get(rank, 0) + 1
    return out


def _assert_resumed(res: Result, step: int, spec: str) -> None:
    """Attempt 1 resumed at ``step``, and no step committed in attempt 0 is newer."""
    starts = res.starts
    assert [s["attempt"] for s in starts] == [0, 1], (starts, res.tail())
    assert starts[1]["step"] == step, (spec, starts, res.tail())
    lost = [s for s in res.committed(0) if s > step]
    assert not lost, f"{spec}: committed step(s) {lost} lost; resumed at {step}\n{res.tail()}"


# ------------------------------------------------------- local:1,partner:1,pfs:3, step 6
MULTI_LEVELS = "local:1,partner:1,pfs:3"
MULTI_STEP = 6                       # due on local, partner and pfs
MULTI_PHASES = ["capture", "write-local", "encode", "vote", "decide", "announce", "commit",
                "flush"]
MULTI_FAST = {("kill", "encode", 3), ("raise", "encode", 0), ("kill", "announce", 0),
              ("kill", "flush", 3), ("raise", "flush", 0)}


def multi_resume(phase: str, rank: int) -> int:
    """Newest committed step after a fault in ``phase`` of step 6 on ``rank``.

    ``encode`` runs on every rank before the vote: step 5. The coordinator's ``announce``
    comes after its durable decision: step 6, like the ``decide`` hook of the other ranks
    (reached after the announcement) and ``commit``. ``flush`` starts after step 6 was
    committed on the node-local levels: a killed or exiting rank leaves step 6.
    """
    after = phase in ("announce", "commit", "flush") or (phase == "decide" and rank != 0)
    return MULTI_STEP if after else MULTI_STEP - 1


# phases the single-level matrix does not reach get every kind; the others (already covered
# by every kind above) get ``kill`` here, to keep the CI time of the matrix in bounds
MULTI_NEW = ("encode", "announce", "flush")


def _multi_cases() -> list[object]:
    """Every case that ends the attempt (a raised fault in ``flush`` does not: it has a
    test of its own)."""
    return _params([(k, p, r) for k in KINDS
                    for p in MULTI_PHASES if k == "kill" or p in MULTI_NEW
                    for r in ((0,) if p == "announce" else (3, 0))   # announce: coordinator
                    if (k, p) != ("raise", "flush")], MULTI_FAST)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,phase,rank", _multi_cases())
def test_multilevel_fault_then_bitexact_resume(kind: str, phase: str, rank: int,
                                               tmp_path: Path,
                                               reference_digest: Callable[..., str]) -> None:
    spec = f"{kind}:rank={rank}:step={MULTI_STEP}:phase={phase}"
    res = run_toy(tmp_path, steps=8, FTKIT_LEVELS=MULTI_LEVELS, FTKIT_FAULTS=spec)
    assert res.rc == 0, res.tail()
    lines = res.attempt_lines()
    assert len(lines) == 2 and "failed" in lines[0] and "succeeded" in lines[1], lines
    _assert_resumed(res, multi_resume(phase, rank), spec)
    assert res.done["digest"] == reference_digest(4, 8), res.tail()
    if phase == "flush":      # the PFS copy of step 6 never completed; step 3's did
        step_dir = res.pfs / "e2e"
        assert (step_dir / "step-3" / "COMMITTED").is_file(), sorted(step_dir.iterdir())
        flushed = [e["step"] for e in res.events() if e["event"] == "flush"
                   and e.get("attempt") == 0]
        assert flushed == [3], res.events()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,phase,rank", _params(
    [("raise", "flush", r) for r in (3, 0)], MULTI_FAST))
def test_multilevel_flush_raise_degrades_without_relaunch(
        kind: str, phase: str, rank: int, tmp_path: Path,
        reference_digest: Callable[..., str]) -> None:
    """A fault raised in the PFS flush of step 6 on ``rank``: the flush fails on every rank
    (a ``flush-failed`` event), training goes on without a relaunch, steps 7 and 8 commit on
    the node-local levels, the PFS keeps step 3 only, and the digest is the failure-free
    one."""
    spec = f"{kind}:rank={rank}:step={MULTI_STEP}:phase={phase}"
    res = run_toy(tmp_path, steps=8, FTKIT_LEVELS=MULTI_LEVELS, FTKIT_FAULTS=spec)
    assert res.rc == 0, res.tail()
    lines = res.attempt_lines()
    assert len(lines) == 1 and "succeeded" in lines[0], (lines, res.tail())
    assert res.committed(0) == list(range(1, 9)), res.events()
    failed = [(e["step"], e["level"]) for e in res.events() if e["event"] == "flush-failed"]
    assert failed == [(MULTI_STEP, "pfs")], res.events()
    job = res.pfs / "e2e"
    assert sorted(p.parent.name for p in job.glob("step-*/COMMITTED")) == ["step-3"]
    assert res.done["digest"] == reference_digest(4, 8), res.tail()


@pytest.mark.timeout(300)
def test_node_lost_during_flush_rebuilt_from_partner(
        tmp_path: Path, reference_digest: Callable[..., str]) -> None:
    """Node 1 (ranks 2 and 3) dies and its local directory is wiped as the PFS flush of step 6
    starts. Step 6 was committed on local and partner before the flush; the PFS holds only
    step 3. The relaunch rebuilds ranks 2 and 3's step-6 shards from their partner copies on
    node 0 and resumes at step 6, bit-exact."""
    spec = f"node:rank=2:step={MULTI_STEP}:phase=flush"
    res = run_toy(tmp_path, steps=8, FTKIT_LEVELS=MULTI_LEVELS, FTKIT_FAULTS=spec)
    assert res.rc == 0, res.tail()
    _assert_resumed(res, MULTI_STEP, spec)
    rebuilds = [e for e in res.events() if e["event"] == "rebuild"]
    assert len(rebuilds) == 1 and rebuilds[0]["step"] == MULTI_STEP, rebuilds
    assert sorted(rebuilds[0]["from_partner"]) == [2, 3], rebuilds
    assert res.done["digest"] == reference_digest(4, 8), res.tail()


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

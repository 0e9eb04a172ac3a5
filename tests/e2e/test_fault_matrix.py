"""Fault matrix: every protocol phase x {kill, exit, raise} on rank 0 and on a non-zero rank.

Each case is a fault injected into a 4-rank toy job (2 ranks per node) under ``ftkit run``:
``examples/toy_numpy.py``, the NumPy and mpi4py twin of ``toy_dp.py`` (same data, an MLP and
Adam in NumPy, per-rank generators), because the protocol does not depend on what the state
holds and that job starts in ~2 s where the torch one takes ~9 s on a 2-core machine (torch's
import, and torch._dynamo's, which ``torch.optim`` pulls in): the matrix's ~80 attempts fit
the CI time that way. What is torch's own under a fault (CPU tensors landing in the slot,
optimizer state staged in the background behind the step pre-hook) has its chain on the
torch toy, ``test_torch_state_under_capture_faults``; every other e2e test runs torch.

The attempt must fail, be relaunched, resume from the newest committed step (which the
Koo–Toueg protocol determines exactly: a fault before the coordinator's durable decision
leaves the step before, one after it leaves the faulted step) and the job must end with the
failure-free digest of the whole state. To keep the CI time in bounds, cases run in chains
of three per job (``run_chain``): attempt 0 meets the first fault, its relaunch (attempt 1)
the second at a later step, attempt 2 the third, attempt 3 finishes; each attempt's resume
step is checked, and the final digest covers all three recoveries.

Two configurations:

* ``local:1`` (faults at steps 5, 6, 7): capture, write-local, vote, decide, commit;
* ``local:1,partner:1,pfs:3`` (faults at steps 6, 9, 12, each due on all three levels): the same
  phases plus ``encode`` (the partner copy; before the vote), ``announce`` (the coordinator,
  after its durable decision and before it is broadcast) and ``flush`` (the PFS write, which
  starts only once the step is committed on the node-local levels), and a whole node lost
  during a flush (its shards rebuilt from the partner copies on the other node). A ``raise``
  in ``flush`` is a failing PFS, not a failed job: that job completes in its first attempt
  (docs/protocol.md, "A failed flush is a warning").

Besides the exact resume step, every case checks that no step the coordinator reported
committed in the failed attempt is newer than the step resumed from: a committed step is
never lost. A hang in each phase is one more chain (detected within ``FTKIT_TIMEOUT``).

Every rank writes its node-local shard into a reused slot file (``storage/slots.py``): from
step 3 on, a save overwrites the slot that held the committed step two steps back. The
capture copies CPU arrays and tensors straight into it, so ``capture`` strikes before that
slot is overwritten, ``write-local`` after it was overwritten and before it is published as
the step's shard, ``vote`` .. ``commit`` after; the single-level cases check that the slots were
indeed reused (at most 3 per rank after 8 saves and three relaunches).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.jobs import NUMPY_TOY, TOY, Result, run_toy

PHASES = ["capture", "write-local", "vote", "decide", "commit"]
KINDS = ["kill", "exit", "raise"]
FAULT_STEP = 5

# representative cases that always run; the rest are marked slow (still run in CI)
FAST = {("kill", "write-local", 3), ("raise", "capture", 3), ("exit", "decide", 0),
        ("kill", "commit", 0), ("raise", "vote", 0)}


def expected_resume(phase: str, rank: int, step: int = FAULT_STEP) -> int:
    """Newest committed step after a fault in ``phase`` of ``step`` on ``rank``.

    The coordinator (rank 0) records the decision in ``decide`` *after* its fault hook; other
    ranks reach their ``decide`` hook only after the decision was announced.
    """
    after_decision = phase == "commit" or (phase == "decide" and rank != 0)
    return step if after_decision else step - 1


Case = tuple[str, str, int]          # (kind, phase, rank)
CHAIN = 3                            # faults per job: one in each of attempts 0, 1, 2


def _chains(cases: list[Case], fast: set[Case]) -> list[object]:
    """pytest params of ``cases`` in chains of CHAIN consecutive cases, one job each; a
    chain holding no case of ``fast`` is marked slow."""
    out = []
    for i in range(0, len(cases), CHAIN):
        chain = cases[i:i + CHAIN]
        out.append(pytest.param(chain, marks=[] if fast & set(chain) else [pytest.mark.slow],
                                id="+".join(f"{k}-{p}-rank{r}" for k, p, r in chain)))
    return out


def run_chain(tmp_path: Path, chain: list[Case], first: int, every: int, steps: int,
              resume: Callable[[str, int, int], int], script: Path = NUMPY_TOY,
              **env: str) -> Result:
    """One toy job whose attempt i meets fault ``chain[i]`` at step ``first + i * every``;
    checks that every attempt but the last failed, the last succeeded, and attempt i + 1
    resumed at ``resume(phase, rank, step)`` of fault i with no step committed in attempt
    i newer (a committed step is never lost). Returns the outcome."""
    specs = [f"{k}:rank={r}:step={first + i * every}:phase={p}:attempt={i}"
             for i, (k, p, r) in enumerate(chain)]
    res = run_toy(tmp_path, steps=steps, max_restarts=len(chain), FTKIT_FAULTS=";".join(specs),
                  script=script, **env)
    assert res.rc == 0, res.tail()
    lines = res.attempt_lines()
    assert len(lines) == len(chain) + 1 and "succeeded" in lines[-1], (lines, res.tail())
    starts = res.starts
    assert [s["attempt"] for s in starts] == list(range(len(chain) + 1)), (starts, res.tail())
    for i, (kind, phase, rank) in enumerate(chain):
        assert f"attempt {i}" in lines[i] and "failed" in lines[i], (specs[i], lines)
        if kind == "kill":                   # the launcher's report, named in the line
            assert f"(exit 137: rank {rank} killed by SIGKILL on node " in lines[i], lines
        step = resume(phase, rank, first + i * every)
        assert starts[i + 1]["step"] == step, (specs[i], starts, res.tail())
        lost = [s for s in res.committed(i) if s > step]
        assert not lost, f"{specs[i]}: committed step(s) {lost} lost; resumed at {step}\n" \
                         f"{res.tail()}"
    return res


def _cases() -> list[object]:
    return _chains([(k, p, r) for k in KINDS for p in PHASES for r in (3, 0)], FAST)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("chain", _cases())
def test_fault_then_bitexact_resume(chain: list[Case], tmp_path: Path,
                                    reference_digest: Callable[..., str]) -> None:
    _check_single_level(tmp_path, chain, NUMPY_TOY, reference_digest)


@pytest.mark.timeout(900)
def test_torch_state_under_capture_faults(tmp_path: Path,
                                          reference_digest: Callable[..., str]) -> None:
    """The torch toy (an MLP, Adam, dropout): faults where its tensors land in the slot and
    Adam's state is staged in the background (capture, write-local), on both ranks."""
    chain = [("kill", "capture", 3), ("raise", "capture", 0), ("kill", "write-local", 0)]
    _check_single_level(tmp_path, chain, TOY, reference_digest)


def _check_single_level(tmp_path: Path, chain: list[Case], script: Path,
                        reference_digest: Callable[..., str]) -> None:
    res = run_chain(tmp_path, chain, FAULT_STEP, 1, 8, expected_resume, script=script)
    assert res.done["digest"] == reference_digest(4, 8, script=script), res.tail()
    events = [e["event"] for e in res.events()]
    assert "relaunch" in events and events.count("restore") == len(chain) + 1, events
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


def multi_resume(phase: str, rank: int, step: int = MULTI_STEP) -> int:
    """Newest committed step after a fault in ``phase`` of ``step`` (6, 9, 12: due on every
    level) on ``rank``.

    ``encode`` runs on every rank before the vote: step 5. The coordinator's ``announce``
    comes after its durable decision: step 6, like the ``decide`` hook of the other ranks
    (reached after the announcement) and ``commit``. ``flush`` starts after step 6 was
    committed on the node-local levels: a killed or exiting rank leaves step 6.
    """
    after = phase in ("announce", "commit", "flush") or (phase == "decide" and rank != 0)
    return step if after else step - 1


# phases the single-level matrix does not reach get every kind; the others (already covered
# by every kind above) get ``kill`` here, to keep the CI time of the matrix in bounds
MULTI_NEW = ("encode", "announce", "flush")


def _multi_cases() -> list[object]:
    """Every case that ends the attempt (a raised fault in ``flush`` does not: it has a
    test of its own)."""
    return _chains([(k, p, r) for k in KINDS
                    for p in MULTI_PHASES if k == "kill" or p in MULTI_NEW
                    for r in ((0,) if p == "announce" else (3, 0))   # announce: coordinator
                    if (k, p) != ("raise", "flush")], MULTI_FAST)


MULTI_STEPS = MULTI_STEP + CHAIN * 3 - 2     # faults at steps 6, 9, 12; the job runs to 13


@pytest.mark.timeout(900)
@pytest.mark.parametrize("chain", _multi_cases())
def test_multilevel_fault_then_bitexact_resume(chain: list[Case], tmp_path: Path,
                                               reference_digest: Callable[..., str]) -> None:
    res = run_chain(tmp_path, chain, MULTI_STEP, 3, MULTI_STEPS, multi_resume,
                    FTKIT_LEVELS=MULTI_LEVELS)
    assert res.done["digest"] == reference_digest(4, MULTI_STEPS, script=NUMPY_TOY), res.tail()
    for i, (_, phase, _) in enumerate(chain):
        if phase == "flush":      # that attempt's PFS copy of the faulted step never completed
            step = MULTI_STEP + 3 * i
            flushed = [e["step"] for e in res.events() if e["event"] == "flush"
                       and e.get("attempt") == i]
            assert step not in flushed, (step, res.events())
            assert not (res.pfs / "e2e" / f"step-{step}" / "COMMITTED").exists()
    early = res.pfs / "e2e" / ".early"         # early PFS writes left nothing behind
    assert not early.exists() or sorted(early.iterdir()) == [], sorted(early.iterdir())


@pytest.mark.timeout(300)
def test_multilevel_flush_raise_degrades_without_relaunch(
        tmp_path: Path, reference_digest: Callable[..., str]) -> None:
    """A fault raised in the PFS flush of step 6 on rank 3, and of step 9 on rank 0: each
    flush fails on every rank (a ``flush-failed`` event), training goes on without a
    relaunch, every step commits on the node-local levels, the PFS keeps step 3 and the
    final step 10 (not due, flushed by ``close()``), and the digest is the failure-free one."""
    spec = ";".join(f"raise:rank={r}:step={s}:phase=flush" for r, s in ((3, 6), (0, 9)))
    res = run_toy(tmp_path, steps=10, FTKIT_LEVELS=MULTI_LEVELS, FTKIT_FAULTS=spec,
                  script=NUMPY_TOY)
    assert res.rc == 0, res.tail()
    lines = res.attempt_lines()
    assert len(lines) == 1 and "succeeded" in lines[0], (lines, res.tail())
    assert res.committed(0) == list(range(1, 11)), res.events()
    failed = [(e["step"], e["level"]) for e in res.events() if e["event"] == "flush-failed"]
    assert failed == [(6, "pfs"), (9, "pfs")], res.events()
    job = res.pfs / "e2e"
    assert sorted(p.parent.name for p in job.glob("step-*/COMMITTED")) == ["step-10", "step-3"]
    assert res.done["digest"] == reference_digest(4, 10, script=NUMPY_TOY), res.tail()


@pytest.mark.timeout(300)
def test_node_lost_during_flush_rebuilt_from_partner(
        tmp_path: Path, reference_digest: Callable[..., str]) -> None:
    """Node 1 (ranks 2 and 3) dies and its local directory is wiped as the PFS flush of step 6
    starts. Step 6 was committed on local and partner before the flush; the PFS holds only
    step 3. The relaunch rebuilds ranks 2 and 3's step-6 shards from their partner copies on
    node 0 and resumes at step 6, bit-exact."""
    spec = f"node:rank=2:step={MULTI_STEP}:phase=flush"
    res = run_toy(tmp_path, steps=8, FTKIT_LEVELS=MULTI_LEVELS, FTKIT_FAULTS=spec,
                  script=NUMPY_TOY)
    assert res.rc == 0, res.tail()
    _assert_resumed(res, MULTI_STEP, spec)
    rebuilds = [e for e in res.events() if e["event"] == "rebuild"]
    assert len(rebuilds) == 1 and rebuilds[0]["step"] == MULTI_STEP, rebuilds
    assert sorted(rebuilds[0]["from_partner"]) == [2, 3], rebuilds
    assert res.done["digest"] == reference_digest(4, 8, script=NUMPY_TOY), res.tail()


@pytest.mark.timeout(400)
def test_second_node_lost_while_the_loaded_step_is_repaired(
        tmp_path: Path, reference_digest: Callable[..., str]) -> None:
    """Attempt 0: node 1 dies as the flush of step 6 starts (as above). Attempt 1: ranks 2
    and 3 load step 6 straight from their partner copies on node 0 (the restore event says
    whose) and training goes on while the step is repaired in the background; node 0 dies
    as that repair starts, before node 1 holds the shards and copies again. Step 6 then
    exists nowhere whole: attempt 2 resumes from the PFS step 3 (an older step, never a
    torn one), and the run ends with the failure-free digest."""
    spec = (f"node:rank=2:step={MULTI_STEP}:phase=flush;"
            f"node:rank=0:step={MULTI_STEP}:phase=restore-rebuild:attempt=1")
    res = run_toy(tmp_path, steps=8, FTKIT_LEVELS=MULTI_LEVELS, FTKIT_FAULTS=spec,
                  script=NUMPY_TOY)
    assert res.rc == 0, res.tail()
    starts = res.starts
    assert [(s["attempt"], s["step"]) for s in starts] == [(0, 0), (1, MULTI_STEP), (2, 3)], \
        (starts, res.tail())
    restores = {e["attempt"]: e for e in res.events() if e["event"] == "restore"}
    assert sorted(restores[1]["loaded_from"]) == ["2", "3"], restores
    assert (restores[2]["level"], restores[2]["step"]) == ("pfs", 3), restores
    assert not [e for e in res.events() if e["event"] == "rebuild" and e["attempt"] == 1]
    assert res.done["digest"] == reference_digest(4, 8, script=NUMPY_TOY), res.tail()


@pytest.mark.timeout(900)
def test_hang_detected_within_timeout(tmp_path: Path,
                                      reference_digest: Callable[..., str]) -> None:
    """A rank that hangs in any phase is detected by its peers within FTKIT_TIMEOUT; the
    world is aborted (never left hanging), relaunched, and the result is still bit-exact.
    One job: attempt i hangs rank 2 in phase i at step 5 + i; each resumes where the
    protocol says."""
    timeout = 6
    res = run_chain(tmp_path, [("hang", p, 2) for p in PHASES], FAULT_STEP, 1, 10,
                    expected_resume, FTKIT_TIMEOUT=str(timeout))
    events = res.events()
    for i, phase in enumerate(PHASES):
        timeouts = [e for e in events if e["event"] == "timeout" and e["attempt"] == i]
        assert timeouts, (phase, events)
        assert any(f"phase {p!r}" in e["reason"] for e in timeouts for p in PHASES), timeouts
        ends = [e for e in events if e["event"] == "attempt-end" and e["attempt"] == i]
        assert ends and not ends[0]["ok"], (phase, events)
        # detected within the protocol timeout (plus launch, training, teardown)
        assert ends[0]["seconds"] < timeout + 45, (phase, ends)
    assert not [e for e in events if e["event"] == "timeout" and e["attempt"] == len(PHASES)]
    assert res.done["digest"] == reference_digest(4, 10, script=NUMPY_TOY)

"""In-job recovery (``ftkit run --in-job --spares K``): ranks killed from outside at random
steps are replaced by spare ranks in the running job, without a relaunch, and training ends
bit-exact; more failures than spares fall back to a relaunch that ends bit-exact too.

The toy runs on 4 working ranks in virtual nodes of 2 plus 2 spares under
``mpiexec --with-ft ulfm`` (Open MPI 5). A killer thread watches the job's event log and
sends SIGKILL (or SIGSTOP: a hung rank) to a rank's process (found by its
``OMPI_COMM_WORLD_RANK`` and working directory) once the job committed the chosen step in
the current generation."""
from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ftkit.jobdir.events import read_events
from ftkit.testing.procs import rank_processes
from tests.e2e.jobs import FTKIT, TOY, Result, job_env, run_toy

N, SPARES, STEPS = 4, 2, 40
LEVELS = "local:1,partner:1"
IN_JOB = ("--in-job", "--spares", str(SPARES))
pytestmark = pytest.mark.timeout(600)


class Killer(threading.Thread):
    """Kill ``victims[i]`` (world ranks) once step ``steps[i]`` is committed after the
    previous kill's recovery (its ``in-job-step`` event); ``wipe``: also remove that node's
    local directory right after its ranks died (a lost node)."""

    def __init__(self, tmp: Path, plan: list[tuple[int, list[int]]], wipe: int | None = None,
                 sig: int = signal.SIGKILL) -> None:
        super().__init__(daemon=True)
        self.tmp, self.plan, self.wipe, self.sig = tmp, plan, wipe, sig
        self.killed: list[tuple[int, dict[int, int], float]] = []
        self.error: str | None = None

    def run(self) -> None:
        events = self.tmp / "pfs" / "e2e" / "events.jsonl"
        seen = 0                                   # events before this index are old
        deadline = time.monotonic() + 400
        try:
            for i, (step, ranks) in enumerate(self.plan):
                while time.monotonic() < deadline:
                    got = list(read_events(events))
                    if i and not [e for e in got[seen:] if e["event"] == "in-job-step"]:
                        time.sleep(0.02)           # the previous recovery is not done yet
                        continue
                    if [e for e in got[seen:] if e["event"] == "commit"
                            and e["step"] >= step]:
                        break
                    time.sleep(0.02)
                seen = len(list(read_events(events)))
                self._kill(ranks)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = repr(exc)

    def _kill(self, ranks: list[int]) -> None:
        pids = rank_processes(self.tmp, ranks)
        assert sorted(pids) == sorted(ranks), (ranks, pids)
        for pid in pids.values():
            os.kill(pid, self.sig)
        if self.wipe is not None:      # a lost node: its memory goes with its processes,
            # before the spares that take its ranks' places can start (recovery takes
            # a few hundred ms; this, a few)
            shutil.rmtree(self.tmp / "local" / "e2e" / f"node-{self.wipe}")
        self.killed.append((len(self.killed), pids, time.time()))


def _losses(res: Result) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in res.json_lines() if r.get("event") == "step"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Result:
    """The failure-free run (no in-job mode): its losses and digest."""
    res = run_toy(tmp_path_factory.mktemp("ref"), n=N, steps=STEPS, max_restarts=0,
                  FTKIT_LEVELS=LEVELS)
    assert res.rc == 0, res.tail()
    return res


def _check_bitexact(res: Result, reference: Result) -> None:
    own = dict(_losses(reference))
    printed = _losses(res)
    assert {s for s, _ in printed} == set(own), res.tail()
    assert [(s, loss) for s, loss in printed if loss != own[s]] == [], res.tail()
    assert res.done["digest"] == reference.done["digest"], res.tail()


def test_killed_ranks_are_replaced_in_job_then_a_third_falls_back(
        tmp_path: Path, reference: Result) -> None:
    """Two working ranks killed one after another at random steps are replaced by the two
    spares in the first mpiexec (two ``in-job`` events, no relaunch between); a third,
    with no spare left, falls back to a relaunch naming why; every printed loss and the
    final digest equal the failure-free run's."""
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    victims = rng.sample(range(N), 3)
    steps = sorted(rng.sample(range(5, 30), 3))
    print(f"seed {seed}: kill world ranks {victims} after steps {steps}")
    killer = Killer(tmp_path, [(s, [v]) for s, v in zip(steps, victims)])
    killer.start()
    res = run_toy(tmp_path, n=N, steps=STEPS, max_restarts=1, run_args=IN_JOB,
                  FTKIT_LEVELS=LEVELS)
    killer.join(5)
    assert killer.error is None and len(killer.killed) == 3, (killer.error, killer.killed)
    assert res.rc == 0, res.tail()
    events = res.events()
    recoveries = [e for e in events if e["event"] == "in-job"]
    assert [(e["attempt"], e["failed"], e["spares_left"]) for e in recoveries] == \
        [(0, [victims[0]], 1), (0, [victims[1]], 0)], recoveries
    assert sorted(recoveries[0]["replaced"].values()) + \
        sorted(recoveries[1]["replaced"].values()) in ([N, N + 1], [N + 1, N]), recoveries
    assert [e["generation"] for e in events if e["event"] == "in-job-step"] == [1, 2]
    lines = res.attempt_lines()
    assert len(lines) == 2, lines
    assert "in-job recovery impossible: 1 working rank(s) failed" in lines[0], lines
    assert "0 spare rank(s) are left; falling back to a relaunch" in lines[0], lines
    assert "succeeded" in lines[1], lines
    _check_bitexact(res, reference)


@pytest.mark.parametrize("level", ["partner", "xor", "rs"])
def test_lost_virtual_node_is_rebuilt_in_job(tmp_path: Path, reference: Result,
                                             level: str) -> None:
    """Both ranks of virtual node 1 killed and its local directory wiped: the
    two spares take ranks 2 and 3 in the running job, their shards are rebuilt from the
    partner copies on node 0 (or the XOR parity, or the Reed-Solomon parity, of the sets
    {0, 2} and {1, 3}), and the job ends bit-exact in its first mpiexec."""
    step = random.randrange(5, 30)
    print(f"node 1 lost after step {step}")
    killer = Killer(tmp_path, [(step, [2, 3])], wipe=1)
    killer.start()
    res = run_toy(tmp_path, n=N, steps=STEPS, max_restarts=0, run_args=IN_JOB,
                  FTKIT_LEVELS=f"local:1,{level}:1", FTKIT_XOR_SET="2", FTKIT_RS_SET="2",
                  FTKIT_RS_PARITY="1")
    killer.join(5)
    assert killer.error is None and len(killer.killed) == 1, killer.error
    assert res.rc == 0, res.tail()
    events = res.events()
    [rec] = [e for e in events if e["event"] == "in-job"]
    assert rec["failed"] == [2, 3] and rec["replaced"] == {"2": N, "3": N + 1}, rec
    rebuilt = [e for e in events if e["event"] == "rebuild"]
    assert rebuilt and rebuilt[0]["nodes"] == ["node-1"], rebuilt
    if level == "partner":
        assert rebuilt[0]["from_partner"] == [2, 3], rebuilt
    else:
        assert rebuilt[0]["erasure"] == {level: {"0": [1], "1": [1]}}, rebuilt
    assert len(res.attempt_lines()) == 1 and "succeeded" in res.attempt_lines()[0]
    _check_bitexact(res, reference)


def test_hung_rank_is_ended_by_the_heartbeat_and_replaced_in_job(
        tmp_path: Path, reference: Result) -> None:
    """A working rank stopped (SIGSTOP: alive to MPI, silent) at a random step: the next
    process hears no heartbeat for FTKIT_HEARTBEAT seconds, kills it (``hung`` event naming
    the rank). The spare that would take its place (process 4) dies too, right before its
    shrink (``in-job-rebuild`` fault): the survivors shrink again (or their first shrink
    already left it out), the other spare takes the rank, and training ends bit-exact in
    the first mpiexec with no spare left. (One job for both: CI time.)"""
    rng = random.Random()
    step, victim = rng.randrange(5, 30), rng.randrange(N)
    print(f"stop world rank {victim} after step {step}")
    killer = Killer(tmp_path, [(step, [victim])], sig=signal.SIGSTOP)
    killer.start()
    try:
        res = run_toy(tmp_path, n=N, steps=STEPS, max_restarts=0, run_args=IN_JOB,
                      FTKIT_LEVELS=LEVELS, FTKIT_HEARTBEAT="4",
                      FTKIT_FAULTS="kill:phase=in-job-rebuild:rank=4")
    finally:
        for pid in rank_processes(tmp_path, [victim]).values():   # never leave it stopped
            os.kill(pid, signal.SIGKILL)
    killer.join(5)
    assert killer.error is None and len(killer.killed) == 1, killer.error
    assert res.rc == 0, res.tail()
    events = res.events()
    [hung] = [e for e in events if e["event"] == "hung"]
    assert (hung["rank"], hung["process"], hung["ended"]) == (victim, victim, True), hung
    assert hung["by_process"] == (victim + 1) % (N + SPARES), hung
    assert hung["silent_s"] >= 4, hung    # rounded to ms
    [rec] = [e for e in events if e["event"] == "in-job"]
    assert rec["failed"] == [victim] and rec["replaced"] == {str(victim): N + 1}, rec
    assert rec["spares_left"] == 0, rec
    assert len(res.attempt_lines()) == 1 and "succeeded" in res.attempt_lines()[0]
    _check_bitexact(res, reference)



def test_a_process_hanging_in_the_recovery_falls_back(
        tmp_path: Path, reference: Result) -> None:
    """A working rank killed at a random step; spare process 4 hangs right before its shrink
    (``hang`` fault at ``in-job-rebuild``): alive to MPI, so the other processes' shrink
    waits for it, and no heartbeat watches a recovery. FTKIT_TIMEOUT (8 s) bounds the
    recovery: the job falls back to a relaunch whose attempt line says why (and a process's
    stderr where it was stuck), and ends bit-exact."""
    rng = random.Random()
    step, victim = rng.randrange(5, 30), rng.randrange(N)
    print(f"kill world rank {victim} after step {step}")
    killer = Killer(tmp_path, [(step, [victim])])
    killer.start()
    res = run_toy(tmp_path, n=N, steps=STEPS, max_restarts=1, run_args=IN_JOB,
                  FTKIT_LEVELS=LEVELS, FTKIT_TIMEOUT="8",
                  FTKIT_FAULTS="hang:phase=in-job-rebuild:rank=4:attempt=0")
    killer.join(5)
    assert killer.error is None and len(killer.killed) == 1, killer.error
    assert res.rc == 0, res.tail()
    lines = res.attempt_lines()
    assert len(lines) == 2 and "succeeded" in lines[1], lines
    assert "the recovery did not finish within 8 s of the failure (FTKIT_TIMEOUT)" \
        in lines[0], lines
    stacks = res.stderr[res.stderr.find("the stacks of its threads:"):]
    # where each was stuck: the shrink (waiting for the hung spare), or the hang fault
    assert any(f" in {fn}\n" in stacks for fn in ("rebuild", "_trigger")), res.tail()
    assert not [e for e in res.events() if e["event"] == "in-job"], res.events()
    _check_bitexact(res, reference)


def test_a_process_lost_during_start_up_is_relaunched(tmp_path: Path,
                                                      reference: Result) -> None:
    """World rank 3 dies before MPI_Init in attempt 0 (a node lost at job start): ULFM does
    not cover initialisation, so the other processes would wait in MPI_Init until
    ``--stall-timeout`` (an hour). The start-up deadline (no ``in-job-start`` event: not every
    process passed MPI_Init) ends the attempt with a line that says so; the relaunch ends
    bit-exact."""
    script = (f'if [ "$OMPI_COMM_WORLD_RANK" = 3 ] && [ "$FTKIT_ATTEMPT" = 0 ]; then '
              f'kill -9 $$; fi; exec {sys.executable} -m mpi4py {TOY} --steps {STEPS} --seed 1')
    cmd = [*FTKIT, "run", "-n", str(N), "--ranks-per-node", "2", *IN_JOB, "--max-restarts",
           "1", "--restart-delay", "0", "--startup-timeout", "45", "--attempt-timeout", "240",
           "--keep-local", "--", "sh", "-c", script]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, check=False, cwd=tmp_path, capture_output=True, text=True,
                          timeout=500, env=job_env(tmp_path, FTKIT_LEVELS=LEVELS))
    res = Result(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0,
                 tmp_path / "pfs", tmp_path / "local" / "e2e")
    assert res.rc == 0, res.tail()
    lines = res.attempt_lines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("ftkit run: attempt 0: failed (the job did not start within "
                               "45 s (no event: a process died or hung during start-up"), lines
    assert "succeeded" in lines[1], lines
    started = [e for e in res.events() if e["event"] == "in-job-start"]
    assert [(e["attempt"], e["processes"], e["working"]) for e in started] == \
        [(1, N + SPARES, N)], started
    _check_bitexact(res, reference)


class AtStartKiller(threading.Thread):
    """Kill world rank ``first`` once step ``step`` is committed, then world rank ``second``
    the moment the recovery's ``in-job`` event appears (the new generation is building its
    torch.distributed groups)."""

    def __init__(self, tmp: Path, step: int, first: int, second: int) -> None:
        super().__init__(daemon=True)
        self.tmp, self.step, self.first, self.second = tmp, step, first, second
        self.killed: list[int] = []
        self.error: str | None = None

    def _wait_for(self, found: Callable[[list[dict[str, Any]]], bool]) -> None:
        events = self.tmp / "pfs" / "e2e" / "events.jsonl"
        deadline = time.monotonic() + 300
        while not found(list(read_events(events))):
            assert time.monotonic() < deadline, "the event never came"
            time.sleep(0.005)

    def run(self) -> None:
        try:
            self._wait_for(lambda got: any(e["event"] == "commit" and e["step"] >= self.step
                                           for e in got))
            for rank, wait in ((self.first, False), (self.second, True)):
                if wait:
                    self._wait_for(lambda got: any(e["event"] == "in-job" for e in got))
                [pid] = rank_processes(self.tmp, [rank]).values()
                os.kill(pid, signal.SIGKILL)
                self.killed.append(rank)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = repr(exc)


@pytest.mark.parametrize(("first", "second"), [(2, 0), (1, 3), (0, 2)])
def test_a_second_death_as_a_generation_starts_is_recovered_in_job(
        tmp_path: Path, reference: Result, first: int, second: int) -> None:
    """A working rank killed at a random step; a second one killed right at the first
    recovery's ``in-job`` event, while the new generation builds torch.distributed (the
    rendezvous store on its rank 0, then the gloo group's exchange of addresses): every
    survivor's wait there ends at once — the store's socket is shut down, and a client
    connecting to a dead rank 0's store is left behind on a helper thread — torch's group
    counter is reset for the next generation, the second recovery happens in the job within
    5 s of its detection, and training ends bit-exact without a relaunch. The second victim
    is the new generation's rank 0 (the store) in the first case, another rank in the
    second; the first victim is rank 0 in the third."""
    step = random.Random().randrange(5, 25)
    print(f"kill world rank {first} after step {step}, then {second} at the in-job event")
    killer = AtStartKiller(tmp_path, step, first, second)
    killer.start()
    res = run_toy(tmp_path, n=N, steps=STEPS, max_restarts=1, run_args=IN_JOB,
                  FTKIT_LEVELS=LEVELS)
    killer.join(5)
    assert killer.error is None and killer.killed == [first, second], killer.error
    assert res.rc == 0, res.tail()
    lines = res.attempt_lines()
    assert len(lines) == 1 and "succeeded" in lines[0], lines
    recoveries = [e for e in res.events() if e["event"] == "in-job"]
    assert [e["failed"] for e in recoveries] == [[first], [second]], recoveries
    took = recoveries[1]["recovered"] - recoveries[1]["detected"]
    assert took <= 5.0, (took, recoveries)
    _check_bitexact(res, reference)

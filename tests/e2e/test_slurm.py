"""``ftkit run`` inside real Slurm allocations (slurmctld + one slurmd per node n1..n6 on this
host, started by ``slurm/local-cluster.sh``), submitted with ``sbatch --wait`` from the
rendered template.

* A node dies mid-run (its slurmd and tasks killed, then marked DOWN as a real failure shows
  up): the job excludes it, relaunches on the spare, rebuilds from the partner level and ends
  with the failure-free digest; events.jsonl names the failed node and the spare (run
  ``--in-job``: the runtime cannot survive a lost node, so this is in-job's fallback too).
* Two nodes die with one spare: ``scontrol requeue``; the requeued job resumes from the
  newest committed step and ends with the failure-free digest.
* ``--in-job``: a rank dies and the spare node's waiting processes take its node's ranks'
  places in the running job (no relaunch), rebuilt from the partner level, same digest.
* No spare left and ``--shrink``: a node dies, the job goes on with 6 ranks on the 3 healthy
  nodes from the newest PFS step, resharded (events say so), instead of requeueing.
* The time-limit signal: a final checkpoint on every level (PFS included); a later job
  restores it from the PFS alone.

Without root or when the cluster cannot start, the module is skipped — unless
``REQUIRE_SLURM_TESTS=1`` (set by ``.ci/run``), which turns that into a failure.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ftkit.jobdir.events import read_events
from ftkit.slurm.sbatch import SbatchSpec, render_sbatch
from ftkit.testing.procs import rank_processes
from tests.e2e.jobs import REPO, TOY, job_env, run_toy

CLUSTER = REPO / "slurm" / "local-cluster.sh"
NODES = 6
pytestmark = pytest.mark.slow


def _sh(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                          check=False)


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    required = os.environ.get("REQUIRE_SLURM_TESTS") == "1"
    why = None
    if os.geteuid() != 0:
        why = "the local Slurm cluster needs root"
    else:
        up = _sh(str(CLUSTER), "up", str(NODES), timeout=600)
        if up.returncode:
            why = f"slurm/local-cluster.sh up failed:\n{up.stdout[-3000:]}\n{up.stderr[-3000:]}"
    if why:
        if required:
            pytest.fail(why)
        pytest.skip(why)
    yield
    _sh(str(CLUSTER), "down", timeout=120)


@pytest.fixture()
def healthy(cluster: None) -> Iterator[None]:
    """Every node up before and after each test (revives what a test killed)."""
    yield
    _sh(str(CLUSTER), "up", str(NODES), timeout=300)


class Job:
    """One sbatch submission of the toy example; directories under ``tmp``."""

    def __init__(self, tmp: Path, name: str, steps: int, **spec: Any) -> None:
        self.tmp, self.name = tmp, name
        self.out = tmp / f"{name}.out"
        cmd = (sys.executable, str(TOY), "--steps", str(steps), "--seed", "1")
        script = render_sbatch(SbatchSpec(
            command=cmd, nodes=4, tasks_per_node=2, job_name=name, output=str(self.out),
            ftkit=(sys.executable, "-m", "ftkit.cli.main"), **spec))
        self.script = tmp / f"{name}.sbatch"
        self.script.write_text(script)
        self.env = job_env(tmp, FTKIT_JOB="slurm", FTKIT_LEVELS="local:1,partner:1,pfs:5",
                           FTKIT_TIMEOUT="60")
        self.env["FTKIT_LOCAL_DIR"] = str(tmp / "local")
        self.proc: subprocess.Popen[str] | None = None
        self.sbatch_said = ""          # sbatch's own output (job id, its errors)

    def submit(self, *extra: str) -> None:
        self.proc = subprocess.Popen(["sbatch", "--wait", "--parsable", *extra,
                                      str(self.script)], cwd=self.tmp, env=self.env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)

    def wait(self, timeout: float = 600) -> int:
        assert self.proc is not None
        try:
            self.sbatch_said = self.proc.communicate(timeout=timeout)[0] or ""
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _sh("scancel", "--name", self.name)
            raise AssertionError(f"sbatch --wait did not return within {timeout} s\n"
                                 + self.text())
        return self.proc.returncode

    def text(self) -> str:
        """The job's output file, after what sbatch itself printed (a job that failed
        before writing anything says why there)."""
        out = self.out.read_text(errors="replace") if self.out.exists() else "(no output)"
        return f"[sbatch] {self.sbatch_said.strip()}\n{out}"

    def events(self) -> list[dict[str, Any]]:
        path = self.tmp / "pfs" / "slurm" / "events.jsonl"
        return list(read_events(path)) if path.exists() else []

    def records(self, event: str) -> list[dict[str, Any]]:
        out = []
        for line in self.text().splitlines():
            if line.startswith("{") and f'"event": "{event}"' in line:
                out.append(json.loads(line))
        return out

    def until(self, what: str, cond: Callable[[], bool], timeout: float = 300) -> None:
        """Poll the job's own output/events until ``cond`` (a deadline, never a sleep as
        synchronisation: the condition is the job's observable progress)."""
        deadline = time.monotonic() + timeout
        while not cond():
            assert self.proc is not None and self.proc.poll() is None, (
                f"job ended before {what}\n{self.text()}")
            assert time.monotonic() < deadline, f"no {what} within {timeout} s\n{self.text()}"
            time.sleep(0.2)

    def step_reached(self, step: int, attempt: int = 0) -> Callable[[], bool]:
        """Condition: attempt ``attempt`` (counted by its start line) printed ``step``."""
        def cond() -> bool:
            seen = -1
            for line in self.text().splitlines():
                if line.startswith('{"event": "start"'):
                    seen += 1
                elif (seen == attempt and line.startswith('{"event": "step"')
                      and json.loads(line)["step"] >= step):
                    return True
            return False
        return cond

    def slots(self) -> list[str]:
        launches = [e for e in self.events() if e["event"] == "launch"]
        return list(launches[-1]["slots"]) if launches else []


def _kill_node(node: str, local: Path) -> None:
    res = _sh(str(REPO / "slurm" / "kill-node.sh"), node, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    shutil.rmtree(local / node, ignore_errors=True)     # the node's disk is gone with it


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], str]:
    cache: dict[int, str] = {}

    def get(steps: int) -> str:
        if steps not in cache:
            res = run_toy(tmp_path_factory.mktemp(f"ref{steps}"), n=8, steps=steps,
                          max_restarts=0)
            assert res.rc == 0, res.tail()
            cache[steps] = res.done["digest"]
        return cache[steps]
    return get


@pytest.mark.timeout(900)
def test_node_failure_uses_spare(tmp_path: Path, healthy: None,
                                 reference: Callable[[int], str]) -> None:
    """A node dies: the job is relaunched with the spare node in its slot. The job runs
    ``--in-job`` (the spare node holds spare ranks): Open MPI's runtime ends the whole job
    when it loses a node's daemon, so in-job recovery falls back to the relaunch, and the
    attempt line says why (the plain relaunch path: test_two_failures_one_spare_requeue)."""
    job = Job(tmp_path, "ftkit-spare", steps=60, spares=1, in_job=True)
    job.submit("--time=10")
    job.until("step 15", job.step_reached(15))
    victim = job.slots()[2]                      # a node in use that is not the batch node
    _kill_node(victim, tmp_path / "local")
    rc = job.wait()
    assert rc == 0, job.text()
    assert f"the MPI runtime lost its daemon on node {victim}" in job.text(), job.text()
    recoveries = [e for e in job.events() if e["event"] == "nodes"]
    assert len(recoveries) == 1, job.text()
    [nodes] = recoveries
    assert list(nodes["failed"]) == [victim], nodes
    spare = nodes["replaced"][victim]
    assert spare not in job.slots()[:2] and spare != victim, nodes
    assert job.slots()[2] == spare, job.events()
    rebuilds = [e for e in job.events() if e["event"] == "rebuild"]
    assert rebuilds and sorted(rebuilds[0]["from_partner"]) == [4, 5], rebuilds
    assert job.records("done")[-1]["digest"] == reference(60), job.text()
    # step 60 is on the PFS: every node removed its copies at the end (ftkit run's default)
    assert "removed the node-local copies of job slurm on every node" in job.text()
    assert list((tmp_path / "local").glob("*/slurm")) == [], list((tmp_path / "local").rglob("*"))


@pytest.mark.timeout(900)
def test_in_job_rank_failure_moves_its_node_to_the_spare_node(
        tmp_path: Path, healthy: None, reference: Callable[[int], str]) -> None:
    """``--in-job``: the spare node's processes wait as spare ranks. Rank 4 (node slot 2,
    not the batch node) is killed mid-run: its node has no spare, so both of its ranks
    move to the spare node's processes in the running job (one launch, no relaunch; rank
    5's live process becomes a spare), their shards are rebuilt from the partner copies,
    and the job ends with the failure-free digest."""
    job = Job(tmp_path, "ftkit-injob", steps=60, spares=1, in_job=True)
    job.submit("--time=10")
    job.until("step 15", job.step_reached(15))
    pids = rank_processes(tmp_path, [4])
    assert list(pids) == [4], pids
    os.kill(pids[4], signal.SIGKILL)
    rc = job.wait()
    assert rc == 0, job.text()
    events = job.events()
    assert [e["event"] for e in events].count("launch") == 1, job.text()
    [rec] = [e for e in events if e["event"] == "in-job"]
    assert rec["failed"] == [4] and rec["replaced"] == {"4": 8, "5": 9}, rec
    assert rec["moved"] == [5] and rec["spares_left"] == 1, rec
    rebuilds = [e for e in events if e["event"] == "rebuild"]
    assert rebuilds and sorted(rebuilds[0]["from_partner"]) == [4, 5], rebuilds
    assert job.records("done")[-1]["digest"] == reference(60), job.text()
    # slot 2 follows its ranks to the spare node (a requeue would put them there); nothing
    # is left on any node: the old host's copies went when the node moved, the rest at the end
    launched = job.slots()
    slots = json.loads((tmp_path / "pfs" / "slurm" / "slurm-slots.json").read_text())["slots"]
    assert slots[2] not in launched and slots[:2] + slots[3:] == launched[:2] + launched[3:]
    assert list((tmp_path / "local").glob("*/slurm")) == [], list((tmp_path / "local").rglob("*"))


@pytest.mark.timeout(900)
def test_two_failures_one_spare_requeue(tmp_path: Path, healthy: None,
                                        reference: Callable[[int], str]) -> None:
    job = Job(tmp_path, "ftkit-requeue", steps=60, spares=1)
    job.submit("--time=10")
    job.until("step 10", job.step_reached(10))
    first = job.slots()[1]
    _kill_node(first, tmp_path / "local")
    job.until("training on the spare", job.step_reached(1, attempt=1))
    second = job.slots()[3]
    _kill_node(second, tmp_path / "local")
    job.until("the requeue", lambda: any(e["event"] == "requeue" for e in job.events()))
    for node in (first, second):                 # repaired, with empty disks
        _sh(str(REPO / "slurm" / "revive-node.sh"), node, timeout=120)
    rc = job.wait()
    assert rc == 0, job.text()
    [requeue] = [e for e in job.events() if e["event"] == "requeue"]
    assert requeue["ok"] and "out of spare nodes" in requeue["reason"], requeue
    events = job.events()
    requeued = max(i for i, e in enumerate(events) if e["event"] == "launch"
                   and e["attempt"] == 0)            # first launch of the requeued job
    committed = max(e["step"] for e in events[:requeued] if e["event"] == "commit")
    starts = job.records("start")
    # The COMMITTED records are written before the coordinator logs its "commit" event, so a
    # node killed in between leaves the next step committed without its event: the requeued
    # job resumes there, one checkpoint past the last logged commit (every step here).
    assert starts[-1]["step"] in (committed, committed + 1), (committed, starts)
    assert job.records("done")[-1]["digest"] == reference(60), job.text()


@pytest.mark.timeout(900)
def test_node_lost_without_spare_shrinks(tmp_path: Path, healthy: None) -> None:
    """``--shrink``, no spare: after the PFS holds step 10 a node of the 4 dies; ftkit run
    does not requeue but relaunches 6 ranks on the 3 healthy nodes, which restore the newest
    PFS step resharded from 8 ranks (the toy is data-parallel: each new rank loads a DP
    replica; the loader's global position is kept) and train to the end."""
    job = Job(tmp_path, "ftkit-shrink", steps=40, spares=0, shrink=1)
    job.submit("--time=10")
    job.until("step 10 on the PFS", lambda: any(
        e["event"] == "flush" and e["step"] >= 10 for e in job.events()))
    slots = job.slots()
    victim = slots[2]
    _kill_node(victim, tmp_path / "local")
    rc = job.wait()
    assert rc == 0, job.text()
    events = job.events()
    assert not [e for e in events if e["event"] == "requeue"], job.text()
    [nodes] = [e for e in events if e["event"] == "nodes"]
    assert (nodes["action"], list(nodes["failed"])) == ("shrink", [victim]), nodes
    assert (nodes["n_before"], nodes["n"]) == (8, 6), nodes
    launches = [e for e in events if e["event"] == "launch"]
    assert [e["n"] for e in launches] == [8, 6], launches
    assert launches[-1]["slots"] == [n for n in slots if n != victim], launches
    [reshard] = [e for e in events if e["event"] == "reshard"]
    assert (reshard["saved"]["world"], reshard["now"]["world"]) == (8, 6), reshard
    starts = job.records("start")         # a PFS step (every 5th), not older than step 10
    assert reshard["step"] == starts[-1]["step"], (reshard, starts)
    assert reshard["step"] >= 10 and reshard["step"] % 5 == 0, reshard
    assert "--shrink: 8 -> 6 ranks" in job.text()
    assert job.records("done")[-1]["step"] == 40, job.text()


@pytest.mark.timeout(900)
def test_time_limit_signal_final_flush(tmp_path: Path, healthy: None,
                                       reference: Callable[[int], str]) -> None:
    job = Job(tmp_path, "ftkit-limit", steps=100000, spares=0, time="00:01:00",
              signal_seconds=45, requeue=False)
    job.submit()
    rc = job.wait()
    assert rc == 75, (rc, job.text())            # stopped; not requeueable: resubmit
    [stop] = [e for e in job.events() if e["event"] == "stop"]
    step = stop["step"]
    assert "pfs" in stop["levels"] and step > 0, stop
    assert f"stopped on request after committing step {step}" in job.text()
    flushed = [e["step"] for e in job.events() if e["event"] == "flush"]
    assert flushed[-1] == step, flushed
    shutil.rmtree(tmp_path / "local")            # only the PFS copy is left
    res = run_toy(tmp_path, n=8, steps=step + 3, max_restarts=0, FTKIT_JOB="slurm",
                  FTKIT_LEVELS="local:1,partner:1,pfs:5")
    assert res.rc == 0, res.tail()
    assert res.starts[0]["step"] == step, res.tail()
    assert "from the PFS level" in res.stderr
    assert res.done["digest"] == reference(step + 3)

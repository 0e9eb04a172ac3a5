"""A new user's first runs, with ftkit's defaults, on one machine (real ``ftkit run``).

* Default levels (``local:1,partner:1,pfs:50``) on one node: the partner level cannot be
  placed, so it is left out with one warning line, and the run succeeds.
* Without ``FTKIT_JOB`` every ``ftkit run`` is a new job (its id printed): a second run in the
  same directory starts at step 0 instead of resuming the first; ``--resume`` continues the
  job that was active last, from its newest committed step.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.jobs import FTKIT, REPO, job_env

TOY = REPO / "examples" / "toy_dp.py"


def _run(tmp: Path, steps: int, *run_args: str) -> tuple[str, str, list[int], str]:
    """``ftkit run -n 2 [run_args] -- toy --steps S`` with neither FTKIT_JOB nor
    FTKIT_LEVELS; returns (job id, stderr, start steps, the attempt line)."""
    env = job_env(tmp)
    del env["FTKIT_JOB"], env["FTKIT_LEVELS"]
    cmd = [*FTKIT, "run", "-n", "2", "--max-restarts", "0", "--attempt-timeout", "200",
           *run_args, "--", sys.executable, str(TOY), "--steps", str(steps)]
    res = subprocess.run(cmd, check=False, cwd=tmp, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    [job] = re.findall(r"^ftkit run: job (\S+) ", res.stderr, re.MULTILINE)
    starts = [json.loads(ln)["step"] for ln in res.stdout.splitlines()
              if ln.startswith('{"event": "start"')]
    [attempt] = [ln for ln in res.stdout.splitlines() if ln.startswith("ftkit run: attempt")]
    return job, res.stderr, starts, attempt


@pytest.mark.timeout(600)
def test_defaults_on_one_machine_and_one_job_per_run(tmp_path: Path) -> None:
    first, err, starts, _ = _run(tmp_path, 6)
    assert starts == [0] and "(new; to continue it later: ftkit run --resume" in err, err
    warned = [ln for ln in err.splitlines() if "default 'partner' level" in ln]
    assert len(warned) == 1 and "levels are local:1,pfs:50" in warned[0], err
    second, _, starts, _ = _run(tmp_path, 6)
    assert second != first and starts == [0]          # a new job, not a resume of the first
    third, err, starts, attempt = _run(tmp_path, 9, "--resume")
    assert third == second and f"job {second} (continuing it)" in err, err
    assert starts == [6] and "succeeded" in attempt and "(resumed at step 6)" in attempt
    # step 6 is only node-local (pfs:50): kept, and the run says so
    assert (tmp_path / "local" / first).is_dir()


@pytest.mark.timeout(180)
def test_torchrun_without_an_mpi_world_is_refused(tmp_path: Path) -> None:
    """Under real ``torchrun --nproc-per-node 2`` each process is rank 0 of a 1-process MPI
    world: ``Topology.create`` refuses on both, naming the launcher and how to launch."""
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.is_file():
        pytest.skip(f"no torchrun next to {sys.executable}")
    script = tmp_path / "train.py"
    script.write_text("from mpi4py import MPI\nimport ftkit\n"
                      "ftkit.Topology.create(MPI.COMM_WORLD)\nprint('created')\n")
    env = job_env(tmp_path)
    res = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--standalone", str(script)],
                         check=False, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=150)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "created" not in res.stdout, out[-3000:]
    for rank in (0, 1):
        assert (f"ConfigError: this process is one of 2 started by torchrun (WORLD_SIZE=2, "
                f"RANK={rank}), but MPI sees a world of 1 process") in out, out[-3000:]
    assert "launch with `ftkit run -n 2 -- python ...`" in out

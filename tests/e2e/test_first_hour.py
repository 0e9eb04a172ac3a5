"""A new user's first runs, with ftkit's defaults, on one machine (real ``ftkit run``).

* Default levels (``local:1,partner:1,pfs:50``) on one node: the partner level cannot be
  placed, so it is left out with one warning line, and the run succeeds.
* Without ``FTKIT_JOB`` every ``ftkit run`` is a new job (its id printed): a second run in the
  same directory starts at step 0 instead of resuming the first; ``--resume`` continues the
  job that was active last, from its newest committed step.
* A job that ends well leaves no node-local copies behind when its newest committed step is
  on the PFS (every node removes its own), also a named job; otherwise, or with
  ``--keep-local``, they stay and the run says so. Continuing the job restores from the PFS.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.jobs import FTKIT, REPO, job_env, run_toy

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
    # step 6 was not due at pfs:50, but close() flushed the final step: on the PFS, so the
    # first job's node-local copies were removed (and the third run resumed from the PFS)
    assert not (tmp_path / "local" / first).exists()


ENTRIES = ("ftkit.init_torch_distributed(MPI.COMM_WORLD)",
           "ftkit.resilient(lambda comm: ftkit.init_torch_distributed(comm))",
           "ftkit.Topology.create(MPI.COMM_WORLD)")


@pytest.mark.timeout(180)
def test_torchrun_without_an_mpi_world_is_refused(tmp_path: Path) -> None:
    """Under real ``torchrun --nproc-per-node 2`` each process is rank 0 of a 1-process MPI
    world: every entry point a script may call first (``init_torch_distributed``, which the
    README's loop calls before ``Topology.create`` and which would otherwise wait 300 s for a
    rendezvous torchrun's agent store never serves; ``resilient``; ``Topology.create``)
    refuses at once on both, naming the launcher and how to launch. (Each process prints its
    errors, then both meet in a gloo barrier before raising: torchrun SIGTERMs the other
    processes as soon as one fails, which raced a slower process's message.)"""
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.is_file():
        pytest.skip(f"no torchrun next to {sys.executable}")
    script = tmp_path / "train.py"
    script.write_text(
        "import datetime, time\nimport torch.distributed as dist\nfrom mpi4py import MPI\n"
        "import ftkit\n"
        f"for entry in {ENTRIES!r}:\n"
        "    t0 = time.monotonic()\n"
        "    try:\n"
        "        eval(entry)\n"
        "        print('created', flush=True)\n"
        "    except Exception as exc:\n"
        "        print(f'{entry} after {time.monotonic() - t0:.0f} s: '\n"
        "              f'{type(exc).__name__}: {exc}', flush=True)\n"
        "dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=60))\n"
        "dist.barrier()\n"
        "raise SystemExit(1)\n")
    env = job_env(tmp_path)
    res = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--standalone", str(script)],
                         check=False, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=150)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "created" not in res.stdout, out[-3000:]
    for entry in ENTRIES:
        for rank in (0, 1):
            found = re.findall(rf"^{re.escape(entry)} after (\d+) s: ConfigError: this process "
                               rf"is one of 2 started by torchrun \(WORLD_SIZE=2, RANK={rank}\), "
                               rf"but MPI sees a world of 1 process", res.stdout, re.MULTILINE)
            assert found and int(found[0]) <= 5, (entry, rank, out[-3000:])
    assert "launch with `ftkit run -n 2 -- python ...`" in out


@pytest.mark.timeout(600)
def test_a_finished_job_leaves_no_node_local_copies(
        tmp_path: Path, reference_digest: Callable[..., str]) -> None:
    """A named job (FTKIT_JOB=e2e), 4 ranks on 2 nodes: step 6 is on the PFS at the end, so
    both nodes remove their copies; continuing it restores step 6 from the PFS, bit-exact, and
    ends at step 9, which is not due at pfs:4 but flushed by ``close()``: removed too, and
    said; --keep-local keeps."""
    res = run_toy(tmp_path, steps=6, max_restarts=0, keep_local=False,
                  FTKIT_LEVELS="local:1,partner:1,pfs:3")
    assert res.rc == 0, res.tail()
    assert ("ftkit run: removed the node-local copies of job e2e on every node (step 6 is on "
            "the PFS") in res.stdout, res.tail()
    assert not res.local.exists() and (tmp_path / "local").is_dir()
    res = run_toy(tmp_path, steps=9, max_restarts=0, keep_local=False,
                  FTKIT_LEVELS="local:1,partner:1,pfs:4")
    assert res.rc == 0, res.tail()
    assert res.starts[0]["step"] == 6 and "from the PFS level" in res.stderr, res.tail()
    assert res.done["digest"] == reference_digest(4, 9)
    assert ("ftkit run: removed the node-local copies of job e2e on every node (step 9 is on "
            "the PFS") in res.stdout, res.tail()
    assert [e["step"] for e in res.events() if e["event"] == "flush"][-2:] == [8, 9]
    assert not res.local.exists()
    res = run_toy(tmp_path, steps=12, max_restarts=0, FTKIT_LEVELS="local:1,partner:1,pfs:3")
    assert res.rc == 0 and res.starts[0]["step"] == 9, res.tail()
    assert "removed" not in res.stdout and (res.local / "node-1" / "step-12").is_dir()

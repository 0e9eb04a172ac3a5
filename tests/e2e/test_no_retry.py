"""Real ``ftkit run`` jobs: errors that would recur are not retried, starting over is an
explicit choice made once, and ``ftkit clean`` removes a real job's trees."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.e2e.jobs import FTKIT, TOY, job_env, run_example, run_toy

#: A training script that configures ftkit in code, badly: every rank's Config.load (inside
#: Checkpointer) raises ConfigError. ``ftkit run`` itself never sees the bad value.
_BAD_LEVELS = f"""
import os, runpy
os.environ["FTKIT_LEVELS"] = "bogus:1"
runpy.run_path({str(TOY)!r}, run_name="__main__")
"""


@pytest.mark.timeout(300)
def test_config_error_in_the_ranks_is_not_retried(tmp_path: Path) -> None:
    script = tmp_path / "bad_levels.py"
    script.write_text(_BAD_LEVELS)
    res = run_example(tmp_path, script, n=4, ranks_per_node=2, max_restarts=3,
                      attempt_timeout=120, timeout=280, args=("--steps", "4"))
    lines = res.attempt_lines()
    assert res.rc == 3, res.tail()
    assert len(lines) == 1, res.tail()
    assert "failed: not retried: ConfigError: FTKIT_LEVELS: unknown level 'bogus'" in lines[0]
    assert "(rank " in lines[0]
    events = res.events()
    assert [e["event"] for e in events if e["event"] in ("launch", "relaunch")] == ["launch"]
    gave_up = events[-1]
    assert (gave_up["event"], gave_up["status"], gave_up["retry"], gave_up["kind"]) == \
        ("gave-up", 3, False, "ConfigError")
    assert isinstance(gave_up["rank"], int) and 0 <= gave_up["rank"] < 4
    assert not list((res.pfs / "e2e").glob("attempt-*.fatal"))      # cleaned up


@pytest.mark.timeout(600)
def test_fresh_start_is_made_once_and_its_relaunch_resumes(tmp_path: Path) -> None:
    """A first run commits steps 1-4. ``FTKIT_START=fresh`` starts over at step 0; attempt 0
    is killed in step 3's commit phase, and attempt 1 resumes at what the fresh run committed
    (step 2), not at the first run's step 4 and not at 0 again."""
    first = run_toy(tmp_path, steps=4, max_restarts=0)
    assert first.rc == 0, first.tail()
    res = run_toy(tmp_path, steps=6, max_restarts=1, FTKIT_START="fresh",
                  FTKIT_FAULTS="kill:rank=1:step=3:phase=vote")
    assert res.rc == 0, res.tail()
    assert [(s["attempt"], s["step"]) for s in res.starts] == [(0, 0), (1, 2)], res.tail()
    launches = [e for e in res.events() if e["event"] == "launch"]
    assert [e["start"] for e in launches][-2:] == ["fresh", "resume"]


@pytest.mark.timeout(300)
def test_clean_removes_a_real_job(tmp_path: Path) -> None:
    res = run_toy(tmp_path, steps=2, max_restarts=0, FTKIT_LEVELS="local:1,pfs:2")
    assert res.rc == 0, res.tail()
    assert (res.pfs / "e2e" / "step-2" / "COMMITTED").is_file()
    assert (res.local / "node-1" / "step-2").is_dir()
    clean = subprocess.run([*FTKIT, "clean", "e2e"], cwd=tmp_path, env=job_env(tmp_path),
                           capture_output=True, text=True, timeout=60, check=False)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert f"removed {res.pfs / 'e2e'} (" in clean.stdout
    assert f"removed {res.local} (" in clean.stdout
    assert not (res.pfs / "e2e").exists() and not res.local.exists()


#: Every rank saves every step, except that rank 1 skips ``save(SKIP)``.
_SKIPS_A_SAVE = """
import sys
import numpy as np
from mpi4py import MPI
import ftkit
skip, steps = int(sys.argv[1]), int(sys.argv[2])
comm = MPI.COMM_WORLD
ckpt = ftkit.Checkpointer(ftkit.Topology.create(comm))
state = {"w": np.zeros(64)}
step = ckpt.restore(state)
while step < steps:
    step += 1
    state["w"] += 1
    comm.Barrier()
    if not (comm.rank == 1 and step == skip):
        ckpt.save(step, state)
ckpt.close()
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("skip,instead", [(3, "save(4)"), (5, "close()")])
def test_a_rank_that_skips_a_save_is_named_and_not_retried(tmp_path: Path, skip: int,
                                                           instead: str) -> None:
    """Rank 1 skips ``save(3)`` (then calls ``save(4)``) or the last ``save(5)`` (then
    ``close()``): at once, every rank stops with one line naming rank 1 and the save it did
    not call, and ``ftkit run`` does not relaunch (before: retried, and the skipped last
    save waited FTKIT_TIMEOUT, reported as a peer dead or hung)."""
    script = tmp_path / "skips.py"
    script.write_text(_SKIPS_A_SAVE)
    res = run_example(tmp_path, script, n=2, ranks_per_node=1, max_restarts=3,
                      attempt_timeout=120, timeout=280, args=(str(skip), "5"),
                      FTKIT_LEVELS="local:1,partner:1")
    lines = res.attempt_lines()
    assert res.rc == 3 and len(lines) == 1, res.tail()
    assert (f"failed: not retried: ProtocolMismatch: rank 1 did not call save({skip}) (rank 1 "
            f"called {instead} while rank 0 called save({skip}))") in lines[0], lines

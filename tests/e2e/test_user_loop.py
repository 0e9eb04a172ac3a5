"""A PyTorch user's own loop (examples/ddp_loop.py: DDP with its defaults, AdamW with an LR
schedule, an EMA, dropout, an eval pass, torchdata's StatefulDataLoader over a
DistributedSampler, no loader generator or one of its own, 0 or 2 workers, forked or started
by a forkserver), 2 or 4 ranks, one per node, with ``local:1,partner:1``: rank 1 SIGKILLed
from outside in the middle of an epoch; ``ftkit run`` relaunches it and the run ends with the
uninterrupted run's model, optimizer, schedule, EMA and generators (digest parts), the
loader's state too.

Before: the loader's base-seed draw of the resumed epoch came from torch's global generator
after ftkit had restored it, and dropout diverged from the first resumed step; with 4 ranks
the resumed DDP summed gradients in another order (its buckets not yet rebuilt) and the model
drifted in the last bits; a forkserver loader's workers initialised MPI and hung the job.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ftkit.testing.procs import rank_processes
from tests.e2e.jobs import FTKIT, REPO, job_env, run_example
from tests.e2e.test_in_job import Killer

pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is not installed")
SCRIPT = REPO / "examples" / "ddp_loop.py"
STEPS, KILL_AT = 40, 21             # 16 (2 ranks) or 8 (4 ranks) batches per epoch: mid-epoch
LEVELS = "local:1,partner:1"


def _digests(out: str) -> dict[str, str]:
    done = [json.loads(ln) for ln in out.splitlines() if ln.startswith('{"event": "done"')]
    assert done, out[-3000:]
    return done[-1]["digest_parts"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("n,workers,generator,context", [
    (4, 0, False, None), (2, 2, False, None), (2, 0, True, None), (2, 2, True, "forkserver")])
def test_user_loop_killed_mid_epoch_resumes_bit_exact(tmp_path: Path, n: int, workers: int,
                                                      generator: bool, context: str | None
                                                      ) -> None:
    args = ("--steps", str(STEPS), "--workers", str(workers),
            *(("--generator",) if generator else ()),
            *(("--context", context) if context else ()))
    (tmp_path / "ref").mkdir()
    ref = run_example(tmp_path / "ref", SCRIPT, n=n, args=args, ranks_per_node=1,
                      timeout=300, FTKIT_LEVELS=LEVELS)
    assert ref.rc == 0, ref.tail()
    want = _digests(ref.stdout)
    run = tmp_path / "run"
    run.mkdir()
    cmd = [*FTKIT, "run", "-n", str(n), "--ranks-per-node", "1", "--max-restarts", "2",
           "--attempt-timeout", "300", "--", sys.executable, str(SCRIPT), *args]
    proc = subprocess.Popen(cmd, cwd=run, env=job_env(run, FTKIT_LEVELS=LEVELS),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines, killed = [], None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if killed is None and line.startswith(f'{{"event": "step", "step": {KILL_AT},'):
                killed = rank_processes(run, [1]).get(1)
                assert killed is not None
                os.kill(killed, signal.SIGKILL)
        _out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    out = "".join(lines)
    assert killed is not None and proc.returncode == 0, (out[-3000:], err[-3000:])
    attempts = [ln for ln in out.splitlines() if ln.startswith("ftkit run: attempt")]
    assert len(attempts) == 2 and "failed" in attempts[0], attempts
    assert "failed (exit 137: rank 1 killed by SIGKILL on node " in attempts[0], attempts
    assert attempts[0].endswith("relaunching in 2 s (restart 1 of 2)"), attempts  # default
    starts = [json.loads(ln)["step"] for ln in out.splitlines()
              if ln.startswith('{"event": "start"')]
    assert starts[0] == 0 and 16 < starts[1] <= KILL_AT, starts    # resumed mid-epoch
    assert "succeeded after" in attempts[1], attempts
    assert f"(resumed at step {starts[1]})" in attempts[1], attempts
    got = _digests(out)
    for part in ("model", "optim", "sched", "ema", "rng", "data"):
        assert got[part] == want[part], (part, got, want)


@pytest.mark.timeout(300)
def test_plain_dataloader_is_refused_before_the_first_step(tmp_path: Path) -> None:
    """The same loop with a plain DataLoader in the state: ``restore()`` refuses it on every
    rank before any step, ``ftkit run`` does not retry (exit 3), and the one attempt line
    names the leaf and what to use instead."""
    res = run_example(tmp_path, SCRIPT, n=2, args=("--steps", "8", "--plain"),
                      ranks_per_node=1, max_restarts=3, timeout=240, FTKIT_LEVELS=LEVELS)
    assert res.rc == 3, res.tail()
    lines = res.attempt_lines()
    assert len(lines) == 1, lines
    assert "failed: not retried: UnsupportedStateError: rank 0: cannot checkpoint this " \
           "state: state['data'] is a plain torch.utils.data.DataLoader" in lines[0], lines
    assert not [ln for ln in res.stdout.splitlines() if ln.startswith('{"event": "step"')]


@pytest.mark.timeout(600)
def test_user_loop_recovers_in_job_when_node_leaders_with_loader_workers_die(
        tmp_path: Path) -> None:
    """The same loop with 2 loader workers per rank, 4 working ranks in virtual nodes of 2
    plus 2 spares under ``--in-job``: rank 3 is killed, then rank 2, the leader of node 1
    (its forked workers still hold the node's lock for a moment). Both are replaced in the
    job, without a relaunch, and the run ends with the failure-free run's digest parts.

    Before: the second kill ended the job (``JobLockedError``: the dead leader's workers
    held the lock) and it was not retried."""
    args = ("--steps", str(STEPS), "--workers", "2")
    (tmp_path / "ref").mkdir()
    ref = run_example(tmp_path / "ref", SCRIPT, n=4, args=args, timeout=300,
                      FTKIT_LEVELS=LEVELS)
    assert ref.rc == 0, ref.tail()
    killer = Killer(tmp_path, [(8, [3]), (16, [2])])
    killer.start()
    res = run_example(tmp_path, SCRIPT, n=4, args=args, timeout=400,
                      run_args=("--in-job", "--spares", "2"), FTKIT_LEVELS=LEVELS)
    killer.join(timeout=60)
    assert killer.error is None and len(killer.killed) == 2, (killer.error, res.tail())
    assert res.rc == 0, res.tail()
    assert len(res.attempt_lines()) == 1 and "succeeded" in res.attempt_lines()[0], res.tail()
    assert [e["failed"] for e in res.events() if e["event"] == "in-job"] == [[3], [2]], \
        res.tail()
    got, want = _digests(res.stdout), _digests(ref.stdout)
    for part in ("model", "optim", "sched", "ema", "rng", "data"):
        assert got[part] == want[part], (part, got, want)

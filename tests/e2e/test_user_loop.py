"""A PyTorch user's own loop (examples/ddp_loop.py: DDP, AdamW, dropout, torchdata's
StatefulDataLoader over a DistributedSampler, no loader generator or one of its own, 0 or 2
workers), 2 ranks on 2 nodes with ``local:1,partner:1``: rank 1 SIGKILLed from outside in the
middle of an epoch; ``ftkit run`` relaunches it and the run ends with the uninterrupted run's
model, optimizer state and generators (digest parts), the loader's state too.

Before: the loader's base-seed draw of the resumed epoch came from torch's global generator
after ftkit had restored it, and dropout diverged from the first resumed step.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.jobs import FTKIT, REPO, job_env, run_example

pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is not installed")
SCRIPT = REPO / "examples" / "ddp_loop.py"
STEPS, KILL_AT = 40, 21             # 16 batches per epoch: the kill comes in the second epoch
LEVELS = "local:1,partner:1"


def _rank_pid(rank: int, mark: bytes) -> int | None:
    """The pid of rank ``rank``'s main process of the job whose environment holds ``mark``
    (not a DataLoader worker: its parent is not a process of that rank)."""
    want = f"OMPI_COMM_WORLD_RANK={rank}\0".encode()
    found: dict[int, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if mark in env and want in env:
            found[int(pid)] = ppid
    mains = [pid for pid, ppid in found.items() if ppid not in found]
    return mains[0] if len(mains) == 1 else None


def _digests(out: str) -> dict[str, str]:
    done = [json.loads(ln) for ln in out.splitlines() if ln.startswith('{"event": "done"')]
    assert done, out[-3000:]
    return done[-1]["digest_parts"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("generator", [False, True])
def test_user_loop_killed_mid_epoch_resumes_bit_exact(tmp_path: Path, workers: int,
                                                      generator: bool) -> None:
    args = ("--steps", str(STEPS), "--workers", str(workers),
            *(("--generator",) if generator else ()))
    (tmp_path / "ref").mkdir()
    ref = run_example(tmp_path / "ref", SCRIPT, n=2, args=args, ranks_per_node=1,
                      timeout=300, FTKIT_LEVELS=LEVELS)
    assert ref.rc == 0, ref.tail()
    want = _digests(ref.stdout)
    run = tmp_path / "run"
    run.mkdir()
    cmd = [*FTKIT, "run", "-n", "2", "--ranks-per-node", "1", "--max-restarts", "2",
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
                killed = _rank_pid(1, str(run).encode())
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
    assert starts[0] == 0 and 16 < starts[1] <= KILL_AT, starts    # resumed mid-epoch 2
    assert "succeeded after" in attempts[1], attempts
    assert f"(resumed at step {starts[1]})" in attempts[1], attempts
    got = _digests(out)
    for part in ("model", "optim", "rng", "data"):
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

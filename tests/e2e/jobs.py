"""Launch real jobs with ``ftkit run`` for end-to-end tests."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ftkit.jobdir.events import read_events

REPO = Path(__file__).resolve().parents[2]
TOY = REPO / "examples" / "toy_dp.py"
NUMPY_TOY = REPO / "examples" / "toy_numpy.py"      # the same job without torch: starts in ~2 s
FTKIT = [sys.executable, "-m", "ftkit.cli.main"]


@dataclasses.dataclass
class Result:
    rc: int
    stdout: str
    stderr: str
    seconds: float
    pfs: Path
    local: Path

    def json_lines(self) -> list[dict[str, Any]]:
        out = []
        for line in self.stdout.splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return out

    @property
    def done(self) -> dict[str, Any]:
        dones = [r for r in self.json_lines() if r.get("event") == "done"]
        assert dones, f"no done line (rc {self.rc})\n{self.tail()}"
        return dones[-1]

    @property
    def starts(self) -> list[dict[str, Any]]:
        return [r for r in self.json_lines() if r.get("event") == "start"]

    def attempt_lines(self) -> list[str]:
        """``ftkit run``'s attempt lines, also one that a rank's unterminated output (a
        process killed mid-line) left in the middle of a line."""
        head = "ftkit run: attempt"
        return [head + ln.split(head, 1)[1] for ln in self.stdout.splitlines() if head in ln]

    def events(self, job: str = "e2e") -> list[dict[str, Any]]:
        return list(read_events(self.pfs / job / "events.jsonl"))

    def committed(self, attempt: int, job: str = "e2e") -> list[int]:
        """Steps the coordinator reported committed (``commit`` events) in ``attempt``."""
        return [e["step"] for e in self.events(job)
                if e["event"] == "commit" and e.get("attempt") == attempt]

    def tail(self, n: int = 4000) -> str:
        return f"--- stdout ---\n{self.stdout[-n:]}\n--- stderr ---\n{self.stderr[-n:]}"


def tree_digests(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under ``root`` (empty when it does not exist)
    but the job locks (``LOCK``: every holder describes itself there; not checkpoint data):
    compare two listings to show that nothing was deleted, added or changed."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "LOCK"}


def job_env(tmp: Path, **ftkit_env: str) -> dict[str, str]:
    """Environment for a job whose directories live under ``tmp``. Flushes wait for each
    other (``FTKIT_PFS_BACKPRESSURE=wait``) unless a test says otherwise: the toy's steps
    take a few ms and a flush ~0.1 s, so the default ``delay`` would make which steps reach
    the PFS depend on timing, and these tests assert exact PFS steps (the ``delay`` policy
    is tested where a held flush makes it deterministic: tests/mpi/test_mpi_backpressure.py)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTKIT_")}
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "FTKIT_JOB": "e2e", "FTKIT_LOCAL_DIR": str(tmp / "local"),
                "FTKIT_PFS_DIR": str(tmp / "pfs"), "FTKIT_LEVELS": "local:1",
                "FTKIT_TIMEOUT": "30", "FTKIT_PFS_BACKPRESSURE": "wait"})
    env.update(ftkit_env)
    return env


def run_toy(tmp: Path, *, n: int = 4, steps: int = 8, seed: int = 1, ranks_per_node: int = 2,
            max_restarts: int = 2, attempt_timeout: int = 240, timeout: int = 600,
            extra: tuple[str, ...] = (), run_args: tuple[str, ...] = (),
            keep_local: bool = True, script: Path = TOY, **ftkit_env: str) -> Result:
    """``ftkit run`` the toy example (``script``: TOY, or NUMPY_TOY); returns its outcome
    (never hangs past ``timeout``). ``extra``: more arguments of the toy; ``run_args``: more
    options of ``ftkit run``."""
    return run_example(tmp, script, n=n, args=("--steps", str(steps), "--seed", str(seed), *extra),
                       ranks_per_node=ranks_per_node, max_restarts=max_restarts,
                       attempt_timeout=attempt_timeout, timeout=timeout, run_args=run_args,
                       env=ftkit_env, keep_local=keep_local)


def run_example(tmp: Path, script: str | Path, *, n: int, args: tuple[str, ...] = (),
                ranks_per_node: int = 2, max_restarts: int = 0, attempt_timeout: int = 300,
                timeout: int = 900, run_args: tuple[str, ...] = (),
                env: dict[str, str] | None = None, keep_local: bool = True,
                **ftkit_env: str) -> Result:
    """``ftkit run -n n [run_args]`` ``script`` (a path, or a name under ``examples/``) with
    ``args``; ``env`` and ``ftkit_env`` add FTKIT_* variables. ``keep_local``: pass
    ``--keep-local`` (most tests look at or reuse a finished job's node-local copies).
    Returns the outcome (never hangs past ``timeout``)."""
    path = Path(script) if Path(script).is_absolute() else REPO / "examples" / script
    cmd = [*FTKIT, "run", "-n", str(n), "--ranks-per-node", str(ranks_per_node),
           "--max-restarts", str(max_restarts), "--attempt-timeout", str(attempt_timeout),
           "--restart-delay", "0",          # relaunch at once: these tests judge, not wait
           *(("--keep-local",) if keep_local else ()), *run_args,
           "--", sys.executable, str(path), *args]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, check=False, cwd=tmp,
                          env=job_env(tmp, **{**(env or {}), **ftkit_env}),
                          capture_output=True, text=True, timeout=timeout)
    return Result(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0,
                  tmp / "pfs", tmp / "local" / "e2e")

"""A randomized chaos soak: real ``ftkit run`` jobs hit from outside, each checked bit-exact.

    .venv/bin/python scripts/chaos.py --runs 30 --seed 1 [--out /tmp/chaos.json]

Every run draws a mode (relaunch, or ``--in-job`` with 2 spares), async or sync checkpoints,
levels (``local:1`` plus ``partner:1`` or ``xor:1`` and often ``pfs:k``) and one to three
faults, then runs the toy (4 ranks in virtual nodes of 2, 24 steps) under ``ftkit run`` while
a thread acts on the job from outside once chosen steps are committed (the job's event log
says so):

* ``kill`` — SIGKILL one rank; ``double`` — SIGKILL two ranks of different nodes at once;
* ``node`` — SIGKILL both ranks of a node and remove its node-local directory (only with a
  redundancy level);
* ``hang`` — SIGSTOP one rank (``FTKIT_TIMEOUT`` or the in-job heartbeat must end it);
* ``corrupt`` — flip one byte of a committed node-local shard or partner copy;
* ``launcher`` — SIGKILL ``ftkit run`` itself (its job must end with it), then ``ftkit run
  --resume`` continues the job.

A run passes when ``ftkit run`` (the last one, after a ``launcher`` fault) exits 0 within
its limit and the final digest equals a failure-free run's; a run that did not end in time
is a hang. Prints one line per run and a summary; exit status 1 on any failure or hang.
Leaves nothing behind (every process of a run is killed at its end; its directory removed
unless ``--keep``). Runs one at a time: two MPI jobs at once make both slow.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ftkit.jobdir.events import read_events
from ftkit.testing.procs import rank_processes

TOY = REPO / "examples" / "toy_dp.py"
FTKIT = [sys.executable, "-m", "ftkit.cli.main"]
N, PER_NODE, SPARES, STEPS = 4, 2, 2, 24
RUN_LIMIT = 420.0                      # seconds one run may take before it is a hang
FAULTS = ("kill", "double", "node", "hang", "corrupt", "launcher")


@dataclass
class Plan:
    """What one run does."""

    mode: str
    async_: bool
    levels: str
    faults: list[tuple[int, str]]          # (after the commit of step, fault)


@dataclass
class Outcome:
    run: int
    plan: dict[str, Any]
    ok: bool
    hang: bool
    seconds: float
    rc: int | None
    acted: list[str] = field(default_factory=list)
    why: str = ""


def draw(rng: random.Random) -> Plan:
    """A random plan (pure but for ``rng``)."""
    mode = rng.choice(["relaunch", "in-job"])
    redundancy = rng.choice(["partner:1", "xor:1"])
    levels = f"local:1,{redundancy}" + (f",pfs:{rng.choice([3, 5])}" if rng.random() < 0.6
                                        else "")
    kinds = rng.sample(FAULTS, rng.randint(1, 3))
    steps = sorted(rng.sample(range(3, STEPS - 2), len(kinds)))
    return Plan(mode, rng.random() < 0.5, levels, list(zip(steps, kinds)))


class Actor(threading.Thread):
    """Acts ``plan``'s faults on the job in ``tmp`` once their steps are committed."""

    def __init__(self, tmp: Path, plan: Plan, rng: random.Random,
                 launcher: subprocess.Popen[str]) -> None:
        super().__init__(daemon=True)
        self.tmp, self.plan, self.rng, self.launcher = tmp, plan, rng, launcher
        self.acted: list[str] = []
        self.stopped: list[int] = []
        self.done = threading.Event()

    def run(self) -> None:
        events = self.tmp / "pfs" / "chaos" / "events.jsonl"
        seen = 0
        for step, kind in self.plan.faults:
            while not self.done.is_set():
                got = list(read_events(events))
                if any(e.get("event") == "commit" and e.get("step", -1) >= step
                       for e in got[seen:]):
                    break
                time.sleep(0.02)
            if self.done.is_set():
                return
            seen = len(list(read_events(events)))
            try:
                self.acted.append(f"{kind}@{step}: {self._act(kind)}")
            except Exception as exc:  # noqa: BLE001 - a fault that could not be acted
                self.acted.append(f"{kind}@{step}: not acted ({exc!r})")
            if kind == "launcher":
                return

    def _act(self, kind: str) -> str:
        if kind == "launcher":
            self.launcher.send_signal(signal.SIGKILL)
            return "ftkit run SIGKILLed"
        if kind == "corrupt":
            return self._corrupt()
        working = range(N + (SPARES if self.plan.mode == "in-job" else 0))
        live = rank_processes(self.tmp, list(working))
        if kind == "node":
            node = self.rng.randrange(N // PER_NODE)
            ranks = [r for r in range(node * PER_NODE, (node + 1) * PER_NODE) if r in live]
            for r in ranks:
                os.kill(live[r], signal.SIGKILL)
            shutil.rmtree(self.tmp / "local" / "chaos" / f"node-{node}", ignore_errors=True)
            return f"node {node} (ranks {ranks}) killed and wiped"
        if kind == "double":
            a = self.rng.choice([r for r in range(N) if r in live])
            others = [r for r in range(N) if r in live and r // PER_NODE != a // PER_NODE]
            ranks = [a] + ([self.rng.choice(others)] if others else [])
            for r in ranks:
                os.kill(live[r], signal.SIGKILL)
            return f"ranks {ranks} killed"
        r = self.rng.choice([r for r in range(N) if r in live])
        if kind == "hang":
            os.kill(live[r], signal.SIGSTOP)
            self.stopped.append(live[r])
            return f"rank {r} stopped"
        os.kill(live[r], signal.SIGKILL)
        return f"rank {r} killed"

    def _corrupt(self) -> str:
        files = [p for p in (self.tmp / "local" / "chaos").glob("node-*/step-*/*.ftk")
                 if (p.parent / "COMMITTED").exists()]
        if not files:
            return "no committed shard"
        path = self.rng.choice(sorted(files))
        with open(path, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            at = self.rng.randrange(size)
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))
        return f"byte {at} of {path.relative_to(self.tmp)} flipped"


def _env(tmp: Path, plan: Plan) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTKIT_")}
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "FTKIT_JOB": "chaos", "FTKIT_LOCAL_DIR": str(tmp / "local"),
                "FTKIT_PFS_DIR": str(tmp / "pfs"), "FTKIT_LEVELS": plan.levels,
                "FTKIT_ASYNC": "1" if plan.async_ else "0", "FTKIT_TIMEOUT": "20",
                "FTKIT_HEARTBEAT": "8", "FTKIT_XOR_SET": "2"})
    return env


def _launch(tmp: Path, plan: Plan, resume: bool) -> subprocess.Popen[str]:
    mode = ["--in-job", "--spares", str(SPARES)] if plan.mode == "in-job" else []
    cmd = [*FTKIT, "run", "-n", str(N), "--ranks-per-node", str(PER_NODE), *mode,
           "--max-restarts", "4", "--restart-delay", "0", "--attempt-timeout", "300",
           *(["--resume", "chaos"] if resume else []), "--",
           sys.executable, str(TOY), "--steps", str(STEPS), "--seed", "1"]
    return subprocess.Popen(cmd, cwd=tmp, env=_env(tmp, plan), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _reap(tmp: Path) -> None:
    """SIGKILL every process that still runs in ``tmp`` (a stopped rank, a hung job)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd") == str(tmp):
                os.kill(int(pid), signal.SIGCONT)
                os.kill(int(pid), signal.SIGKILL)
        except OSError:
            continue


def _digest(out: str) -> str | None:
    for line in reversed(out.splitlines()):
        if line.startswith('{"event": "done"'):
            return str(json.loads(line)["digest"])
    return None


def one_run(index: int, plan: Plan, rng: random.Random, reference: str | None,
            keep: bool) -> tuple[Outcome, str | None]:
    """Run ``plan`` (no faults: the reference) and judge it."""
    tmp = Path(tempfile.mkdtemp(prefix=f"ftkit-chaos-{index}-"))
    t0 = time.monotonic()
    proc = _launch(tmp, plan, resume=False)
    actor = Actor(tmp, plan, rng, proc)
    actor.start()
    rc, out, hang = _wait(proc, t0)
    actor.done.set()
    if not hang and any(a.startswith("launcher") for a in actor.acted):
        _wait_gone(tmp)
        proc = _launch(tmp, plan, resume=True)
        rc, out, hang = _wait(proc, t0)
    seconds = time.monotonic() - t0
    _reap(tmp)
    digest = _digest(out) if rc == 0 else None
    ok = not hang and rc == 0 and digest is not None and digest == (reference or digest)
    why = "" if ok else ("hang" if hang else f"rc {rc}" if rc else
                         f"digest {digest} != {reference}")
    if not keep and ok:
        shutil.rmtree(tmp, ignore_errors=True)
    elif not ok:
        (tmp / "ftkit-run.out").write_text(out)
        why += f" (kept: {tmp})"
    return Outcome(index, asdict(plan), ok, hang, round(seconds, 1), rc, actor.acted,
                   why), digest


def _wait(proc: subprocess.Popen[str], t0: float) -> tuple[int | None, str, bool]:
    try:
        out, err = proc.communicate(timeout=max(1.0, RUN_LIMIT - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out + err, True
    return proc.returncode, out + err[-20000:], False


def _wait_gone(tmp: Path) -> None:
    """After ``ftkit run`` was killed: its job ends with it (parent-death signal)."""
    until = time.monotonic() + 60
    while time.monotonic() < until and rank_processes(tmp, list(range(N + SPARES))):
        time.sleep(0.1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="write the outcomes as JSON")
    ap.add_argument("--keep", action="store_true", help="keep every run's directory")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    print(f"chaos: seed {seed}, {args.runs} runs", flush=True)
    ref, reference = one_run(0, Plan("relaunch", True, "local:1", []), rng, None, False)
    if not ref.ok or reference is None:
        print(f"chaos: the failure-free run failed: {ref.why}")
        return 1
    outcomes = []
    for i in range(1, args.runs + 1):
        plan = draw(rng)
        res, _ = one_run(i, plan, rng, reference, args.keep)
        outcomes.append(res)
        print(f"run {i:3d} {'ok  ' if res.ok else 'FAIL'} {res.seconds:6.1f} s  {plan.mode:8s} "
              f"{'async' if plan.async_ else 'sync '} {plan.levels:24s} {'; '.join(res.acted)}"
              + (f"  -- {res.why}" if res.why else ""), flush=True)
    faults = sum(len(o.acted) for o in outcomes)
    good = sum(o.ok for o in outcomes)
    hangs = sum(o.hang for o in outcomes)
    print(f"chaos: {good} of {len(outcomes)} bit-exact, {hangs} hangs, {faults} faults acted, "
          f"seed {seed}")
    if args.out:
        args.out.write_text(json.dumps({"seed": seed, "reference": reference,
                                        "runs": [asdict(o) for o in outcomes]}, indent=1))
    return 0 if good == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())

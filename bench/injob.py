"""In-job recovery against a relaunch: time from a rank's death to the first training step
committed again, same example, same ranks, alternating rounds.

    python bench/injob.py [--example toy|hp_gpt] [--ranks 8] [--repeat 5] [--steps 40]
                          [--hidden N] [--lose rank|node] [--out DIR]

Every round is one real job of the example (``examples/toy_dp.py``, or ``examples/hp_gpt.py``
as dp2 x tp2 x pp2 at 8 ranks: dp is ``ranks / 4``) on ``--ranks`` working ranks in
virtual nodes of 2 (``FTKIT_LEVELS=local:1,partner:1``, node-local directories in a private
temporary directory), killed from outside: once step ``K`` (random, 8..steps-10) is
committed (``commit`` event), the benchmark SIGKILLs one random working rank's process and
notes the wall clock (``--lose node``: both ranks of that rank's virtual node, and then
removes the node's node-local directory: a lost node; ``--hidden``: the toy's width, so its
state per rank is about ``216 x hidden`` bytes). Two kinds of round, alternating:

* ``in_job``: ``ftkit run --in-job --spares 2``; recovered = the ``in-job-step`` event (the
  first step committed after the spare took the rank's place, same processes);
* ``relaunch``: ``ftkit run --max-restarts 1``; recovered = the first ``commit`` event of
  attempt 1 (new mpiexec, interpreters, torch, MPI, gloo, restore, one step).

Both figures include the step trained again after the restore. Prints the median, min and
max of each and their ratio; writes ``injob.json`` (``injob_hp_gpt.json`` for hp_gpt). Every
round must print the same loss at every step (a step trained again included) and end with
the same digest as the others (else the benchmark fails).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ftkit.jobdir.events import read_events
from ftkit.testing.procs import rank_processes

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


def example_command(example: str, ranks: int, steps: int, hidden: int | None = None
                    ) -> list[str]:
    """The training command of one round (seeded: every round trains the same steps);
    ``hidden``: the toy's hidden width (its state is about 216 bytes per unit: weights,
    gradients' Adam moments)."""
    if example == "toy":
        return [str(EXAMPLES / "toy_dp.py"), "--steps", str(steps), "--seed", "1",
                *(["--hidden", str(hidden)] if hidden else [])]
    if ranks % 4:
        raise SystemExit(f"hp_gpt runs tp2 x pp2: --ranks {ranks} is not a multiple of 4")
    return [str(EXAMPLES / "hp_gpt.py"), "--dp", str(ranks // 4), "--tp", "2", "--pp", "2",
            "--steps", str(steps), "--seed", "3"]


def _losses(out: str) -> dict[int, float]:
    """Every printed loss by step; a step trained again after the recovery must print the
    loss it printed before (else the benchmark fails)."""
    seen: dict[int, float] = {}
    for line in out.splitlines():
        if line.startswith('{"event": "step"'):
            rec = json.loads(line)
            if seen.setdefault(rec["step"], rec["loss"]) != rec["loss"]:
                raise SystemExit(f"step {rec['step']} printed two losses: "
                                 f"{seen[rec['step']]} and {rec['loss']}")
    return seen


def one_round(kind: str, args: argparse.Namespace, step: int, victim: int) -> dict[str, Any]:
    """One job of ``kind``; at step ``step`` the victim is killed: rank ``victim``, or with
    ``--lose node`` both ranks of its virtual node, whose node-local directory is then
    removed (a lost node: its memory goes with it)."""
    example, ranks, steps = args.example, args.ranks, args.steps
    victims = [victim] if args.lose == "rank" else [victim - victim % 2, victim - victim % 2 + 1]
    tmp = Path(tempfile.mkdtemp(prefix=f"ftkit-injob-{kind}-"))
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FTKIT_")}
        env.update(FTKIT_JOB="bench", FTKIT_LOCAL_DIR=str(tmp / "local"),
                   FTKIT_PFS_DIR=str(tmp / "pfs"), FTKIT_LEVELS="local:1,partner:1",
                   OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        extra = ["--in-job", "--spares", "2"] if kind == "in_job" else ["--max-restarts", "1"]
        cmd = [sys.executable, "-m", "ftkit.cli.main", "run", "-n", str(ranks),
               "--ranks-per-node", "2", "--restart-delay", "0", "--attempt-timeout", "300",
               *extra, "--", sys.executable,
               *example_command(example, ranks, steps, args.hidden)]
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        events = tmp / "pfs" / "bench" / "events.jsonl"
        killed_at = None
        deadline = time.monotonic() + 300
        while killed_at is None and time.monotonic() < deadline and proc.poll() is None:
            if any(e["event"] == "commit" and e["step"] >= step for e in read_events(events)):
                pids = rank_processes(tmp, victims)
                if sorted(pids) == sorted(victims):
                    for pid in pids.values():
                        os.kill(pid, signal.SIGKILL)
                    killed_at = time.time()
                    if args.lose == "node":
                        shutil.rmtree(tmp / "local" / "bench" / f"node-{victim // 2}",
                                      ignore_errors=True)
            time.sleep(0.01)
        out, err = proc.communicate(timeout=600)
        if proc.returncode != 0 or killed_at is None:
            raise SystemExit(f"{kind} round failed (rc {proc.returncode}, killed "
                             f"{killed_at}):\n{out[-2000:]}\n{err[-3000:]}")
        got = list(read_events(events))
        if kind == "in_job":
            back = [e["time"] for e in got if e["event"] == "in-job-step"]
        else:
            back = [e["time"] for e in got if e["event"] == "commit" and e.get("attempt") == 1]
        digest = [json.loads(ln)["digest"] for ln in out.splitlines()
                  if ln.startswith('{"event": "done"')][-1]
        return {"kind": kind, "step": step, "victim": victims,
                "seconds": round(back[0] - killed_at, 3), "digest": digest,
                "losses": _losses(out)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--example", choices=("toy", "hp_gpt"), default="toy")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None,
                    help="the toy's hidden width (state ~216 bytes per unit; 1250000: 256 MiB)")
    ap.add_argument("--lose", choices=("rank", "node"), default="rank",
                    help="kill one rank, or both ranks of its virtual node and wipe its "
                         "node-local directory")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    rounds = []
    for i in range(args.repeat):
        for kind in (("in_job", "relaunch") if i % 2 == 0 else ("relaunch", "in_job")):
            r = one_round(kind, args, rng.randrange(8, args.steps - 10),
                          rng.randrange(args.ranks))
            print(f"round {i} {kind}: {r['seconds']:.3f} s (ranks {r['victim']} killed "
                  f"after step {r['step']})", flush=True)
            rounds.append(r)
    if len({r["digest"] for r in rounds}) != 1:
        raise SystemExit(f"digests differ between rounds: {rounds}")
    if any(r["losses"] != rounds[0]["losses"] for r in rounds):
        raise SystemExit("printed losses differ between rounds")
    for r in rounds:
        del r["losses"]
    summary: dict[str, Any] = {}
    for kind in ("in_job", "relaunch"):
        xs = [r["seconds"] for r in rounds if r["kind"] == kind]
        summary[kind] = {"median_s": statistics.median(xs), "min_s": min(xs),
                         "max_s": max(xs), "n": len(xs)}
        print(f"{kind}: failure -> first step again: median {statistics.median(xs):.3f} s "
              f"(min {min(xs):.3f}, max {max(xs):.3f}, n {len(xs)})")
    ratio = summary["relaunch"]["median_s"] / summary["in_job"]["median_s"]
    print(f"relaunch / in-job (medians): {ratio:.1f}x; {args.example}, {args.ranks} working "
          f"ranks, seed {seed}")
    args.out.mkdir(parents=True, exist_ok=True)
    name = "injob.json" if args.example == "toy" else f"injob_{args.example}.json"
    (args.out / name).write_text(json.dumps(
        {"example": args.example, "ranks": args.ranks, "spares": 2, "seed": seed,
         "hidden": args.hidden, "lose": args.lose, "command": " ".join(sys.argv),
         "rounds": rounds,
         "summary": summary, "relaunch_over_in_job": ratio}, indent=2))


if __name__ == "__main__":
    main()

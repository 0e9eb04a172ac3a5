"""Recovery time of the toy example after a lost node, from failure to training resumed.

    python bench/recovery.py [--steps 10] [--hidden 65536] [--quick] [--out DIR]

Each scenario is one real ``ftkit run -n 4 --ranks-per-node 2 --max-restarts 1 --
python examples/toy_dp.py`` (2 virtual nodes of 2 ranks; node-local level in a private
/dev/shm directory, PFS level in a temporary directory, ``FTKIT_ASYNC=0``) with the fault
``FTKIT_FAULTS=node:rank=2:step=K:phase=between``: at the start of ``save(K)`` the ranks of
node 1 wipe that node's local directory and SIGKILL themselves; ``ftkit run`` sees the
attempt fail and relaunches it once. Scenarios, same fault, same K:

* ``local_partner``: ``FTKIT_LEVELS=local:1,partner:1``; the relaunch rebuilds node 1's
  shards of step K-1 from the partner copies on node 0;
* ``pfs_only``: ``FTKIT_LEVELS=local:1,pfs:5`` with K = 6 (right after the PFS step 5).
  No redundancy level: node 0's surviving local steps cannot make up a whole checkpoint, so
  discovery finds nothing usable locally and the job restores step 5 from the PFS. This
  needs no extra wiping by the benchmark (no race with the dying job) and one run, like
  ``local_partner``. ``FTKIT_ASYNC=0`` (both scenarios) makes the PFS flush of step 5 part
  of ``save(5)``, so step 5 is on the PFS when the fault fires at ``save(6)``.

The benchmark reads the run's stdout line by line and stamps every line with the wall
clock as it arrives; ftkit's events (``events.jsonl``) carry the wall clock of their writer.
Phases (they add up to the total):

* detection: failure -> ``attempt-end`` event of attempt 0. Failure time = arrival of the
  ``step`` K line: rank 0 prints it right before ``save(K)``, where the fault fires (node 1's
  ranks are at the same point: the step's all-reduce precedes the line);
* relaunch: ``attempt-end`` -> start of the relaunched job's restore (``restore`` event time
  minus its ``seconds``): relaunch, interpreter and torch start-up, MPI/gloo init, topology;
* discovery: restore ``discover_s`` (minus the ``rebuild`` seconds when the rebuild ran in
  it: not after a streamed load);
* rebuild: ``rebuild`` event ``seconds`` (0 when none); after a load streamed from the
  partner copies (its ``loaded_from``) it is the repair that follows the restore (the lost
  shards written to node 1 again, its copies sent again: before the first step, saves being
  synchronous), and it is not counted in the first step;
* load: restore ``seconds`` minus ``discover_s`` (for ``pfs_only``: reading the PFS files
  and loading them);
* first step: end of restore (``restore`` event time) -> arrival of the relaunched
  attempt's first ``step`` line.

Stdout arrival includes the forwarding of rank 0's output by mpiexec (milliseconds). Prints
``recovery[name]: total ... s (detection ..., ...)`` lines and the ratio of the restore part
(discovery + rebuild + load) pfs_only / local_partner; writes ``recovery.json``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn

from ftkit.jobdir.events import read_events

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _mpi

REPO = Path(__file__).resolve().parents[1]

RANKS, RANKS_PER_NODE = 4, 2
PFS_EVERY = 5
FAULT_STEP = PFS_EVERY + 1                  # right after a PFS step
SCENARIOS = {"local_partner": "local:1,partner:1", "pfs_only": f"local:1,pfs:{PFS_EVERY}"}
PHASES = ("detection", "relaunch", "discovery", "rebuild", "load", "first_step")


@dataclasses.dataclass
class RunOutput:
    """What one ``ftkit run`` left: timestamped stdout lines, events, exit status."""

    rc: int
    lines: list[tuple[float, str]]
    events: list[dict[str, Any]]
    stderr: str
    state_mib: float
    seconds: float


def _env(levels: str, local: str, pfs: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTKIT_")}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               FTKIT_JOB=f"bench-recovery-{time.monotonic_ns()}", FTKIT_LEVELS=levels,
               FTKIT_LOCAL_DIR=local, FTKIT_PFS_DIR=pfs, FTKIT_ASYNC="0",
               FTKIT_FAULTS=f"node:rank={RANKS_PER_NODE}:step={FAULT_STEP}:phase=between")
    return env


def _command(args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "ftkit.cli.main", "run", "-n", str(RANKS),
            "--ranks-per-node", str(RANKS_PER_NODE), "--max-restarts", "1",
            "--attempt-timeout", "300", "--", sys.executable,
            str(REPO / "examples" / "toy_dp.py"), "--steps", str(args.steps),
            "--hidden", str(args.hidden)]


def _largest_shard_mib(local: Path) -> float:
    sizes = [p.stat().st_size for p in local.rglob("rank-*.ftk")]
    return max(sizes, default=0) / 2**20


def run_scenario(args: argparse.Namespace, levels: str, work: Path) -> RunOutput:
    """One ``ftkit run`` with the node fault; stdout lines stamped as they arrive."""
    local = Path(tempfile.mkdtemp(prefix="ftkit-bench-", dir="/dev/shm"))
    env = _env(levels, str(local), str(work / "pfs"))
    err = work / "stderr.txt"
    t0 = time.monotonic()
    try:
        with open(err, "w") as fh:
            proc = subprocess.Popen(_command(args), env=env, cwd=REPO, stdout=subprocess.PIPE,
                                    stderr=fh, stdin=subprocess.DEVNULL, text=True)
            assert proc.stdout is not None
            lines = [(time.time(), line.rstrip("\n")) for line in proc.stdout]
            rc = proc.wait(timeout=60)
        state_mib = _largest_shard_mib(local)
    finally:
        shutil.rmtree(local, ignore_errors=True)
    events = list(read_events(work / "pfs" / env["FTKIT_JOB"] / "events.jsonl"))
    return RunOutput(rc, lines, events, err.read_text(), state_mib, time.monotonic() - t0)


def _json_lines(out: RunOutput) -> list[tuple[float, dict[str, Any]]]:
    """Rank 0's JSON lines, each with its arrival time and the attempt it belongs to."""
    records, attempt = [], -1
    for at, line in out.lines:
        if not line.startswith("{"):
            continue
        rec = json.loads(line)
        if rec.get("event") == "start":
            attempt = int(rec["attempt"])
        records.append((at, {**rec, "attempt": attempt}))
    return records


def _event(out: RunOutput, name: str, attempt: int) -> dict[str, Any] | None:
    found = [e for e in out.events if e["event"] == name and e.get("attempt") == attempt]
    return found[-1] if found else None


def phases(out: RunOutput) -> dict[str, Any]:
    """Split failure -> first step of the relaunched attempt into the phases (seconds)."""
    recs = _json_lines(out)
    fail = next(at for at, r in recs
                if r["event"] == "step" and r["attempt"] == 0 and r["step"] == FAULT_STEP)
    first = next(at for at, r in recs if r["event"] == "step" and r["attempt"] == 1)
    end = _event(out, "attempt-end", 0)
    restore = _event(out, "restore", 1)
    if end is None or restore is None:
        raise RuntimeError("the run has no attempt-end of attempt 0 or no restore of attempt 1")
    rebuild = _event(out, "rebuild", 1)
    rebuild_s = float(rebuild["seconds"]) if rebuild else 0.0
    # a streamed load (``loaded_from``): the rebuild is the repair after the restore event,
    # before the first step (synchronous saves); else it is part of discovery
    streamed = bool(rebuild and rebuild.get("loaded_from"))
    restore_end = float(restore["time"])
    restore_start = restore_end - float(restore["seconds"])
    split = {"detection": float(end["time"]) - fail,
             "relaunch": restore_start - float(end["time"]),
             "discovery": float(restore["discover_s"]) - (0.0 if streamed else rebuild_s),
             "rebuild": rebuild_s,
             "load": float(restore["seconds"]) - float(restore["discover_s"]),
             "first_step": first - restore_end - (rebuild_s if streamed else 0.0)}
    result: dict[str, Any] = {f"{k}_s": round(v, 6) for k, v in split.items()}
    result["total_s"] = round(first - fail, 6)
    result["restore_s"] = round(float(restore["seconds"]), 6)
    result["restored_step"] = restore["step"]
    result["restored_from"] = restore.get("level", "local")
    return result


def _fail(name: str, out: RunOutput, why: str) -> NoReturn:
    tail = "\n".join([*out.stderr.splitlines()[-20:], *(ln for _, ln in out.lines[-10:])])
    sys.exit(f"recovery[{name}]: {why} (exit {out.rc})\n{tail}")


def measure(args: argparse.Namespace, name: str) -> tuple[dict[str, Any], RunOutput]:
    """Run one scenario and split its recovery; exits when it did not recover as it should."""
    with tempfile.TemporaryDirectory(prefix="ftkit-bench-") as tmp:
        out = run_scenario(args, SCENARIOS[name], Path(tmp))
    if out.rc != 0 or not any('"event": "done"' in line for _, line in out.lines):
        _fail(name, out, "the run did not complete")
    try:
        r = {"levels": SCENARIOS[name], **phases(out)}
    except (StopIteration, RuntimeError, KeyError) as exc:
        _fail(name, out, f"cannot split the recovery: {exc!r}")
    want = ("local", FAULT_STEP - 1) if name == "local_partner" else ("pfs", PFS_EVERY)
    if (r["restored_from"], r["restored_step"]) != want:
        _fail(name, out, f"restored step {r['restored_step']} from {r['restored_from']}, "
                         f"expected step {want[1]} from {want[0]}")
    return r, out


def _line(name: str, r: dict[str, Any]) -> str:
    parts = ", ".join(f"{p.replace('_', ' ')} {r[p + '_s']:.3g}" for p in PHASES)
    return f"recovery[{name}]: total {r['total_s']:.2f} s ({parts})"


def _restore_part(r: dict[str, Any]) -> float:
    return float(r["discovery_s"] + r["rebuild_s"] + r["load_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="default 10 (quick 8)")
    ap.add_argument("--hidden", type=int, default=None,
                    help="MLP width: ~13.5 MiB per rank at 65536 (default; quick 16384)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    args.steps = args.steps or (8 if args.quick else 10)
    args.hidden = args.hidden or (16384 if args.quick else 65536)
    if args.steps <= FAULT_STEP:
        ap.error(f"--steps must be > {FAULT_STEP} (the fault step)")
    t0 = time.monotonic()
    scenarios, state_mib, run_s = {}, {}, {}
    for name in SCENARIOS:
        scenarios[name], out = measure(args, name)
        state_mib[name], run_s[name] = round(out.state_mib, 3), round(out.seconds, 1)
        print(_line(name, scenarios[name]))
    ratio = _restore_part(scenarios["pfs_only"]) / _restore_part(scenarios["local_partner"])
    print(f"recovery ratio pfs_only/local_partner (restore part) = {ratio:.2f}")
    report = {"scenarios": scenarios, "ranks": RANKS, "ranks_per_node": RANKS_PER_NODE,
              "state_mib": max(state_mib.values()), "state_mib_by_scenario": state_mib,
              "fault": f"node:rank={RANKS_PER_NODE}:step={FAULT_STEP}:phase=between",
              "async": False, "steps": args.steps, "hidden": args.hidden,
              "restore_ratio_pfs_only_to_local_partner": ratio, "cores": os.cpu_count(),
              "run_s": run_s, "wall_s": round(time.monotonic() - t0, 1),
              "machine": _mpi.machine(),
              "command": " ".join(["python", *sys.argv])}
    _mpi.write_report(args.out, "recovery", report)


if __name__ == "__main__":
    main()

"""Checkpoint overhead of the hybrid-parallel GPT: iteration time without checkpoints and
with ``local:1``, ``local:1,partner:1`` (every step, and every 5th step) and
``local:1,partner:1,pfs:10`` (async, overlapped staging) and ``local:1,partner:1``
synchronous (``FTKIT_ASYNC=0``), plus the time the training loop was actually blocked.

    python bench/hp_overlap.py [--ranks 2 --tp 1 --pp 2] [--hidden 256] [--steps 40]
                               [--repeat 5]

Every configuration is a real ``ftkit run`` of ``examples/hp_gpt.py`` (one virtual node per
rank, node-local level on /dev/shm, PFS level in a temporary directory). The configurations
run in alternating rounds (each round runs every one once, in turn), --repeat rounds. Per
run the example reports the p50 and p99 of its iteration times (slowest rank); a
configuration's ``overhead_p50`` / ``overhead_p99`` is the median over rounds of its p50 /
p99 divided by the same round's p50 / p99 without checkpoints, minus 1 (min and max beside
it). Prints ``name: value (ratio to X = r)`` lines and writes ``hp_overlap.json``. Goals
(docs/performance.md): blocking <= 1 % of an iteration with ``local:1,partner:1``;
overhead p50 <= 5 % checkpointing every step, <= 1 % every 5th step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _mpi

CONFIGS = {"none": "local:1000000", "local": "local:1", "local+partner": "local:1,partner:1",
           "local+partner every 5th": "local:5,partner:5",
           "local+partner+pfs": "local:1,partner:1,pfs:10",
           "local+partner sync": "local:1,partner:1"}      # FTKIT_ASYNC=0: what overlap buys


def run_config(args: argparse.Namespace, name: str, levels: str, work: Path) -> dict[str, Any]:
    """One ``ftkit run`` of the example; returns the ``timing`` of its done line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTKIT_")}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               FTKIT_JOB=f"bench-{time.monotonic_ns()}", FTKIT_LEVELS=levels,
               FTKIT_LOCAL_DIR=tempfile.mkdtemp(prefix="ftkit-bench-", dir="/dev/shm"),
               FTKIT_PFS_DIR=str(work / "pfs"), FTKIT_ASYNC="0" if "sync" in name else "1")
    cmd = [sys.executable, "-m", "ftkit.cli.main", "run", "-n", str(args.ranks),
           "--ranks-per-node", "1", "--max-restarts", "0", "--",
           sys.executable, str(REPO / "examples" / "hp_gpt.py"), "--tp", str(args.tp),
           "--pp", str(args.pp), "--hidden", str(args.hidden), "--layers", str(args.layers),
           "--steps", str(args.steps), "--global-batch", str(args.global_batch),
           "--seq", str(args.seq), "--device", "cpu"]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True,
                             timeout=1800).stdout
    finally:
        subprocess.run(["rm", "-rf", env["FTKIT_LOCAL_DIR"]], check=False)
    done = [json.loads(ln) for ln in out.splitlines() if ln.startswith('{"event": "done"')]
    return dict(done[-1]["timing"])


def summarize(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per configuration: medians over rounds (p50, p99, blocking) and the overheads
    against the same round's run without checkpoints (pure)."""
    base = rounds["none"]
    out: dict[str, dict[str, Any]] = {}
    for name, runs in rounds.items():
        r: dict[str, Any] = {"rounds": runs}
        for key in ("iter_s", "iter_p99_s", "blocked_s_per_step", "state_mib"):
            r[key] = statistics.median(run[key] for run in runs)
        for q, key in (("p50", "iter_s"), ("p99", "iter_p99_s")):
            over = [run[key] / b[key] - 1 for run, b in zip(runs, base)]
            r[f"overhead_{q}"] = _mpi.spread(over)
        r["ratio_to_none"] = 1 + r["overhead_p50"]["median"]
        r["blocked_fraction"] = r["blocked_s_per_step"] / r["iter_s"]
        out[name] = r
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=5, help="alternating rounds")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="ftkit-bench-") as tmp:
        for _ in range(max(1, args.repeat)):
            for name, levels in CONFIGS.items():
                rounds[name].append(run_config(args, name, levels, Path(tmp)))
    results = summarize(rounds)
    for name, r in results.items():
        r["levels"], r["async"] = CONFIGS[name], "sync" not in name
        o50, o99 = r["overhead_p50"], r["overhead_p99"]
        print(f"iteration[{name}]: p50 {r['iter_s'] * 1e3:.1f} ms, p99 "
              f"{r['iter_p99_s'] * 1e3:.1f} ms (ratio to none = {r['ratio_to_none']:.3f})")
        print(f"overhead[{name}]: p50 {o50['median']:+.3f} (min {o50['min']:+.3f}, max "
              f"{o50['max']:+.3f}), p99 {o99['median']:+.3f} over {args.repeat} rounds")
        print(f"blocked[{name}]: {r['blocked_s_per_step'] * 1e3:.2f} ms per step "
              f"(ratio to iteration = {r['blocked_fraction']:.4f})")
    print(f"state: {results['none']['state_mib']:.1f} MiB of tensors per rank (largest rank)")
    used = args.ranks            # hp_gpt runs one torch thread per rank
    print(f"cores: {cores}; training used {used} (one torch thread per rank), "
          f"{max(0, cores - used)} left to the background work")
    report = {"machine": _mpi.machine(),
              "command": " ".join(["python", *sys.argv]),
              "args": vars(args), "cores_training": used,
              "cores_left": max(0, cores - used), "results": results,
              "goal": {"blocked_fraction_local+partner": 0.01,
                       "overhead_p50_local+partner": 0.05,
                       "overhead_p50_local+partner every 5th": 0.01}}
    _mpi.write_report(args.out, "hp_overlap", report)


if __name__ == "__main__":
    main()

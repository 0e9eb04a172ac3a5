"""Coordination cost of a checkpoint as the world grows: seconds per ``save`` of an empty state.

    python bench/protocol.py [--ranks-list 2,4,8,16] [--saves 20] [--quick] [--out DIR]

For every n in ``--ranks-list`` the script relaunches itself under the venv's mpiexec on n
ranks (``--quick``: 2,4,8 and 10 saves). In the ranks, each configuration builds a
``Topology`` and a synchronous ``Checkpointer`` (node-local level in a private /dev/shm
directory, PFS directory in a temporary one) and times ``save(step, {"step": step})`` over
``--saves`` steps after 2 warm-up saves, with a barrier before each: the state is empty, so
what is measured is the protocol (write-local of a tiny shard, vote, decide, commit).

* ``local`` = ``local:1`` on virtual nodes of 2 ranks (``ranks_per_node=2``);
* ``local+partner`` = ``local:1,partner:1`` on virtual nodes of 1 rank (``ranks_per_node=1``):
  partner copies need >= 2 nodes, and one rank per node makes that valid for every n,
  n = 2 included, so both series have the same baseline.

A save's time is the slowest rank's; the median and p90 over the saves are reported, with
the collective operations each save ran (``collectives_per_save``: rounds and bytes
delivered per rank, the most any rank had; ``ftkit.passes.collective_counts``), which
must stay flat in n while nothing fails: a fixed-size allreduce per vote and agreement. With
more ranks than cores the ranks are oversubscribed (stated in the output and the JSON): the
growth then includes CPU sharing, not only coordination. Prints
``protocol[local, n=8]: 3.1 ms per save (ratio to n=2 = 1.9)`` lines and writes
``protocol.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _mpi

#: name -> (FTKIT_LEVELS, ranks per virtual node)
CONFIGS: dict[str, tuple[str, int]] = {"local": ("local:1", 2),
                                       "local+partner": ("local:1,partner:1", 1)}
WARMUP = 2


def _time_saves(comm: Any, ckpt: Any, saves: int) -> list[float]:
    """Seconds of every timed save on this rank (after the warm-up saves)."""
    times = []
    for step in range(1, WARMUP + saves + 1):
        comm.Barrier()
        t0 = time.perf_counter()
        ckpt.save(step, {"step": step})
        if step > WARMUP:
            times.append(time.perf_counter() - t0)
    return times


def _measure(comm: Any, name: str, saves: int) -> dict[str, Any] | None:
    """Per-save seconds of the slowest rank for one configuration, and the collective
    operations (``rounds``) and bytes they delivered per save, the most any rank had (rank
    0; None elsewhere)."""
    from ftkit import Checkpointer, Config, Topology
    from ftkit.passes import collective_counts
    levels, rpn = CONFIGS[name]
    work = comm.bcast({"local": tempfile.mkdtemp(prefix="ftkit-bench-", dir="/dev/shm"),
                       "pfs": tempfile.mkdtemp(prefix="ftkit-bench-")}
                      if comm.rank == 0 else None, root=0)
    topo = Topology.create(comm, ranks_per_node=rpn)
    cfg = Config.load(levels=levels, async_=False, local_dir=work["local"],
                      pfs_dir=work["pfs"], job=f"protocol-{name.replace('+', '-')}")
    ckpt = Checkpointer(topo, cfg)
    before = collective_counts()
    mine = _time_saves(comm, ckpt, saves)
    after = collective_counts()
    ckpt.close()
    # the warm-up saves ran inside the counted span too: per save over all of them
    counts = {k: (after[k] - before[k]) / (saves + WARMUP) for k in after}
    every = comm.gather((mine, counts), root=0)
    comm.Barrier()
    if comm.rank != 0:
        return None
    for path in work.values():
        shutil.rmtree(path, ignore_errors=True)
    return {"save_s": [max(per_rank) for per_rank in zip(*(t for t, _ in every))],
            **{f"{k}_per_save": max(c[k] for _, c in every) for k in counts}}


def _child(args: argparse.Namespace) -> None:
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    out = {name: _measure(comm, name, args.saves) for name in CONFIGS}
    if comm.rank == 0:
        Path(args.part).write_text(json.dumps(out))


def _run_all(args: argparse.Namespace, ranks: list[int]) -> dict[int, dict[str, list[float]]]:
    """Launch one world per n; per-save slowest-rank seconds of every configuration."""
    results = {}
    with tempfile.TemporaryDirectory(prefix="ftkit-bench-") as tmp:
        for n in ranks:
            part = Path(tmp) / f"n{n}.json"
            argv = ["--saves", str(args.saves), "--part", str(part), "--child"]
            rc = _mpi.launch(__file__, n, argv, timeout=600)
            if rc != 0 or not part.is_file():
                sys.exit(f"protocol: the run on {n} ranks failed (exit {rc})")
            results[n] = json.loads(part.read_text())
    return results


def _summary(results: dict[int, dict[str, Any]], q: float) -> dict[str, dict[int, float]]:
    return {name: {n: float(np.percentile(per[name]["save_s"], q))
                   for n, per in results.items()} for name in CONFIGS}


def _collectives(results: dict[int, dict[str, Any]]) -> dict[str, dict[int, dict[str, float]]]:
    """Per configuration and world size: collective rounds and bytes per save."""
    return {name: {n: {k: per[name][f"{k}_per_save"] for k in ("rounds", "bytes")}
                   for n, per in results.items()} for name in CONFIGS}


def _report(ranks: list[int], median: dict[str, dict[int, float]],
            coll: dict[str, dict[int, dict[str, float]]], cores: int) -> None:
    base = ranks[0]
    for name in CONFIGS:
        for n in ranks:
            s, c = median[name][n], coll[name][n]
            print(f"protocol[{name}, n={n}]: {s * 1e3:.2f} ms per save "
                  f"(ratio to n={base} = {s / median[name][base]:.2f}); "
                  f"{c['rounds']:.1f} collectives, {c['bytes']:.0f} bytes per save and rank")
    over = [n for n in ranks if n > cores]
    if over:
        print(f"oversubscribed: n={','.join(map(str, over))} ran on {cores} cores "
              f"(several ranks per core)")


def main() -> None:
    ap = _mpi.parser(__doc__)
    ap.add_argument("--ranks-list", default=None, help="default 2,4,8,16 (quick: 2,4,8)")
    ap.add_argument("--saves", type=int, default=None, help="timed saves (default 20, quick 10)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--part", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return
    args.ranks_list = args.ranks_list or ("2,4,8" if args.quick else "2,4,8,16")
    args.saves = args.saves or (10 if args.quick else 20)
    ranks = [int(n) for n in args.ranks_list.split(",")]
    cores = os.cpu_count() or 1
    t0 = time.monotonic()
    results = _run_all(args, ranks)
    median, p90 = _summary(results, 50), _summary(results, 90)
    coll = _collectives(results)
    _report(ranks, median, coll, cores)
    report = {"ranks": ranks, "save_s": median, "save_p90_s": p90, "cores": cores,
              "collectives_per_save": coll,
              "oversubscribed": {n: n > cores for n in ranks},
              "configs": {name: {"levels": lv, "ranks_per_node": rpn}
                          for name, (lv, rpn) in CONFIGS.items()},
              "saves": args.saves, "warmup": WARMUP, "async": False,
              "per_save_s": {n: {name: r["save_s"] for name, r in per.items()}
                             for n, per in results.items()}, "wall_s": round(time.monotonic() - t0, 1),
              "machine": _mpi.machine(),
              "command": " ".join(["python", *sys.argv])}
    _mpi.write_report(args.out, "protocol", report)


if __name__ == "__main__":
    main()

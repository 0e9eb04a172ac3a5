"""A lost node comes back: the whole restore after a node lost its directory, per level, next
to its bounds in the same run.

    python bench/rebuild.py [--ranks 2] [--size-mib 256] [--repeat 3] [--out bench/results]

Relaunches itself under the venv's mpiexec, one virtual node per rank (every copy crosses
"nodes"). Each rank's state is ``--size-mib`` of float32 (distinct per rank). For every
level — ``partner``, ``xor`` (a set of all ranks), ``rs`` (a set of all ranks, 1 parity
block) — step 1 is saved once (sync) with ``local:1,<level>:1,pfs:1``; then every round
times, in turn, on the same ranks:

* ``nothing_lost[level]``: a new ``Checkpointer``, ``restore`` into a live state (its pages
  touched before, as a trained model's are) and ``close``, with every node's directory
  intact (what a relaunch costs at best);
* ``lost[level]``: the same after the last rank's node directory was removed (the
  benchmark removes it before the timed part): discovery, the lost shard loaded from a copy
  (or rebuilt from parity first) and the load, until ``restore`` returned (training may
  go on); ``lost_protected[level]``: until the step was protected again too (``wait``: the
  lost shard in its node-local slot, the copies and parity the node held made again, on
  the checkpoint thread);
* ``p2p``: one MPI send of the state's bytes to the next rank (the bound of moving what was
  lost once);
* ``pfs_cold``: every node directory removed and the PFS files' pages dropped from the page
  cache: the restore reads the step from the PFS (``local:1,pfs:1``).

Seconds are from a barrier before the ``Checkpointer`` to a barrier after ``restore``
(saves are asynchronous, the default: the repair after a load from copies runs on the
checkpoint thread); the figure is the median of the rounds, with min and max; ratios are
medians of per-round ratios. One extra restore per level (with ``close``, so the repair is
in it), after the rounds, is measured with ``bench/_mpi.costs``: passes over the state by
kind (``ftkit.passes``), CPU seconds, the peak resident memory above the one before it
(mapped node-local slots included) and the peak private memory (the most any rank paid).
Prints one line per figure and writes ``rebuild.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _disk
import _mpi

LEVELS = ("partner", "xor", "rs")


def _child(args: argparse.Namespace) -> None:
    from mpi4py import MPI

    import ftkit
    from ftkit import Checkpointer, Config

    comm = MPI.COMM_WORLD
    rank, world = comm.rank, comm.size
    n = (args.size_mib << 20) // 4
    with _mpi.scratch(comm, "/dev/shm", "/tmp") as (local_root, pfs_root):
        os.environ.update(FTKIT_LOCAL_DIR=str(local_root), FTKIT_PFS_DIR=str(pfs_root),
                          FTKIT_RANKS_PER_NODE="1")
        topo = ftkit.Topology.create(comm)
        host = comm.Split_type(MPI.COMM_TYPE_SHARED)
        saved = np.random.default_rng(rank).random(n, dtype=np.float32)

        def config(level: str | None, job: str, *, async_: bool = True) -> Config:
            levels = f"local:1,{level}:1,pfs:1" if level else "local:1,pfs:1"
            return Config.load(job=job, levels=levels, xor_set=world, rs_set=world,
                               rs_parity=1, async_=async_)

        def live() -> dict[str, np.ndarray]:
            """A live state to restore into (its pages touched, as a trained model's are)."""
            return {"w": np.full(n, -1.0, dtype=np.float32)}

        def restore(cfg: Config, state: dict[str, np.ndarray]) -> None:
            ckpt = Checkpointer(topo, cfg)
            assert ckpt.restore(state) == 1, rank
            ckpt.close()

        def check(state: dict[str, np.ndarray]) -> None:
            """Bit-exact (outside the measured call: the comparison's own 64 MiB of bools
            per 256 MiB would count as the restore's memory)."""
            assert np.array_equal(state["w"], saved), rank

        def timed_restore(cfg: Config, state: dict[str, np.ndarray]) -> tuple[float, float]:
            """Seconds until ``restore`` returned on every rank (training may go on) and
            until the step was protected again (``wait``: the background repair)."""
            comm.Barrier()
            t0 = time.perf_counter()
            ckpt = Checkpointer(topo, cfg)
            step = ckpt.restore(state)
            comm.Barrier()
            t1 = time.perf_counter()
            ckpt.wait()
            comm.Barrier()
            t2 = time.perf_counter()
            ckpt.close()
            assert step == 1 and np.array_equal(state["w"], saved), (rank, step)
            return t1 - t0, t2 - t0

        def lose(cfg: Config, ranks: set[int]) -> None:
            comm.Barrier()
            if rank in ranks:
                shutil.rmtree(cfg.node_dir(rank), ignore_errors=True)
            comm.Barrier()

        cfgs = {level: config(level, f"rb-{level}") for level in LEVELS}
        cfgs["pfs"] = config(None, "rb-pfs")
        for name in cfgs:
            ckpt = Checkpointer(topo, config(None if name == "pfs" else name, f"rb-{name}",
                                             async_=False))
            ckpt.save(1, {"w": saved})
            ckpt.close()
        out, back = np.ones(n, np.float32), np.empty(n, np.float32)
        nxt, prv = (rank + 1) % world, (rank - 1) % world

        def p2p() -> None:
            MPI.Request.Waitall([comm.Isend([out, MPI.FLOAT], nxt),
                                 comm.Irecv([back, MPI.FLOAT], prv)])

        rounds: dict[str, list[float]] = {}
        last = {world - 1}
        for _ in range(max(1, args.repeat)):
            rounds.setdefault("p2p", []).append(_mpi.timed(comm, p2p))
            for level in LEVELS:
                cfg = cfgs[level]
                until, _ = timed_restore(cfg, live())
                rounds.setdefault(f"nothing_lost[{level}]", []).append(until)
                lose(cfg, last)
                until, protected = timed_restore(cfg, live())
                rounds.setdefault(f"lost[{level}]", []).append(until)
                rounds.setdefault(f"lost_protected[{level}]", []).append(protected)
            cfg = cfgs["pfs"]
            lose(cfg, set(range(world)))
            _disk.drop_pages(host, cfg.job_pfs_dir)
            rounds.setdefault("pfs_cold", []).append(timed_restore(cfg, live())[0])
        state = live()
        costs = {"nothing_lost[partner]": _mpi.costs(
            comm, lambda: restore(cfgs["partner"], state), n * 4)}
        check(state)
        for level in LEVELS:
            lose(cfgs[level], last)
            state = live()
            costs[level] = _mpi.costs(comm, lambda c=cfgs[level], st=state: restore(c, st),
                                      n * 4)
            check(state)
        if rank == 0:
            _report(args, world, rounds, costs)


def _report(args: argparse.Namespace, world: int, rounds: dict[str, list[float]],
            costs: dict[str, Any]) -> None:
    med = {k: _mpi.spread(v) for k, v in rounds.items()}
    lines = [f"{k}: {v['median']:.3f} s (min {v['min']:.3f}, max {v['max']:.3f})"
             for k, v in med.items()]
    ratios = {}
    for level in LEVELS:
        lost = rounds[f"lost[{level}]"]
        ratios[f"lost_vs_nothing_lost[{level}]"] = _mpi.spread(
            [a / b for a, b in zip(lost, rounds[f"nothing_lost[{level}]"])])
        ratios[f"pfs_cold_vs_lost[{level}]"] = _mpi.spread(
            [b / a for a, b in zip(lost, rounds["pfs_cold"])])
        ratios[f"lost_vs_p2p[{level}]"] = _mpi.spread(
            [a / b for a, b in zip(lost, rounds["p2p"])])
    lines += [f"{k}: {v['median']:.2f}x (min {v['min']:.2f}, max {v['max']:.2f})"
              for k, v in ratios.items()]
    lines += [f"costs[{level}]: {json.dumps(c)}" for level, c in costs.items()]
    print("\n".join(lines), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"command": "python bench/rebuild.py " + " ".join(
                  a for a in sys.argv[1:] if a != "--child"),
              "machine": _mpi.machine(), "ranks": world, "size_mib": args.size_mib,
              "seconds": med, "ratios": ratios, "costs": costs}
    (out / "rebuild.json").write_text(json.dumps(report, indent=1))


def main() -> None:
    ap = _mpi.parser(__doc__ or "")
    ap.set_defaults(ranks=2, size_mib=256)
    args = ap.parse_args()
    _mpi.run(__file__, args, _child)


if __name__ == "__main__":
    main()

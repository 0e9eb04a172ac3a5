"""A snapshot shared by data-parallel replicas against whole shards: save and restore, same run.

    python bench/shared.py [--ranks 4] [--size-mib 256] [--repeat 3] [--out bench/results]

Relaunches itself under the venv's mpiexec, one virtual node per rank, pure data parallel
(dp = ranks). Each rank's state is a DDP-like replica: ``--size-mib`` of float32 parameters
identical on every rank, plus a small tensor of its own and every RNG (``ftkit.RNGState``).
Three configurations, synchronous saves (``save`` returns after the commit), in alternating
rounds on the same ranks:

* ``whole[local]``: ``FTKIT_LEVELS=local:1``, every rank keeps its whole shard (today);
* ``whole[partner]``: ``local:1,partner:1``, whole shards and a copy on another node;
* ``shared``: ``local:1`` with ``FTKIT_SHARE_REPLICAS=on``: each rank keeps 2 of the D slices
  of the replicated tensors and its own ones whole.

Per round and configuration: one ``save`` (of a new step, by a ``Checkpointer`` that saved
the step before it, untimed, as a training job's does; 2 warm-up saves created the slots)
and one ``restore`` into a live state with nothing lost (a new ``Checkpointer``;
for ``shared`` the slices a rank does not keep come from the other replicas), each from a
barrier to a barrier, and a memcpy of the state (the restore's bound). Figures are medians
of the rounds with min and max; ratios are medians of per-round ratios. The costs table
(``bench/_mpi.costs``) gives the passes over the state a save and a restore make by kind
(write: bytes written to node-local files; send/recv: bytes moved over MPI), CPU seconds
and peak private memory. Prints one line per figure and writes ``shared.json``.
"""
from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _mpi

CONFIGS = {"whole[local]": ("local:1", "off"), "whole[partner]": ("local:1,partner:1", "off"),
           "shared": ("local:1", "on")}


def _child(args: Any) -> None:
    import torch
    from mpi4py import MPI

    import ftkit
    from ftkit import Checkpointer, Config

    comm = MPI.COMM_WORLD
    n = (args.size_mib << 20) // 4
    with _mpi.scratch(comm, "/dev/shm", "/tmp") as (local_root, pfs_root):
        os.environ.update(FTKIT_LOCAL_DIR=str(local_root), FTKIT_PFS_DIR=str(pfs_root),
                          FTKIT_RANKS_PER_NODE="1")
        topo = ftkit.Topology.create(comm)
        params = torch.from_numpy(np.random.default_rng(7).random(n, dtype=np.float32))

        def state() -> dict[str, Any]:
            return {"params": params.clone(), "own": torch.full((16,), float(comm.rank)),
                    "rng": ftkit.RNGState()}

        def config(name: str) -> Any:
            levels, share = CONFIGS[name]
            return Config.load(job=name.replace("[", "-").strip("]"), levels=levels,
                               share_replicas=share, async_=False)

        live = state()
        steps = {name: 0 for name in CONFIGS}

        def save(name: str, measure: Any = _mpi.timed) -> Any:
            """A synchronous save of a new step, measured, by a Checkpointer that saved one
            step before (untimed: its first save compares the replicas), as a training
            job's long-lived one does; closed after (one per job and process at a time:
            the restore makes its own)."""
            ckpt = Checkpointer(topo, config(name))
            try:
                steps[name] += 1
                ckpt.save(steps[name], live)
                steps[name] += 1
                return measure(comm, lambda: ckpt.save(steps[name], live))
            finally:
                ckpt.close()

        for name in CONFIGS:
            save(name)
        target = state()
        copy = np.empty(n, np.float32)

        def restore(name: str) -> None:
            ckpt = Checkpointer(topo, config(name))
            assert ckpt.restore(target) == steps[name], comm.rank
            ckpt.close()

        rounds: dict[str, list[float]] = {}
        order = list(CONFIGS)
        for r in range(max(1, args.repeat)):
            rounds.setdefault("memcpy", []).append(
                _mpi.timed(comm, lambda: np.copyto(copy, params.numpy())))
            for name in (order if r % 2 == 0 else order[::-1]):
                rounds.setdefault(f"save[{name}]", []).append(save(name))
                rounds.setdefault(f"restore[{name}]", []).append(
                    _mpi.timed(comm, lambda nm=name: restore(nm)))
                assert torch.equal(target["params"], params), (name, comm.rank)
        costs = {}
        for name in CONFIGS:
            costs[f"save[{name}]"] = save(name, lambda c, fn: _mpi.costs(c, fn, n * 4))
            costs[f"restore[{name}]"] = _mpi.costs(comm, lambda nm=name: restore(nm), n * 4)
        if comm.rank == 0:
            _report(args, comm.size, rounds, costs)


def _report(args: Any, world: int, rounds: dict[str, list[float]],
            costs: dict[str, Any]) -> None:
    seconds = {k: _mpi.spread(v) for k, v in rounds.items()}
    ratios = {
        "save[whole[partner]] / save[shared]": _mpi.spread(
            [a / b for a, b in zip(rounds["save[whole[partner]]"], rounds["save[shared]"])]),
        "save[whole[local]] / save[shared]": _mpi.spread(
            [a / b for a, b in zip(rounds["save[whole[local]]"], rounds["save[shared]"])]),
        "memcpy / restore[shared]": _mpi.spread(
            [a / b for a, b in zip(rounds["memcpy"], rounds["restore[shared]"])]),
        "memcpy / restore[whole[local]]": _mpi.spread(
            [a / b for a, b in zip(rounds["memcpy"], rounds["restore[whole[local]]"])])}
    lines = [f"{k}: {v['median']:.4f} s (min {v['min']:.4f}, max {v['max']:.4f})"
             for k, v in seconds.items()]
    lines += [f"{k}: {v['median']:.2f}x (min {v['min']:.2f}, max {v['max']:.2f})"
              for k, v in ratios.items()]
    lines += [f"costs[{k}]: passes {c['passes']}; CPU {c['cpu_s']} s; private peak "
              f"{c['peak_private_mib']} MiB" for k, c in costs.items()]
    print("\n".join(lines), flush=True)
    _mpi.write_report(args.out, "shared", {
        "command": "python bench/shared.py " + " ".join(
            a for a in sys.argv[1:] if a != "--child"),
        "machine": _mpi.machine(), "ranks": world, "size_mib": args.size_mib,
        "seconds": seconds, "ratios": ratios, "costs": costs})


def main() -> None:
    ap = _mpi.parser(__doc__ or "")
    ap.set_defaults(size_mib=256)
    _mpi.run(__file__, ap.parse_args(), _child)


if __name__ == "__main__":
    main()

"""Physical bounds of this machine: what any checkpoint writer or sender can reach here.

    python bench/bounds.py [--ranks 2] [--size-mib 256] [--repeat 3] [--disk-dir DIR]
                           [--quick] [--out bench/results]

Relaunches itself twice under the venv's mpiexec on --ranks ranks (default 2, an even number):
once with the default transport, once with ``--mca btl tcp,self`` (as an ``OMPI_MCA_btl``
variable) for the TCP figure. Every rank holds --size-mib MiB (``--quick``: 16); every figure
is the best of --repeat runs timed from a barrier to a barrier with all ranks working at once,
and is given per rank (bytes of one rank / seconds):

* ``memcpy``: NumPy copy into a preallocated, already touched buffer;
* ``tmpfs_write``: write + fsync + rename of a file in a private /dev/shm directory
  (``ftkit.fs.write_atomic``, the writer of ftkit's node-local level);
* ``disk_write_fsync``: the same into a private directory under --disk-dir (default: the
  system temp dir; pass a directory on the real disk if that is a tmpfs);
* ``p2p_same_node``: ranks 2i and 2i+1 exchange their buffers (``Isend`` + ``Irecv``) with
  the default transport: shared memory here, also between ftkit's virtual nodes;
* ``p2p_tcp``: the same exchange over TCP (what ULFM mode and separate nodes use).

Prints ``name: X.XX GB/s`` lines and writes bounds.json.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _mpi

FIGURES = ("memcpy", "tmpfs_write", "disk_write_fsync", "p2p_same_node", "p2p_tcp")


def _p2p(comm: Any, out: np.ndarray, back: np.ndarray, repeat: int) -> float:
    """Best seconds of ranks 2i <-> 2i+1 swapping ``out`` into ``back``."""
    from mpi4py import MPI
    peer = comm.rank ^ 1

    def exchange() -> None:
        MPI.Request.Waitall([comm.Isend([out, MPI.BYTE], peer),
                             comm.Irecv([back, MPI.BYTE], peer)])
    return _mpi.best_of(comm, exchange, repeat)


def _measure_all(args: argparse.Namespace, comm: Any) -> dict[str, float]:
    from ftkit.fs import write_atomic

    nbytes, rank = args.size_mib << 20, comm.rank
    src = np.full(nbytes, rank + 1, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    seconds = {"memcpy": _mpi.best_of(comm, lambda: np.copyto(dst, src), args.repeat)}
    with _mpi.scratch(comm, "/dev/shm", args.disk_dir) as (shm, disk):
        for name, root in (("tmpfs_write", shm), ("disk_write_fsync", disk)):
            path = root / f"rank-{rank}.bin"
            seconds[name] = _mpi.best_of(comm, functools.partial(write_atomic, path, [src]),
                                         args.repeat)
    seconds["p2p_same_node"] = _p2p(comm, src, dst, args.repeat)
    return seconds


def _child(args: argparse.Namespace) -> None:
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if args.tcp_only:
        nbytes = args.size_mib << 20
        seconds = {"p2p_tcp": _p2p(comm, np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8),
                                   args.repeat)}
    else:
        seconds = _measure_all(args, comm)
    if comm.rank == 0:
        Path(args.result).write_text(json.dumps({"seconds": seconds,
                                                 "machine": _mpi.machine()}))


def _launch(args: argparse.Namespace, result: Path, *extra: str) -> dict[str, Any]:
    argv = [*sys.argv[1:], "--size-mib", str(args.size_mib), "--result", str(result),
            *extra, "--child"]
    rc = _mpi.launch(__file__, args.ranks, argv)
    if rc:
        sys.exit(rc)
    return dict(json.loads(result.read_text()))


def _report(args: argparse.Namespace, seconds: dict[str, float], machine: dict[str, Any]
            ) -> None:
    gbs = {k: (args.size_mib << 20) / seconds[k] / 1e9 for k in FIGURES}
    print("\n".join(f"{k}: {v:.2f} GB/s" for k, v in gbs.items()), flush=True)
    _mpi.write_report(args.out, "bounds", {
        "gb_per_s": gbs, "seconds": seconds, "size_mib": args.size_mib, "ranks": args.ranks,
        "repeat": args.repeat, "machine": machine,
        "command": " ".join(["python bench/bounds.py", *sys.argv[1:]]),
        "notes": ["per rank: bytes of one rank / seconds, all ranks at once, best of repeat",
                  "p2p: each rank sends and receives size_mib MiB at once",
                  "p2p_tcp: mpiexec with OMPI_MCA_btl=tcp,self"]})


def main() -> None:
    ap = _mpi.parser(__doc__)
    ap.set_defaults(ranks=2, size_mib=None)
    ap.add_argument("--disk-dir", default=tempfile.gettempdir(),
                    help="directory on the disk for disk_write_fsync")
    ap.add_argument("--quick", action="store_true", help="16 MiB per rank (unless --size-mib)")
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--tcp-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ranks < 2 or args.ranks % 2:
        ap.error(f"--ranks must be an even number >= 2, got {args.ranks}")
    if args.child:
        _child(args)
        return
    args.size_mib = args.size_mib or (16 if args.quick else 256)
    with tempfile.TemporaryDirectory(prefix="ftkit-bench-") as tmp:
        main_run = _launch(args, Path(tmp) / "main.json")
        os.environ["OMPI_MCA_btl"] = "tcp,self"
        tcp_run = _launch(args, Path(tmp) / "tcp.json", "--tcp-only")
    _report(args, {**main_run["seconds"], **tcp_run["seconds"]}, main_run["machine"])


if __name__ == "__main__":
    main()

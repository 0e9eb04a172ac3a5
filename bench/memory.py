"""Memory a rank holds for its node-local checkpoints, during steady-state saves.

    python bench/memory.py [--ranks 2] [--size-mib 256] [--saves 4] [--out bench/results]

Relaunches itself under the venv's mpiexec (one virtual node per rank). Each rank makes its
state (4 float32 torch tensors, --size-mib per rank), then, for a synchronous and an
asynchronous Checkpointer with ``local:1`` (node-local directory in a private /dev/shm
directory), measures --saves saves after 2 untimed warm-up saves (the state negated between
saves, as training would change it):

* ``peak_rss_mib``: peak resident memory above the resident memory before the Checkpointer
  existed (Linux ``VmHWM``, reset first): what ``ps``/``top`` and RSS-based accounting show.
  It counts the pages of node-local files the rank has *mapped* (its slots) too;
* ``peak_private_mib``: peak private (anonymous) resident memory above the same baseline,
  sampled every millisecond from ``/proc/self/statm`` (resident minus shared): memory the
  rank holds that no file holds (staging buffers, temporaries);
* ``node_local_mib``: bytes of the rank's node-local files after the last save (each inode
  once, allocated blocks): its checkpoint versions in RAM (tmpfs).

A rank's whole footprint is private + node-local; mapped slot pages are those same file pages
(``peak_rss`` counts them once more). Figures are the most any rank held. The goal's figure
(docs/performance.md) is ``peak_private_mib`` of a synchronous save as a fraction of the state.
Writes memory.json.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _mpi
import levels
from _mpi import PrivatePeak, private_bytes

WARMUP = 2
def node_local_bytes(root: Path) -> int:
    """Allocated bytes of the files under ``root``, each inode once (hard links)."""
    seen: dict[int, int] = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            seen[st.st_ino] = st.st_blocks * 512
    return sum(seen.values())


def _measure(topo: Any, state: dict[str, Any], local: Path, async_: bool, saves: int
             ) -> dict[str, float]:
    """One Checkpointer's figures on this rank, MiB (see the module docstring)."""
    from ftkit import Checkpointer
    from ftkit.config import Config
    job = f"memory-{'async' if async_ else 'sync'}"
    cfg = Config.load(env={}, levels="local:1", async_=async_, local_dir=str(local),
                      pfs_dir=str(local / "pfs"), job=job, timeout=600.0)
    topo.comm.Barrier()
    _mpi.reset_peak()
    rss, private = _mpi.status_kib("VmRSS") << 10, private_bytes()
    ckpt = Checkpointer(topo, cfg)
    try:
        with PrivatePeak() as peak:
            for step in range(1, WARMUP + saves + 1):
                levels.negate(state)
                ckpt.save(step, state)
                ckpt.wait()
        hwm = _mpi.status_kib("VmHWM") << 10
        node = node_local_bytes(local / job / f"node-{topo.node}")
    finally:
        ckpt.close()
    mib = 1 << 20
    return {"peak_rss_mib": (hwm - rss) / mib, "peak_private_mib": (peak.peak - private) / mib,
            "node_local_mib": node / mib}


def _child(args: argparse.Namespace) -> None:
    from mpi4py import MPI

    from ftkit.comm.topology import Topology

    comm = MPI.COMM_WORLD
    topo = Topology.create(comm, ranks_per_node=1)
    state = levels.make_state(topo.rank, args.size_mib << 20)
    out: dict[str, dict[str, float]] = {}
    with _mpi.scratch(comm, "/dev/shm") as (local,):
        for mode in ("sync", "async"):
            mine = _measure(topo, state, local, mode == "async", args.saves)
            every = comm.gather(mine)
            if comm.rank == 0:
                out[mode] = {k: round(max(m[k] for m in every), 1) for k in mine}
    if comm.rank == 0:
        lines = [f"memory[local:1 {mode}, {args.size_mib} MiB]: peak RSS +{f['peak_rss_mib']:.0f}"
                 f" MiB, peak private +{f['peak_private_mib']:.0f} MiB, node-local "
                 f"{f['node_local_mib']:.0f} MiB" for mode, f in out.items()]
        print("\n".join(lines), flush=True)
        _mpi.write_report(args.out, "memory", {
            "ranks": args.ranks, "state_mib": args.size_mib, "saves": args.saves,
            "warmup_saves": WARMUP, "per_rank_max": out, "machine": _mpi.machine(),
            "command": " ".join(["python bench/memory.py",
                                 *(a for a in sys.argv[1:] if a != "--child")])})
    topo.free()


def main() -> None:
    ap = _mpi.parser(__doc__)
    ap.set_defaults(ranks=2, size_mib=256)
    ap.add_argument("--saves", type=int, default=4, help="measured saves (after 2 warm-ups)")
    args = ap.parse_args()
    if args.ranks < 2 or args.size_mib < 1 or args.saves < 1:
        ap.error("--ranks >= 2, --size-mib >= 1 and --saves >= 1")
    _mpi.run(__file__, args, _child)


if __name__ == "__main__":
    main()

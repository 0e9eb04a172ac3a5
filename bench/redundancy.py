"""Partner / XOR / RS encode bandwidth next to MPI point-to-point bandwidth, same run.

    python bench/redundancy.py [--ranks 4] [--size-mib 64] [--repeat 3] [--out bench/results]

Relaunches itself under the venv's mpiexec (one virtual node per rank, so every exchange
crosses "nodes"). Each rank's shard is a real .ftk-sized file in a private tmpfs directory.
Every round times each operation once, in turn (p2p, tmpfs write, partner, XOR, RS with 1
parity block, RS with 2), on the same ranks; seconds are the best of the rounds, ratios the
median of per-round ratios with their spread. Prints ``name: value (ratio to X = r)`` lines
and writes redundancy.json, including ``level_costs_s`` for ``ftkit advise --measured``.

Goals (docs/performance.md): partner/XOR >= 0.7x p2p; RS encode >= 0.7x XOR encode of the
same set: ``rs_vs_xor_same_parity`` (RS with one parity block: the same tolerance and bytes
moved as XOR, so the ratio is what the GF(256) arithmetic costs). ``rs_vs_xor`` compares RS
with 2 parity blocks, which tolerates two losses and sends ``sent_bytes_per_rank["rs"]`` /
``["xor"]`` times XOR's bytes (3x on a set of 4); ``rs_vs_xor_per_byte_sent`` scales it by that.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _mpi


def _child(args: argparse.Namespace) -> None:
    from mpi4py import MPI

    from ftkit.capture.flatten import TensorLeaf
    from ftkit.comm.dist import DistComm
    from ftkit.comm.placement import erasure_sets, partner_map, set_of
    from ftkit.comm.topology import virtual_nodes
    from ftkit.faults import Faults
    from ftkit.fs import write_atomic
    from ftkit.storage.local import LocalLevel
    from ftkit.storage.redundancy.erasure import ErasureLevel
    from ftkit.storage.redundancy.partner import PartnerLevel
    from ftkit.storage.shard import write_shard

    comm = MPI.COMM_WORLD
    rank, world = comm.rank, comm.size
    nbytes = args.size_mib << 20
    root = Path(comm.bcast(tempfile.mkdtemp(prefix="ftkit-bench-", dir="/dev/shm")
                           if rank == 0 else None))
    rank_node = virtual_nodes(world, 1)
    local = LocalLevel(root / f"node-{rank}", rank=rank, node_leader=True,
                       faults=Faults("", rank=rank, node=rank, attempt=0), base=root)
    local.prepare()
    local.ensure_step_dir(1)
    data = np.frombuffer(np.random.default_rng(rank).bytes(nbytes), dtype=np.uint8)
    leaf = TensorLeaf("data", "numpy", "|u1", (nbytes,), nbytes)   # a real, verifiable shard
    write_shard(local.shard_path(1), {"job": "bench", "step": 1, "rank": rank,
                                      "world": world}, {"t": "tensor", "i": 0}, [leaf], [data])
    dc = DistComm(comm, 600.0)

    partners = partner_map(rank_node)
    src = partners.index(rank)
    out, back = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)

    def p2p() -> None:
        MPI.Request.Waitall([comm.Isend([out, MPI.BYTE], partners[rank]),
                             comm.Irecv([back, MPI.BYTE], src)])
    blob = np.random.default_rng(rank + 100).bytes(nbytes)
    ops = {"p2p": p2p,
           "tmpfs_write": lambda: write_atomic(local.step_dir(1) / "bound.bin", [blob])}
    partner = PartnerLevel(local, DistComm(comm, 600.0), partners, local.faults)
    ops["partner"] = lambda: partner.encode(1)
    for name, size, p in (("xor", world, 1), ("rs1", world, 1),
                          ("rs", world, min(2, world - 1))):
        sets = erasure_sets(rank_node, size, minimum=p + 1)
        sid, idx = set_of(sets, rank)
        level = ErasureLevel(name[:2] if name != "xor" else name, local,
                             dc.split(sid, idx), sid, sets[sid], p, local.faults)
        ops[name] = lambda lv=level: lv.encode(1)
    rounds: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(max(1, args.repeat)):            # alternating: every op once per round
        for name, fn in ops.items():
            rounds[name].append(_mpi.timed(comm, fn))
    results = {name: min(times) for name, times in rounds.items()}
    if rank == 0:
        _report(args, world, nbytes, results, rounds)
    comm.Barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)


def sent_per_rank(world: int, parity: int, nbytes: int) -> float:
    """Bytes each rank sends to encode a set of ``world`` members with ``parity`` blocks
    (the ring of :meth:`ErasureLevel._reduce_parity`: p (k - 1) segments of
    nbytes / (k - p))."""
    return parity * (world - 1) * nbytes / (world - parity)


def _report(args: argparse.Namespace, world: int, nbytes: int, t: dict[str, float],
            rounds: dict[str, list[float]]) -> None:
    gbs = {k: nbytes / v / 1e9 for k, v in t.items()}
    lines = [(f"mpi_p2p_bandwidth: {gbs['p2p']:.3f} GB/s (each rank sends and receives "
              f"{args.size_mib} MiB)"),
             (f"tmpfs_write_bandwidth: {gbs['tmpfs_write']:.3f} GB/s (every rank writes + "
              f"fsyncs {args.size_mib} MiB at once)")]
    bound = min(gbs["p2p"], gbs["tmpfs_write"])
    ratios, bound_ratios = {}, {}
    for name in ("partner", "xor", "rs1", "rs"):
        ratios[name] = gbs[name] / gbs["p2p"]
        bound_ratios[name] = gbs[name] / bound
        lines.append(f"{name}_encode_bandwidth: {gbs[name]:.3f} GB/s of shard per rank "
                     f"(ratio to mpi_p2p_bandwidth = {ratios[name]:.2f}; goal >= 0.7) "
                     f"(ratio to min(p2p, tmpfs write) = {bound_ratios[name]:.2f})")
    parity = {"xor": 1, "rs1": 1, "rs": min(2, world - 1)}
    sent = {k: sent_per_rank(world, p, nbytes) for k, p in parity.items()}
    # per round: XOR time / RS time of the same round (alternating rounds, same ranks)
    vs = {name: _mpi.spread([x / r for x, r in zip(rounds["xor"], rounds[name])])
          for name in ("rs1", "rs")}
    per_byte = vs["rs"]["median"] * sent["rs"] / sent["xor"]
    kernel = gf256_kernel()
    lines.append(f"rs_vs_xor_same_parity: {vs['rs1']['median']:.2f} (min {vs['rs1']['min']:.2f}"
                 f", max {vs['rs1']['max']:.2f}; RS with 1 parity block against XOR on the "
                 f"same set: same tolerance, same bytes moved; goal >= 0.7; GF(256) kernel: "
                 f"{kernel})")
    lines.append(f"rs_vs_xor: {vs['rs']['median']:.2f} (min {vs['rs']['min']:.2f}, max "
                 f"{vs['rs']['max']:.2f}; RS with {parity['rs']} parity blocks against XOR with "
                 f"1 on the same set; RS sends {sent['rs'] / sent['xor']:.2f}x XOR's bytes per "
                 f"rank, so per byte sent {per_byte:.2f})")
    print("\n".join(lines), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "command": "python bench/redundancy.py " + " ".join(a for a in sys.argv[1:]
                                                            if a != "--child"),
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                    "ranks": world, "note": "oversubscribed when ranks > cores"},
        "shard_bytes_per_rank": nbytes, "seconds": t,
        "rounds_s": {k: [round(v, 5) for v in r] for k, r in rounds.items()},
        "gb_per_s": gbs, "ratio_to_p2p": ratios, "ratio_to_min_p2p_tmpfs": bound_ratios,
        "goal_ratio": 0.7, "level_costs_s": {k: t[k] for k in ("partner", "xor", "rs")},
        "parity_blocks": parity, "sent_bytes_per_rank": sent,
        "rs_vs_xor_same_parity": vs["rs1"], "rs_vs_xor": vs["rs"],
        "rs_vs_xor_per_byte_sent": per_byte, "gf256_kernel": kernel,
    }
    (out / "redundancy.json").write_text(json.dumps(report, indent=1))


def gf256_kernel() -> str:
    from ftkit.storage.redundancy import gf256
    return gf256.kernel()


def main() -> None:
    _mpi.run(__file__, _mpi.parser(__doc__).parse_args(), _child)


if __name__ == "__main__":
    main()

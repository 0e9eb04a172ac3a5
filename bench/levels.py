"""ftkit's levels through the public Checkpointer API: save and restore time per level and size.

    python bench/levels.py [--ranks 4] [--ranks-per-node 2] [--sizes-mib 1,16,64,256,1024]
                           [--levels local,partner,...] [--repeat 3] [--quick]
                           [--name levels] [--out bench/results]

Relaunches itself under the venv's mpiexec on --ranks ranks (default 4) forming virtual nodes
of --ranks-per-node ranks (default 2; ``Topology.create(comm, ranks_per_node=...)``). For every state size per rank
(``--quick``: 1,16; ``--size-mib N`` is ``--sizes-mib N``) and every level configuration

    local = local:1   partner = local:1,partner:1   xor = local:1,xor:1
    rs = local:1,rs:1   pfs = local:1,pfs:1

a synchronous Checkpointer (``async_=False``: ``save`` returns after the whole protocol,
PFS flush included) with its node-local directory in a private /dev/shm directory and its PFS
directory in a private one under the system temp dir measures, best of --repeat, each timed
from a barrier to a barrier:

* save: ``save(step, state)`` at steps 1, 2, ... (2 untimed warm-up saves create the files;
  the state changes between saves, untimed), each timed round preceded by a memcpy of the
  same bytes on the same ranks (``save_vs_memcpy``: median, min, max of the per-round
  ratios) and by a ring exchange of them (each rank sends to the next, receives from the
  previous: ``save_vs_bound`` = the slower of memcpy and p2p over the save, per round;
  ``save_vs_serial`` = memcpy + p2p over the save, per round: a redundancy save must copy the
  state once and move it once, and where every core runs a rank (here) the two cannot
  overlap, so near 1 means at the floor of this machine; ``save_round_s``: every round's seconds, whose largest deviation from their
  median is the ``save spread`` figure); ``increment`` = save of the level - save of plain local at the same size (what
  the level itself costs; noise can make it negative);
* restore: ``restore(state)`` of a fresh Checkpointer, the state scrambled first and checked
  bit-exact afterwards. local: every file present; partner / xor / rs: the node-local
  directory of the last node removed first (rebuilt over MPI); pfs: every node-local
  directory removed (read from HDF5).

The state is 4 float32 torch tensors per rank, different on every rank. Erasure sets draw one
rank per node, so xor_set = rs_set = min(nodes, 4) and rs_parity = 1 below 4 nodes, else 2.
A (level, size) whose files would not fit in memory is skipped and listed under ``skipped``.
GB/s figures are per rank (state of one rank / seconds). Prints ``save[partner, 64 MiB]:
0.52 GB/s`` lines and writes ``<name>.json`` (default levels.json).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import shutil
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _mpi

RANKS_PER_NODE = 2
N_TENSORS = 4
#: untimed saves before the timed ones (the first saves create the slot files)
WARMUP = 2
LEVELS = {"local": "local:1", "partner": "local:1,partner:1", "xor": "local:1,xor:1",
          "rs": "local:1,rs:1", "pfs": "local:1,pfs:1"}
SIZES, QUICK_SIZES = "1,16,64,256,1024", "1,16"


# ------------------------------------------------------------------------ the state
def _expected(rank: int, i: int, n: int) -> Any:
    import torch
    return torch.arange(n, dtype=torch.float32).mul_(1 + rank).add_(i)


def make_state(rank: int, nbytes: int) -> dict[str, Any]:
    n = max(1, nbytes // 4 // N_TENSORS)
    return {f"t{i}": _expected(rank, i, n) for i in range(N_TENSORS)}


def _check(state: dict[str, Any], rank: int, what: str) -> None:
    import torch
    for i in range(N_TENSORS):
        t = state[f"t{i}"]
        if not torch.equal(t, _expected(rank, i, t.numel())):
            raise AssertionError(f"rank {rank}: {what}: tensor t{i} differs from the saved one")


# ---------------------------------------------------------------------- settings
def _settings(nodes: int) -> dict[str, int]:
    size = min(nodes, 4)
    return {"xor_set": size, "rs_set": size, "rs_parity": 1 if size < 4 else 2}


def _no_room(level: str, nbytes: int, world: int, settings: dict[str, int]) -> str | None:
    """Why (level, size) would not fit in memory here, or None. Node-local files: two
    versions (retention keeps the previous committed step) of shard + redundancy; plus one
    staging copy of the state."""
    extra = {"partner": 1.0, "xor": 1 / (settings["xor_set"] - 1),
             "rs": settings["rs_parity"] / (settings["rs_set"] - settings["rs_parity"])}
    need = world * nbytes * (2 * (1 + extra.get(level, 0.0)) + 1)
    with open("/proc/meminfo") as fh:
        avail = next(int(ln.split()[1]) << 10 for ln in fh if ln.startswith("MemAvailable:"))
    room = min(avail, shutil.disk_usage("/dev/shm").free)
    if need > 0.9 * room:
        return f"needs ~{need / 2**30:.1f} GiB of memory and /dev/shm, {room / 2**30:.1f} free"
    return None


# ---------------------------------------------------------------------- measuring
@dataclasses.dataclass
class Saved:
    """Steady-state saves of one level and size (:func:`_save`)."""

    rounds: list[float]               # seconds of each timed save
    cost: dict[str, Any]              # :func:`_mpi.costs` of one more save
    vs_memcpy: list[float]            # per round: memcpy seconds / save seconds
    vs_bound: list[float]             # per round: max(memcpy, p2p) seconds / save seconds
    vs_serial: list[float]            # per round: (memcpy + p2p) seconds / save seconds
    last: int                         # the last step saved


def _save(topo: Any, cfg: Any, state: dict[str, Any], repeat: int) -> Saved:
    """Steady-state saves (after :data:`WARMUP` untimed ones, which create the files),
    ``repeat`` rounds, each timed right after a memcpy and a ring exchange (``Sendrecv`` to
    the next rank, from the previous) of the same bytes on the same ranks. Between saves
    the state changes (every tensor negated, untimed); the last save holds it as it was."""

    from ftkit import Checkpointer
    ckpt = Checkpointer(topo, cfg)
    steps = itertools.count(1)
    memcpy, p2p = _memcpy_timer(topo, state), _p2p_timer(topo, state)
    out = Saved([], {}, [], [], [], 0)
    try:
        for _ in range(WARMUP):
            ckpt.save(next(steps), state)
        for _ in range(repeat):
            negate(state)
            copy, wire = memcpy(), p2p()
            seconds = _mpi.timed(topo.comm, lambda: ckpt.save(next(steps), state))
            out.rounds.append(seconds)
            out.vs_memcpy.append(copy / seconds)
            out.vs_bound.append(max(copy, wire) / seconds)
            out.vs_serial.append((copy + wire) / seconds)
        if repeat % 2:
            negate(state)
        out.cost = _mpi.costs(topo.comm, lambda: ckpt.save(next(steps), state),
                              _state_bytes(state))
        out.last = next(steps) - 1
        return out
    finally:
        ckpt.close()


def _memcpy_timer(topo: Any, state: dict[str, Any]) -> Any:
    """A function timing (barrier to barrier) a memcpy of the state's bytes per rank,
    between two buffers touched once here (no first-touch faults in the timed copies)."""
    import numpy as np
    src = np.ones(_state_bytes(state), dtype=np.uint8)
    dst = np.zeros_like(src)
    return lambda: _mpi.timed(topo.comm, lambda: np.copyto(dst, src))


def _p2p_timer(topo: Any, state: dict[str, Any]) -> Any:
    """A function timing (barrier to barrier) every rank sending the state's bytes to the
    next rank while receiving as many from the previous one (MPI point-to-point; with one
    rank per node, what a partner copy moves), between buffers touched once here."""
    import numpy as np
    from mpi4py import MPI
    comm = topo.comm
    src = np.ones(_state_bytes(state), dtype=np.uint8)
    dst = np.zeros_like(src)
    nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    return lambda: _mpi.timed(comm, lambda: comm.Sendrecv([src, MPI.BYTE], nxt, 7,
                                                            [dst, MPI.BYTE], prv, 7))


def negate(state: dict[str, Any]) -> None:
    for t in state.values():
        t.neg_()


def _state_bytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _wipe(topo: Any, cfg: Any, nodes: list[int]) -> None:
    """Every node in ``nodes`` loses its node-local directory (its leader removes it)."""
    topo.comm.Barrier()
    if topo.is_node_leader and topo.node in nodes:
        shutil.rmtree(cfg.node_dir(topo.node), ignore_errors=True)
    topo.comm.Barrier()


def _restore_once(topo: Any, cfg: Any, state: dict[str, Any], lost: list[int],
                  measure: Any = _mpi.timed) -> tuple[Any, int]:
    """``measure`` (seconds, or :func:`_mpi.costs`) and step of a fresh Checkpointer's
    restore after ``lost`` nodes lost their node-local directories (the state is scrambled
    first)."""
    from ftkit import Checkpointer
    _wipe(topo, cfg, lost)
    ckpt = Checkpointer(topo, cfg)
    for t in state.values():
        t.zero_()
    got: list[int] = []
    figure = measure(topo.comm, lambda: got.append(ckpt.restore(state)))
    ckpt.close()
    return figure, got[0]


def _restore(topo: Any, cfg: Any, state: dict[str, Any], level: str, repeat: int,
             want: int) -> tuple[float, dict[str, Any], list[float]]:
    """Best seconds of restoring the newest step after the level's loss (``repeat``
    rounds), the costs of one more, and per round the ratio memcpy / restore, a memcpy of
    the same bytes on the same ranks timed just before each restore (alternating); the state
    checked every time."""
    lost = {"local": [], "pfs": topo.nodes}.get(level, topo.nodes[-1:])
    best = float("inf")                            # ``want``: the newest step saved
    memcpy = _memcpy_timer(topo, state)
    ratios = []
    for _ in range(repeat):
        copy = memcpy()
        seconds, step = _restore_once(topo, cfg, state, lost)
        if step != want:
            raise AssertionError(f"{level}: restore returned step {step}, expected {want}")
        _check(state, topo.rank, f"restore of {level}")
        best = min(best, seconds)
        ratios.append(copy / seconds)
    cost, _ = _restore_once(topo, cfg, state, lost,
                            lambda comm, fn: _mpi.costs(comm, fn, _state_bytes(state)))
    _check(state, topo.rank, f"restore of {level}")
    return best, cost, ratios


def _config(level: str, size: int, local: str, pfs: str, settings: dict[str, int]) -> Any:
    from ftkit.config import Config
    return Config.load(env={}, levels=LEVELS[level], async_=False, local_dir=local,
                       pfs_dir=pfs, job=f"{level}-{size}", timeout=600.0,
                       xor_set=settings["xor_set"], rs_set=settings["rs_set"],
                       rs_parity=settings["rs_parity"])


def _drop(topo: Any, cfg: Any) -> None:
    """Remove the job's node-local and PFS files (the next job starts on empty levels)."""
    _wipe(topo, cfg, topo.nodes)
    if topo.rank == 0:
        shutil.rmtree(cfg.job_pfs_dir, ignore_errors=True)


def _measure(args: argparse.Namespace, topo: Any, local: str, pfs: str,
             settings: dict[str, int]) -> dict[str, dict[str, dict[str, Any]]]:
    """{"save_s"|"restore_s"|"skipped": {level: {size: value}}} (same on every rank)."""
    out: dict[str, dict[str, dict[str, Any]]] = {"save_s": {}, "restore_s": {}, "skipped": {},
                                                 "save_costs": {}, "restore_costs": {},
                                                 "restore_vs_memcpy": {},
                                                 "save_vs_memcpy": {}, "save_round_s": {},
                                                 "save_vs_bound": {}, "save_vs_serial": {}}
    for size in args.sizes:
        state, key = make_state(topo.rank, size << 20), str(size)
        for level in args.levels:
            why = topo.comm.bcast(_no_room(level, size << 20, topo.world, settings)
                                  if topo.rank == 0 else None)
            if why:
                out["skipped"].setdefault(level, {})[key] = why
                continue
            cfg = _config(level, size, local, pfs, settings)
            got = _save(topo, cfg, state, args.repeat)
            saved = (min(got.rounds), got.cost)
            out["save_round_s"].setdefault(level, {})[key] = [round(r, 5) for r in got.rounds]
            out["save_vs_bound"].setdefault(level, {})[key] = _mpi.spread(got.vs_bound)
            out["save_vs_serial"].setdefault(level, {})[key] = _mpi.spread(got.vs_serial)
            *restored, ratios = _restore(topo, cfg, state, level, args.repeat, got.last)
            for op, (seconds, cost) in (("save", saved), ("restore", restored)):
                out[f"{op}_s"].setdefault(level, {})[key] = seconds
                out[f"{op}_costs"].setdefault(level, {})[key] = cost
            out["restore_vs_memcpy"].setdefault(level, {})[key] = _mpi.spread(ratios)
            out["save_vs_memcpy"].setdefault(level, {})[key] = _mpi.spread(got.vs_memcpy)
            _drop(topo, cfg)
        del state
    return out


def _child(args: argparse.Namespace) -> None:
    from mpi4py import MPI

    from ftkit.comm.topology import Topology

    comm = MPI.COMM_WORLD
    topo = Topology.create(comm, ranks_per_node=args.ranks_per_node)
    settings = _settings(len(topo.nodes))
    with _mpi.scratch(comm, "/dev/shm", tempfile.gettempdir()) as (local, pfs):
        res = _measure(args, topo, str(local), str(pfs), settings)
    if comm.rank == 0:
        _report(args, len(topo.nodes), settings, res)
    topo.free()


# ----------------------------------------------------------------------- reporting
def cost_line(cost: dict[str, Any]) -> str:
    """``3.00 passes (copy 1.00, hash 1.00, write 1.00); CPU 0.012 s; peak +0.0 MiB``."""
    kinds = ", ".join(f"{k} {v:.2f}" for k, v in cost["passes"].items() if k != "total" and v)
    return (f"{cost['passes']['total']:.2f} passes ({kinds or 'none'}); CPU "
            f"{cost['cpu_s']:.3f} s; peak +{cost['peak_extra_mib']:.1f} MiB")


def _per_rank_gbs(seconds: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    return {lv: {s: (int(s) << 20) / v / 1e9 for s, v in per.items()}
            for lv, per in seconds.items()}


def _increments(save: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    base = save.get("local", {})
    return {lv: {s: v - base[s] for s, v in per.items() if s in base}
            for lv, per in save.items() if lv != "local"}


def _report(args: argparse.Namespace, nodes: int, settings: dict[str, int],
            res: dict[str, dict[str, dict[str, Any]]]) -> None:
    save, restore = res["save_s"], res["restore_s"]
    save_gbs, restore_gbs, inc = _per_rank_gbs(save), _per_rank_gbs(restore), _increments(save)
    lines = []
    for size, level in itertools.product(map(str, args.sizes), args.levels):
        if size not in save.get(level, {}):
            lines.append(f"save[{level}, {size} MiB]: skipped ({res['skipped'][level][size]})")
            continue
        lines.append(f"save[{level}, {size} MiB]: {save_gbs[level][size]:.2f} GB/s "
                     f"({save[level][size]:.4f} s)")
        if size in inc.get(level, {}):         # needs plain local at the same size
            lines.append(f"increment[{level}, {size} MiB]: {inc[level][size]:+.4f} s")
        lines.append(f"restore[{level}, {size} MiB]: {restore_gbs[level][size]:.2f} GB/s "
                     f"({restore[level][size]:.4f} s)")
        for label, key in (("save/max(memcpy,p2p)", "save_vs_bound"),
                           ("save/(memcpy+p2p)", "save_vs_serial"),
                           ("save/memcpy", "save_vs_memcpy"),
                           ("restore/memcpy", "restore_vs_memcpy")):
            vs = res[key][level][size]
            lines.append(f"{label}[{level}, {size} MiB]: {vs['median']:.3f} "
                         f"(min {vs['min']:.3f}, max {vs['max']:.3f}, alternating rounds)")
        for op in ("save", "restore"):
            lines.append(f"costs[{op}, {level}, {size} MiB]: "
                         f"{cost_line(res[f'{op}_costs'][level][size])}")
    print("\n".join(lines), flush=True)
    _mpi.write_report(args.out, args.name, {
        "ranks": args.ranks, "nodes": nodes, "sizes_mib": args.sizes, "repeat": args.repeat,
        "save_s": save, "save_gb_per_s": save_gbs, "increment_s": inc,
        "restore_s": restore, "restore_gb_per_s": restore_gbs, "skipped": res["skipped"],
        "save_costs": res["save_costs"], "restore_costs": res["restore_costs"],
        "restore_vs_memcpy": res["restore_vs_memcpy"], "save_vs_memcpy": res["save_vs_memcpy"],
        "save_round_s": res["save_round_s"], "save_vs_bound": res["save_vs_bound"],
        "save_vs_serial": res["save_vs_serial"],
        "warmup_saves": WARMUP,
        "settings": {**settings, "ranks_per_node": args.ranks_per_node, "async": False},
        "levels": {lv: LEVELS[lv] for lv in args.levels}, "machine": _mpi.machine(),
        "command": " ".join(["python bench/levels.py",
                             *(a for a in sys.argv[1:] if a != "--child")])})


def main() -> None:
    ap = _mpi.parser(__doc__)
    ap.set_defaults(size_mib=None)
    ap.add_argument("--sizes-mib", default=None,
                    help=f"state sizes per rank, MiB (default {SIZES}; --quick {QUICK_SIZES})")
    ap.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES} MiB")
    ap.add_argument("--ranks-per-node", type=int, default=RANKS_PER_NODE,
                    help=f"ranks per virtual node (default {RANKS_PER_NODE})")
    ap.add_argument("--levels", default=",".join(LEVELS),
                    help=f"level configurations to measure (default {','.join(LEVELS)})")
    ap.add_argument("--name", default="levels", help="report name: <out>/<name>.json")
    args = ap.parse_args()
    args.levels = [lv for lv in args.levels.split(",") if lv]
    if not args.levels or set(args.levels) - set(LEVELS):
        ap.error(f"--levels: a comma-separated subset of {','.join(LEVELS)}")
    per = args.ranks_per_node
    if per < 1 or args.ranks < 2 * per or args.ranks % per:
        ap.error(f"--ranks must be a multiple of --ranks-per-node ({per}) and >= {2 * per} "
                 f"(2 nodes at least), got {args.ranks}")
    text = args.sizes_mib or (str(args.size_mib) if args.size_mib else
                              QUICK_SIZES if args.quick else SIZES)
    args.sizes = [int(s) for s in text.split(",") if s.strip()]
    if args.repeat < 1 or not args.sizes or min(args.sizes) < 1:
        ap.error("--repeat and every size must be >= 1")
    _mpi.run(__file__, args, _child)


if __name__ == "__main__":
    main()

"""ftkit's HDF5 (PFS level) save/load next to torch DCP and torch.save, same ranks, same run.

    python bench/hdf5_vs_dcp.py [--ranks 4] [--size-mib 64] [--repeat 3] [--out bench/results]
                                [--ranks-per-node 0] [--pfs-root /tmp] [--quick]

Relaunches itself under the venv's mpiexec. Every rank holds the same kind of state: float32
and bfloat16 tensors totalling --size-mib MiB (different on every rank) plus an nn.Linear
model, all under a rank-unique key (``r<rank>``) so that DCP's planner does not treat equal
names on different ranks as replicas and write them once.

Measured, best of --repeat, all ranks between two barriers, files on the same file system:

* ``ftkit_hdf5_save``: ``PfsLevel.flush`` (node leader gathers its ranks' node-local shards
  over MPI, writes ``node-<id>.h5``, fsync, index, COMMITTED), timed inside a real
  ``Checkpointer.save`` with ``levels=local:1,pfs:1`` and ``async_=False``;
  ``ftkit_save_total`` is the whole ``save`` (capture + node-local + commit + flush).
* ``ftkit_hdf5_load``: ``Checkpointer.restore`` on a fresh Checkpointer after the node-local
  directory was deleted, so it goes through ``restore_from_pfs``.
* ``torch_dcp_save`` / ``torch_dcp_load``: ``torch.distributed.checkpoint.save`` / ``load``
  with ``FileSystemWriter`` / ``FileSystemReader`` (defaults: one file per rank, fsync) over a
  gloo process group; ``torch_dcp_async_save`` (end to end) when it works on CPU.
* ``torch_save`` / ``torch_load``: ``torch.save`` (+ fsync) / ``torch.load`` + copy into the
  live tensors, one file per rank.

The page cache cannot be dropped here: loads may be served from it, for every method alike.
Throughput is bytes of state summed over all ranks / seconds. Goal (README.md, Performance): HDF5 save and
load >= 1.5x DCP. Prints ``name: value (ratio to X = r)`` lines, writes hdf5_vs_dcp.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import _mpi
from _common import init_torch_distributed

GOAL = 1.5
N_TENSORS = 8
#: (ftkit method, peer it is held to the goal against)
GOALS = {"ftkit_hdf5_save": "torch_dcp_save", "ftkit_hdf5_load": "torch_dcp_load"}



# ------------------------------------------------------------------------ the state
def make_state(rank: int, nbytes: int) -> tuple[dict[str, Any], Any]:
    """``{"r<rank>": {"model": nn.Linear, "tensors": {...}}}`` and the Linear module."""
    import torch

    gen = torch.Generator().manual_seed(1000 + rank)
    tensors = {}
    for i in range(N_TENSORS):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        share = nbytes // N_TENSORS
        n = max(1, share // dtype.itemsize)
        cols = 1024 if n >= 4096 else 1
        t = torch.randn(n // cols, cols, generator=gen, dtype=torch.float32).to(dtype)
        tensors[f"t{i}"] = t
    torch.manual_seed(rank)
    model = torch.nn.Linear(256, 256)
    return {f"r{rank}": {"model": model, "tensors": tensors}}, model


def _flat(state: dict[str, Any]) -> dict[str, Any]:
    """Name -> live tensor (the model's parameters share storage with their state_dict)."""
    (key, inner), = state.items()
    out = {f"{key}/tensors/{k}": v for k, v in inner["tensors"].items()}
    out.update({f"{key}/model/{k}": v for k, v in inner["model"].state_dict().items()})
    return out


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    """The same state with the module replaced by its state_dict (for DCP / torch.save)."""
    (key, inner), = state.items()
    return {key: {"model": inner["model"].state_dict(), "tensors": inner["tensors"]}}


def _state_bytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in _flat(state).values())


def _scramble(state: dict[str, Any]) -> None:
    import torch
    with torch.no_grad():
        for t in _flat(state).values():
            t.zero_()


def _check(state: dict[str, Any], ref: dict[str, Any], what: str) -> None:
    import torch
    live = _flat(state)
    bad = [k for k, v in ref.items() if not torch.equal(live[k], v)]
    if bad:
        raise AssertionError(f"{what}: restored tensors differ from the saved ones: {bad}")


# ---------------------------------------------------------------------- measuring
def _timed(comm: Any, fn: Callable[[], Any], before: Callable[[], Any] | None = None
           ) -> float:
    """Seconds from a barrier before ``fn`` to a barrier after it on every rank. Dirty pages
    of earlier steps are written back first (``sync``), so no method pays for another's."""
    if before is not None:
        before()
    comm.Barrier()
    if comm.rank == 0:
        os.sync()
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    comm.Barrier()
    return time.perf_counter() - t0


def _raw_views(state: dict[str, Any]) -> list[Any]:
    """uint8 numpy views of every tensor of the state (no copy)."""
    import torch
    return [t.detach().view(-1).view(torch.uint8).numpy() for t in _flat(state).values()]


def _fs_write(path: Path, views: list[Any]) -> None:
    """The file-system bound: write(2) every tensor's bytes into one file, fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for v in views:
            mv = memoryview(v)
            while mv:
                mv = mv[os.write(fd, mv):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fs_read(path: Path, views: list[Any]) -> None:
    """The file-system bound: readinto(2) the file straight into the live tensors."""
    with open(path, "rb", buffering=0) as fh:
        for v in views:
            mv = memoryview(v)
            while mv:
                n = fh.readinto(mv)
                if not n:
                    raise EOFError(path)
                mv = mv[n:]


def _rm(comm: Any, *paths: Path) -> None:
    comm.Barrier()
    if comm.rank == 0:
        for p in paths:
            shutil.rmtree(p, ignore_errors=True)
    comm.Barrier()



def _child(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from mpi4py import MPI

    from ftkit import Checkpointer
    from ftkit.comm.topology import Topology
    from ftkit.config import Config

    comm = MPI.COMM_WORLD
    rank = comm.rank
    pfs_root = Path(comm.bcast(tempfile.mkdtemp(prefix="ftkit-bench-pfs-", dir=args.pfs_root)
                               if rank == 0 else None))
    local_root = Path(comm.bcast(tempfile.mkdtemp(prefix="ftkit-bench-", dir="/dev/shm")
                                 if rank == 0 else None))
    ok = False
    try:
        state, _model = make_state(rank, args.size_mib << 20 if not args.quick else 256 << 10)
        ref = {k: v.clone() for k, v in _flat(state).items()}
        nbytes = comm.allreduce(_state_bytes(state))
        topo = Topology.create(comm, ranks_per_node=args.ranks_per_node)
        cfg = Config.load(env={}, levels="local:1,pfs:1", async_=False,
                          local_dir=str(local_root), pfs_dir=str(pfs_root), job="bench",
                          timeout=600.0)
        init_torch_distributed(comm, timeout_s=600)
        t: dict[str, float] = {}
        skipped: dict[str, str] = {}

        def best(name: str, seconds: float) -> None:
            t[name] = min(t.get(name, math.inf), seconds)

        # ---------------------------------------------------------------- saves
        ckpt = Checkpointer(topo, cfg)
        flush_s: list[float] = []
        flush = ckpt.pfs.flush

        def timed_flush(step: int) -> float:
            t0 = time.perf_counter()
            try:
                return flush(step)
            finally:
                flush_s.append(time.perf_counter() - t0)
        ckpt.pfs.flush = timed_flush  # type: ignore[method-assign]

        dcp_dir = torch_dir = async_dir = pfs_root / "none"
        bound = pfs_root / f"bound-{rank}.bin"
        views = _raw_views(state)
        for i in range(args.repeat):
            best("fs_write", _timed(comm, lambda: _fs_write(bound, views)))

            step = i + 1
            old = [cfg.job_pfs_dir / f"step-{i}"] if i else []
            best("ftkit_save_total", _timed(comm, lambda s=step: ckpt.save(s, state),
                                            lambda o=old: _rm(comm, *o)))
            best("ftkit_hdf5_save", comm.allreduce(flush_s[-1], op=MPI.MAX))

            old, dcp_dir = [dcp_dir], pfs_root / f"dcp-{i}"
            best("torch_dcp_save", _timed(
                comm, lambda d=dcp_dir: dcp.save(_plain(state),
                                                 storage_writer=dcp.FileSystemWriter(d)),
                lambda o=old: _rm(comm, *o)))

            if "torch_dcp_async_save" not in skipped:
                old, async_dir = [async_dir], pfs_root / f"dcp-async-{i}"
                try:
                    blocked: list[float] = []

                    def async_save(d: Path = async_dir, blocked: list[float] = blocked
                                   ) -> None:
                        t0 = time.perf_counter()
                        res = dcp.async_save(_plain(state),
                                             storage_writer=dcp.FileSystemWriter(d))
                        blocked.append(time.perf_counter() - t0)
                        fut = res if hasattr(res, "result") else res.upload_completion
                        fut.result()
                    best("torch_dcp_async_save", _timed(comm, async_save,
                                                        lambda o=old: _rm(comm, *o)))
                    best("torch_dcp_async_save_blocking", comm.allreduce(blocked[-1],
                                                                         op=MPI.MAX))
                except Exception as exc:  # noqa: BLE001 - a peer that does not work here
                    skipped["torch_dcp_async_save"] = f"{type(exc).__name__}: {exc}"
                    t.pop("torch_dcp_async_save", None)
                    if rank == 0:
                        print(f"torch_dcp_async_save: skipped ({exc})", file=sys.stderr)

            old, torch_dir = [torch_dir], pfs_root / f"torch-{i}"

            def tsave(d: Path = torch_dir) -> None:
                d.mkdir(parents=True, exist_ok=True)
                with open(d / f"rank-{rank}.pt", "wb") as fh:
                    torch.save(_plain(state), fh)
                    fh.flush()
                    os.fsync(fh.fileno())
            best("torch_save", _timed(comm, tsave, lambda o=old: _rm(comm, *o)))
        ckpt.close()

        # ---------------------------------------------------------------- loads
        last = args.repeat
        for _ in range(args.repeat):
            _rm(comm, cfg.job_local_dir)        # node-local copies gone: restore from PFS
            fresh = Checkpointer(topo, cfg)
            got: list[int] = []
            best("ftkit_hdf5_load", _timed(comm, lambda c=fresh, g=got: g.append(c.restore(state)),
                                           lambda: _scramble(state)))
            fresh.close()
            if got != [last]:
                raise AssertionError(f"restore returned step {got}, expected {last}")
            _check(state, ref, "ftkit restore_from_pfs")

            best("torch_dcp_load", _timed(
                comm, lambda: dcp.load(_plain(state), storage_reader=dcp.FileSystemReader(
                    dcp_dir)), lambda: _scramble(state)))
            _check(state, ref, "dcp.load")

            def tload() -> None:
                loaded = torch.load(torch_dir / f"rank-{rank}.pt", weights_only=True)
                (key, inner), = state.items()
                with torch.no_grad():
                    for k, v in loaded[key]["tensors"].items():
                        inner["tensors"][k].copy_(v)
                inner["model"].load_state_dict(loaded[key]["model"])
            best("torch_load", _timed(comm, tload, lambda: _scramble(state)))
            _check(state, ref, "torch.load")

            best("fs_read", _timed(comm, lambda: _fs_read(bound, views),
                                   lambda: _scramble(state)))
            _check(state, ref, "fs read")

        rss = comm.gather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, root=0)
        dist.destroy_process_group()
        if rank == 0:
            _report(args, comm.size, len(topo.nodes), nbytes, t, skipped, rss, pfs_root)
        ok = True
    finally:
        if ok:
            _rm(comm, pfs_root, local_root)
        else:       # no barrier: the other ranks may be elsewhere; mpi4py aborts the job
            for p in (pfs_root, local_root):
                shutil.rmtree(p, ignore_errors=True)


# ----------------------------------------------------------------------- reporting
def _fs_type(path: Path) -> str:
    best, kind = "", "?"
    try:
        with open("/proc/mounts") as fh:
            for line in fh:
                _dev, mnt, fstype, *_ = line.split()
                if str(path).startswith(mnt) and len(mnt) > len(best):
                    best, kind = mnt, fstype
    except OSError:
        pass
    return f"{kind} ({best})"


def _machine(world: int, nodes: int, pfs_root: Path) -> dict[str, Any]:
    import h5py

    from ftkit import __version__
    cores = os.cpu_count() or 1
    return {**_mpi.machine(), "ranks": world, "oversubscribed": world > cores,
            "ftkit_nodes": nodes, "hdf5": h5py.version.hdf5_version, "ftkit": __version__,
            "pfs_dir_fs": _fs_type(pfs_root), "local_dir_fs": _fs_type(Path("/dev/shm")),
            "page_cache": "not dropped (no privilege): loads may be served from the page "
                          "cache, for every method alike"}


def _report(args: argparse.Namespace, world: int, nodes: int, nbytes: int,
            t: dict[str, float], skipped: dict[str, str], rss: list[int], pfs_root: Path
            ) -> None:
    gbs = {k: nbytes / v / 1e9 for k, v in t.items() if not k.endswith("_blocking")}
    # throughput ratio a/b = seconds of b / seconds of a; the goal pairs come first
    pairs = [*GOALS.items(), ("ftkit_save_total", "torch_dcp_save"),
             ("ftkit_hdf5_save", "torch_dcp_async_save"),
             ("ftkit_save_total", "torch_dcp_async_save"), ("ftkit_hdf5_save", "torch_save"),
             ("ftkit_hdf5_load", "torch_load"), ("ftkit_hdf5_save", "fs_write"),
             ("ftkit_hdf5_load", "fs_read"), ("torch_dcp_save", "fs_write"),
             ("torch_dcp_load", "fs_read")]
    ratios = {f"{a}/{b}": t[b] / t[a] for a, b in pairs if a in t and b in t}

    def line(name: str, *peers: str, goal: bool = False) -> str:
        s = f"{name}: {gbs[name]:.3f} GB/s ({t[name]:.3f} s)"
        for i, peer in enumerate(peers):
            key = f"{name}/{peer}"
            if key in ratios:
                s += f" (ratio to {peer} = {ratios[key]:.2f}"
                s += f"; goal >= {GOAL})" if goal and i == 0 else ")"
        return s
    lines = [(f"state: {nbytes / 2**20:.1f} MiB over {world} ranks ({nodes} ftkit node(s)), "
              f"best of {args.repeat}"),
             line("ftkit_hdf5_save", "torch_dcp_save", "torch_dcp_async_save", "torch_save",
                  "fs_write", goal=True),
             line("ftkit_hdf5_load", "torch_dcp_load", "torch_load", "fs_read", goal=True),
             line("ftkit_save_total", "torch_dcp_save", "torch_dcp_async_save")
             + " (capture + node-local + commit + flush)",
             line("torch_dcp_save", "fs_write"), line("torch_dcp_load", "fs_read")]
    if "torch_dcp_async_save" in t:
        lines.append(line("torch_dcp_async_save") + f" (blocking "
                     f"{t['torch_dcp_async_save_blocking']:.3f} s)")
    else:
        lines.append(f"torch_dcp_async_save: skipped ({skipped.get('torch_dcp_async_save')})")
    lines += [line("torch_save") + " (+ fsync)", line("torch_load") + " (+ copy into state)",
              line("fs_write") + " (bound: every rank write(2)s its tensors to its own file "
              "+ fsync, at once)",
              line("fs_read") + " (bound: every rank readinto(2)s its file into its tensors)",
              f"peak_rss_per_rank: {max(rss) / 2**20:.0f} MiB (max over ranks)"]
    print("\n".join(lines), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "command": "python bench/hdf5_vs_dcp.py " + " ".join(a for a in sys.argv[1:]
                                                             if a != "--child"),
        "machine": _machine(world, nodes, pfs_root),
        "state_bytes_all_ranks": nbytes, "repeat": args.repeat, "quick": args.quick,
        "seconds": t, "gb_per_s": gbs, "ratios": ratios,
        "goal": {"ratio": GOAL, "pairs": GOALS,
                 "met": {k: ratios[f"{k}/{v}"] >= GOAL for k, v in GOALS.items()}},
        "skipped": skipped, "peak_rss_per_rank_bytes": rss,
        "notes": [("ftkit_hdf5_save times PfsLevel.flush (max over ranks) inside "
                   "Checkpointer.save(levels=local:1,pfs:1, async_=False)"),
                  ("DCP: FileSystemWriter/Reader defaults (single_file_per_rank, sync_files, "
                   "thread_count=1), gloo process group"),
                  "torch_save fsyncs its file; torch_load copies into the live tensors",
                  ("fs_write / fs_read: plain write(2)+fsync / readinto(2) of each rank's raw "
                   "tensor bytes, one file per rank: what the file system allows"),
                  "every timed section starts after sync(2) and a barrier"],
    }
    (out / "hdf5_vs_dcp.json").write_text(json.dumps(report, indent=1))


def main() -> None:
    ap = _mpi.parser(__doc__)
    ap.add_argument("--ranks-per-node", type=int, default=0,
                    help="ftkit virtual nodes of this many ranks (0: real nodes)")
    ap.add_argument("--pfs-root", default="/tmp",
                    help="directory on the file system all methods write to")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: 256 KiB per rank, one repeat")
    args = ap.parse_args()
    if args.quick:
        args.repeat = 1
    _mpi.run(__file__, args, _child)


if __name__ == "__main__":
    main()

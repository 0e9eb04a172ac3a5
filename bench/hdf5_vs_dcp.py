"""ftkit's HDF5 (PFS level) save/load next to torch DCP and torch.save, same ranks, same run.

    python bench/hdf5_vs_dcp.py [--ranks 4] [--size-mib 64] [--repeat 3] [--load-repeat 0]
                                [--out bench/results]
                                [--ranks-per-node 0] [--pfs-root /tmp] [--dcp-threads 4]
                                [--name hdf5_vs_dcp] [--quick]

Relaunches itself under the venv's mpiexec. Every rank holds the same kind of state: float32
and bfloat16 tensors totalling --size-mib MiB (different on every rank) plus an nn.Linear
model, all under a rank-unique key (``r<rank>``) so that DCP's planner does not treat equal
names on different ranks as replicas and write them once.

Measured --repeat times, all ranks between two barriers, files on the same file system
(--pfs-root), every write fsynced; the rounds alternate between the methods (saves and loads
alike: this virtual disk slows down after a few GiB written, so back-to-back rounds of one
method would see another disk than the next method's; the restores also rotate their order
every round, --load-repeat rounds of them). Every figure is the **median** of its
rounds (``spread``: min and max; ``rounds``: every one), not the best: identical rounds on
this disk differ by 1.5x and more, and a best-of picks each method's luckiest round. Two
untimed rounds of every save method come first (``WARMUP``: 2), as does one of the stall's:

* ``ftkit_hdf5_save``: the PFS write (every rank writes ``rank-<r>.h5``, all at once; node
  leaders a ``node-<id>.h5`` of links; fsync, index, COMMITTED), timed inside a real
  ``Checkpointer.save`` with ``levels=local:1,pfs:1`` and ``async_=False`` from the start of
  the rank's early write (in its capture: the file is written from the slot as tensors
  land, then renamed into the step by ``PfsLevel.flush``) to the end of the flush, max over
  ranks — it includes the waits for the capture, so it is no less than the write itself;
  ``ftkit_save_total`` is the whole ``save``: the time until the step is durable on the PFS
  (capture + node-local + commit + flush);
* ``ftkit_pfs_stall`` vs ``torch_dcp_async_save_blocking``: what a step that goes to the PFS
  costs a training loop (an MLP + Adam of --size-mib per rank; ftkit's wait inside the next
  ``optimizer.step()`` counted), with the iterations' times (see ``_stall.py``);
* ``ftkit_hdf5_load``: ``Checkpointer.restore`` on a fresh Checkpointer after the node-local
  directory was deleted (``restore_from_pfs``), **cold**; ``ftkit_local_load``: the same
  restore with the node-local directory present (the node-local level: memory);
* ``torch_dcp_save`` / ``torch_dcp_save_threads`` / ``torch_dcp_load``:
  ``torch.distributed.checkpoint.save`` (``FileSystemWriter``: one file per rank, fsync; 1
  and --dcp-threads writer threads) / ``load`` (cold) over a gloo process group;
  ``torch_dcp_async_save`` end to end;
* ``torch_save`` / ``torch_load``: ``torch.save`` (+ fsync) / ``torch.load`` (cold) + copy
  into the live tensors, one file per rank;
* the disk's bounds in the same run: ``fs_write`` (every rank ``write(2)``s its tensors' bytes
  to its own file + fsync, at once), ``fs_write_direct`` (the same bytes from page-aligned
  memory with ``O_DIRECT`` in 4 MiB pieces, as the flush writes them; the flush's goal is
  held to the faster of the two) and ``fs_read`` (``readinto(2)`` of that file, cold);
* the node-local bounds: ``local_read`` (every rank ``preadv`` reads the same bytes from a file
  in the node-local directory, tmpfs, straight into its live tensors in 256 KiB pieces, as a
  node-local restore reads its shard) and ``local_read_verified`` (the same, each piece
  hashed with xxh3-64 while in cache: what any restore that checks its bytes must do), in
  rounds alternating with ``ftkit_local_load``; ``pfs[node-local vs cold pfs ceiling]`` is
  the cold PFS restore over that bound: the most the node-local ratio can be on this machine.

**Cold reads**: before every read figure, the pages of the files about to be read are
dropped (fsync, then ``posix_fadvise(POSIX_FADV_DONTNEED)``: no privilege needed) by one rank
per host, so every load reads the disk (a file system that keeps its pages anyway, e.g. tmpfs,
says so in ``cold_reads``). ``leader_flush_private_mib``: the most private memory any rank
held above its level before, during its saves to the PFS (capture, early write, flush: a
node leader used to receive its ranks' shards; now every rank writes its own).
Throughput is bytes of state summed over all ranks / seconds. Prints ``name: value (ratio to
X = r)`` lines, writes <name>.json (default hdf5_vs_dcp.json).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import _disk
import _mpi
import _stall
from _common import init_torch_distributed

GOAL = 1.5
#: untimed rounds of every save method before the timed ones (first writes of a file
#: system's metadata, DCP's planner; ftkit's two node-local slots, which a long run fills
#: once: the first fill of a slot pays for the first touch of its memory, 1-6 s per GiB on
#: this virtual machine, against 0.2 s for every later fill)
WARMUP = 2
N_TENSORS = 8
#: (ftkit method, peer it is held to the goal against)
GOALS = {"ftkit_hdf5_save": "torch_dcp_save", "ftkit_hdf5_load": "torch_dcp_load"}
#: the PFS level's goals: name -> (numerator, denominator of a ratio of seconds, goal, op);
#: seconds of the peer over seconds of ftkit ("how many times faster"), except the stall
#: (ftkit's over the peer's: "what fraction of the peer's stall")
PFS_GOALS = {
    "durable vs dcp save": ("torch_dcp_save", "ftkit_save_total", 1.0, ">="),
    "flush vs disk write+fsync": ("fs_write_bound", "ftkit_hdf5_save", 0.9, ">="),
    "cold restore vs dcp load": ("torch_dcp_load", "ftkit_hdf5_load", 1.2, ">="),
    "stall vs dcp async_save stall": ("ftkit_pfs_stall", "torch_dcp_async_save_blocking",
                                      0.1, "<="),
    "node-local restore vs cold pfs restore": ("ftkit_hdf5_load", "ftkit_local_load", 5.0,
                                               ">="),
}
#: figures without a goal that say where the node-local one stands: ftkit's node-local
#: restore against its bound (``preadv`` + xxh3 of the same bytes from tmpfs into the live
#: tensors: what any restore that verifies its bytes does), and the most the node-local vs
#: cold PFS ratio can be on this machine (the cold PFS restore over that bound)
PFS_BOUNDS = {
    "node-local restore vs its bound": ("local_read_verified", "ftkit_local_load"),
    "node-local vs cold pfs ceiling": ("ftkit_hdf5_load", "local_read_verified"),
}
#: the most private memory a rank may hold in a flush beyond its state: one chunk (MiB)
FLUSH_MEMORY_GOAL_MIB = 16



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


def _rm(comm: Any, *paths: Path) -> None:
    comm.Barrier()
    if comm.rank == 0:
        for p in paths:
            shutil.rmtree(p, ignore_errors=True)
    comm.Barrier()


@dataclasses.dataclass
class _Run:
    """One rank's side of the benchmark: the state, its directories and every round's
    seconds (the same on every rank: barrier to barrier, or a max over ranks)."""

    comm: Any
    host: Any
    state: dict[str, Any]
    ref: dict[str, Any]
    pfs_root: Path
    local_root: Path
    cfg: Any
    topo: Any
    stall_bytes: int = 0          # asked for the training state of the stall rounds
    stall_trained: int = 0        # what it holds (parameters + Adam moments)
    rounds: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    flush_private: float = 0.0

    def add(self, name: str, seconds: float) -> None:
        self.rounds.setdefault(name, []).append(seconds)

    def forget(self, *names: str) -> None:
        for name in names:
            self.rounds.pop(name, None)

    def medians(self) -> dict[str, float]:
        return {k: statistics.median(v) for k, v in self.rounds.items()}

    def cold(self, *paths: Path) -> Callable[[], None]:
        """A ``before`` for :func:`_timed`: scramble the state, drop the pages of ``paths``."""
        def before() -> None:
            _scramble(self.state)
            _disk.drop_pages(self.host, *paths)
        return before


def _ftkit_saves(run: _Run, repeat: int) -> Iterator[None]:
    """Sync saves to the PFS (flush timed inside); the leader's private memory meanwhile.
    One round per ``next()`` (the caller alternates the methods' rounds)."""
    from memory import PrivatePeak, private_bytes
    from mpi4py import MPI

    from ftkit import Checkpointer
    ckpt = Checkpointer(run.topo, run.cfg)
    flush_s: list[float] = []
    flush = ckpt.pfs.flush

    def timed_flush(step: int, **kw: Any) -> float:
        early = kw.get("early_write")       # the PFS write began with it, in the capture
        t0 = early.started if early is not None else time.monotonic()
        try:
            return flush(step, **kw)
        finally:
            flush_s.append(time.monotonic() - t0)
    ckpt.pfs.flush = timed_flush  # type: ignore[method-assign]

    def save(step: int) -> None:               # private memory over the whole save
        base = private_bytes()
        with PrivatePeak() as peak:
            ckpt.save(step, run.state)
        run.flush_private = max(run.flush_private, (peak.peak - base) / 2**20)
    try:
        for step in range(1, repeat + 1):
            old = [run.cfg.job_pfs_dir / f"step-{step - 1}"]
            run.add("ftkit_save_total", _timed(run.comm, lambda s=step: save(s),
                                                lambda o=old: _rm(run.comm, *o)))
            run.add("ftkit_hdf5_save", run.comm.allreduce(flush_s[-1], op=MPI.MAX))
            yield
    finally:
        ckpt.close()


def _dcp_saves(run: _Run, repeat: int, threads: int, last: dict[str, Path]
               ) -> Iterator[None]:
    """DCP (1 and ``threads`` writer threads, async), torch.save, one round of each per
    ``next()``; ``last``: the directories last written by each."""
    import torch
    import torch.distributed.checkpoint as dcp

    def fresh(name: str, i: int) -> Path:
        old = last.get(name)
        if old is not None:
            _rm(run.comm, old)
        last[name] = run.pfs_root / f"{name}-{i}"
        return last[name]
    for i in range(repeat):
        for name, n in (("torch_dcp_save", 1), ("torch_dcp_save_threads", threads)):
            d = fresh(name, i)
            run.add(name, _timed(run.comm, lambda d=d, n=n: dcp.save(
                _plain(run.state), storage_writer=dcp.FileSystemWriter(d, thread_count=n))))
        if "torch_dcp_async_save" not in run.skipped:
            d = fresh("torch_dcp_async_save", i)

            def async_save(d: Path = d) -> None:
                res = dcp.async_save(_plain(run.state), storage_writer=dcp.FileSystemWriter(d))
                (res if hasattr(res, "result") else res.upload_completion).result()
            try:
                run.add("torch_dcp_async_save", _timed(run.comm, async_save))
            except Exception as exc:  # noqa: BLE001 - a peer that does not work here
                run.skipped["torch_dcp_async_save"] = f"{type(exc).__name__}: {exc}"
                run.forget("torch_dcp_async_save")
        d = fresh("torch_save", i)

        def tsave(d: Path = d) -> None:
            d.mkdir(parents=True, exist_ok=True)
            with open(d / f"rank-{run.comm.rank}.pt", "wb") as fh:
                torch.save(_plain(run.state), fh)
                fh.flush()
                os.fsync(fh.fileno())
        run.add("torch_save", _timed(run.comm, tsave))
        yield


def _rotated(items: list[Any], i: int) -> list[Any]:
    """``items`` starting at its ``i``-th (round ``i`` of a rotation): no method is always
    first after another one, nor always right after the same one (this disk's speed drifts
    within a round: the first read after a pause is often the slowest)."""
    k = i % len(items)
    return items[k:] + items[:k]


def _loads(run: _Run, repeat: int, saved: int, dirs: dict[str, Path], bound: Path) -> None:
    """Every load cold (pages dropped first), each checked bit-exact (ftkit's restore finds
    step ``saved``); the node-local restore (warm: it is memory) first, while the node-local
    directory exists. ``repeat`` rounds of each group, the order rotated every round."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ftkit import Checkpointer

    def restore(what: str) -> None:
        got: list[int] = []
        fresh = Checkpointer(run.topo, run.cfg)
        try:
            run.add(what, _timed(run.comm, lambda: got.append(fresh.restore(run.state)),
                                  run.cold(run.cfg.job_pfs_dir)))
        finally:
            fresh.close()
        if got != [saved]:
            raise AssertionError(f"{what}: restore returned step {got}, expected {saved}")
        _check(run.state, run.ref, what)
    views = _raw_views(run.state)                 # live storage: scrambling keeps it
    local_bound = run.local_root / "bound" / f"rank-{run.comm.rank}.bin"
    local_bound.parent.mkdir(exist_ok=True)
    _disk.fs_write(local_bound, views)

    def local(name: str, verify: bool) -> Callable[[], None]:
        def go() -> None:
            run.add(name, _timed(run.comm, lambda: _disk.local_read(
                local_bound, views, verify=verify), lambda: _scramble(run.state)))
            _check(run.state, run.ref, name)
        return go
    local_loads = [lambda: restore("ftkit_local_load"), local("local_read", False),
                   local("local_read_verified", True)]
    for i in range(repeat):
        for load in _rotated(local_loads, i):
            load()
    local_bound.unlink()

    def pfs_restore() -> None:
        _rm(run.comm, run.cfg.job_local_dir)      # node-local copies gone: restore from PFS
        restore("ftkit_hdf5_load")

    def dcp_load() -> None:
        run.add("torch_dcp_load", _timed(run.comm, lambda: dcp.load(
            _plain(run.state), storage_reader=dcp.FileSystemReader(dirs["torch_dcp_save"])),
            run.cold(dirs["torch_dcp_save"])))
        _check(run.state, run.ref, "dcp.load")

    def tload() -> None:
        loaded = torch.load(dirs["torch_save"] / f"rank-{run.comm.rank}.pt",
                            weights_only=True)
        (key, inner), = run.state.items()
        with torch.no_grad():
            for k, v in loaded[key]["tensors"].items():
                inner["tensors"][k].copy_(v)
        inner["model"].load_state_dict(loaded[key]["model"])

    def torch_load() -> None:
        run.add("torch_load", _timed(run.comm, tload, run.cold(dirs["torch_save"])))
        _check(run.state, run.ref, "torch.load")

    def fs_read() -> None:
        run.add("fs_read", _timed(run.comm, lambda: _disk.fs_read(bound, views),
                                  run.cold(bound.parent)))
        _check(run.state, run.ref, "fs read")
    cold_loads = [pfs_restore, dcp_load, torch_load, fs_read]
    for i in range(repeat):
        for load in _rotated(cold_loads, i):
            load()


def _child(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from mpi4py import MPI

    from ftkit.comm.topology import Topology
    from ftkit.config import Config

    comm = MPI.COMM_WORLD
    rank = comm.rank
    pfs_root = Path(comm.bcast(tempfile.mkdtemp(prefix="ftkit-bench-pfs-", dir=args.pfs_root)
                               if rank == 0 else None))
    local_root = Path(comm.bcast(tempfile.mkdtemp(prefix="ftkit-bench-", dir="/dev/shm")
                                 if rank == 0 else None))
    host = comm.Split_type(MPI.COMM_TYPE_SHARED)
    ok = False
    try:
        size = args.size_mib << 20 if not args.quick else 256 << 10
        state, _model = make_state(rank, size)
        run = _Run(comm, host, state, {k: v.clone() for k, v in _flat(state).items()},
                   pfs_root, local_root, Config.load(env={}, levels="local:1,pfs:1", async_=False,
                                         local_dir=str(local_root), pfs_dir=str(pfs_root),
                                         job="bench", timeout=600.0),
                   Topology.create(comm, ranks_per_node=args.ranks_per_node),
                   stall_bytes=size)
        nbytes = comm.allreduce(_state_bytes(state))
        init_torch_distributed(comm, timeout_s=600)
        # one directory of every rank's bound file: the host's first rank drops the pages of
        # all of them before fs_read (dropping only its own left the others' files cached:
        # that "cold" bound read 3 of 4 files from memory, ~5 GB/s)
        bounds = pfs_root / "bound"
        if rank == 0:
            bounds.mkdir()
        comm.Barrier()
        bound = bounds / f"rank-{rank}.bin"
        views = _raw_views(state)
        dirs: dict[str, Path] = {}
        saved = args.repeat + WARMUP
        saves = (_ftkit_saves(run, saved), _dcp_saves(run, saved, args.dcp_threads, dirs))
        direct = _disk.aligned_copy(views)
        for i in range(saved):            # rounds alternate: each method sees the same disk
            run.add("fs_write", _timed(comm, lambda: _disk.fs_write(bound, views)))
            run.add("fs_write_direct",
                    _timed(comm, lambda d=direct: _disk.fs_write_direct(bound, d)))
            for rounds in saves:
                next(rounds)
            if i < WARMUP:
                run.forget(*list(run.rounds))
        del direct
        for rounds in saves:
            next(rounds, None)            # closes the Checkpointer
        _stall.measure(run, args.repeat, _timed, _rm)
        _loads(run, args.load_repeat or args.repeat, saved, dirs, bound)
        flush_mib = comm.gather(run.flush_private, root=0)
        dist.destroy_process_group()
        if rank == 0:
            assert flush_mib is not None
            _report(args, comm.size, len(run.topo.nodes), nbytes, run, max(flush_mib),
                    pfs_root)
        ok = True
    finally:
        host.Free()
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
    fs = _fs_type(pfs_root)
    return {**_mpi.machine(), "ranks": world, "oversubscribed": world > cores,
            "ftkit_nodes": nodes, "hdf5": h5py.version.hdf5_version, "ftkit": __version__,
            "pfs_dir_fs": fs, "local_dir_fs": _fs_type(Path("/dev/shm")),
            "cold_reads": ("pages dropped before every read figure (fsync + "
                           "posix_fadvise(POSIX_FADV_DONTNEED), one rank per host)"
                           + ("; NOT cold: tmpfs keeps its pages" if fs.startswith("tmpfs")
                              else ""))}


def pfs_goals(t: dict[str, float], flush_mib: float) -> dict[str, dict[str, Any]]:
    """The PFS level's goal figures from the seconds ``t`` (those measured). The flush is
    held to the faster of the disk's two write bounds (buffered, O_DIRECT)."""
    bounds = [t[k] for k in ("fs_write", "fs_write_direct") if k in t]
    t = {**t, "fs_write_bound": min(bounds)} if bounds else t
    out: dict[str, dict[str, Any]] = {}
    for name, (num, den, goal, op) in PFS_GOALS.items():
        if num in t and den in t:
            ratio = t[num] / t[den]
            out[name] = {"ratio": ratio, "goal": goal, "op": op, "of": [num, den],
                         "met": ratio >= goal if op == ">=" else ratio <= goal}
    for name, (num, den) in PFS_BOUNDS.items():
        if num in t and den in t:
            out[name] = {"ratio": t[num] / t[den], "goal": None, "op": ">=",
                         "of": [num, den], "met": None}
    out["leader memory in a flush (MiB)"] = {
        "ratio": flush_mib, "goal": FLUSH_MEMORY_GOAL_MIB, "op": "<=", "of": [],
        "met": flush_mib <= FLUSH_MEMORY_GOAL_MIB}
    return out


#: figures that are not a pass over the saved bytes (no throughput)
NOT_THROUGHPUT = ("_blocking", "_stall", "iteration_")


def _report(args: argparse.Namespace, world: int, nodes: int, nbytes: int, run: _Run,
            flush_mib: float, pfs_root: Path) -> None:
    t, skipped = run.medians(), run.skipped
    gbs = {k: nbytes / v / 1e9 for k, v in t.items()
           if not k.endswith(NOT_THROUGHPUT[:2]) and not k.startswith(NOT_THROUGHPUT[2])}
    # throughput ratio a/b = seconds of b / seconds of a; the goal pairs come first
    pairs = [*GOALS.items(), ("ftkit_save_total", "torch_dcp_save"),
             ("ftkit_save_total", "torch_dcp_save_threads"),
             ("ftkit_hdf5_save", "torch_dcp_async_save"), ("ftkit_hdf5_save", "torch_save"),
             ("ftkit_hdf5_load", "torch_load"), ("ftkit_hdf5_save", "fs_write"),
             ("ftkit_hdf5_load", "fs_read"), ("torch_dcp_save", "fs_write"),
             ("torch_dcp_load", "fs_read")]
    ratios = {f"{a}/{b}": t[b] / t[a] for a, b in pairs if a in t and b in t}
    goals = pfs_goals(t, flush_mib)

    def line(name: str, *peers: str, goal: bool = False) -> str:
        s = f"{name}: {gbs[name]:.3f} GB/s ({t[name]:.3f} s)"
        for i, peer in enumerate(peers):
            if f"{name}/{peer}" in ratios:
                s += f" (ratio to {peer} = {ratios[f'{name}/{peer}']:.2f}"
                s += f"; goal >= {GOAL})" if goal and i == 0 else ")"
        return s
    lines = [(f"state: {nbytes / 2**20:.1f} MiB over {world} ranks ({nodes} ftkit node(s)), "
              f"median of {args.repeat} alternating rounds ({args.load_repeat or args.repeat} "
              f"of the restores, in rotated order); every read cold"),
             line("ftkit_save_total", "torch_dcp_save", "torch_dcp_save_threads")
             + " (until durable on the PFS: capture + node-local + commit + flush)",
             line("ftkit_hdf5_save", "torch_dcp_save", "torch_dcp_async_save", "torch_save",
                  "fs_write", goal=True) + " (the flush)",
             line("ftkit_hdf5_load", "torch_dcp_load", "torch_load", "fs_read", goal=True),
             line("ftkit_local_load") + " (node-local restore)",
             line("local_read") + " (bound: preadv from tmpfs into the tensors)",
             line("local_read_verified") + " (bound: the same + xxh3 of every piece)",
             _stall_line(t, skipped, run.stall_trained),
             line("torch_dcp_save", "fs_write"), line("torch_dcp_save_threads"),
             line("torch_dcp_load", "fs_read")]
    if "torch_dcp_async_save" in t:
        lines.append(line("torch_dcp_async_save"))
    else:
        lines.append(f"torch_dcp_async_save: skipped ({skipped.get('torch_dcp_async_save')})")
    lines += [line("torch_save") + " (+ fsync)", line("torch_load") + " (+ copy into state)",
              line("fs_write") + " (bound: write(2) + fsync, one file per rank, at once)",
              line("fs_write_direct") + " (bound: the same with O_DIRECT, 4 MiB pieces)",
              line("fs_read") + " (bound: readinto(2), cold)",
              f"leader_flush_private: {flush_mib:.1f} MiB (max over ranks)"]
    lines += [f"pfs[{k}]: {g['ratio']:.3f}" + ("" if g["goal"] is None else
              f" (goal {g['op']} {g['goal']}: {'met' if g['met'] else 'missed'})")
              for k, g in goals.items()]
    print("\n".join(lines), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "command": "python bench/hdf5_vs_dcp.py " + " ".join(a for a in sys.argv[1:]
                                                             if a != "--child"),
        "machine": _machine(world, nodes, pfs_root),
        "state_bytes_all_ranks": nbytes, "repeat": args.repeat,
        "load_repeat": args.load_repeat or args.repeat, "quick": args.quick,
        "statistic": "median of the alternating rounds", "seconds": t,
        "spread": {k: [min(v), max(v)] for k, v in run.rounds.items()},
        "rounds": run.rounds, "stall_state_bytes_per_rank": run.stall_trained,
        "gb_per_s": gbs, "ratios": ratios,
        "goal": {"ratio": GOAL, "pairs": GOALS,
                 "met": {k: ratios[f"{k}/{v}"] >= GOAL for k, v in GOALS.items()}},
        "pfs_goals": goals, "skipped": skipped, "leader_flush_private_mib": flush_mib,
        "notes": [("ftkit_hdf5_save times the PFS write (max over ranks) inside "
                   "Checkpointer.save(levels=local:1,pfs:1, async_=False): from the start of "
                   "the rank's early write (in the capture) to the end of PfsLevel.flush; "
                   "leader memory: private memory over the whole save"),
                  (f"DCP: FileSystemWriter/Reader (single_file_per_rank, sync_files), "
                   f"thread_count 1 and {args.dcp_threads}, gloo process group"),
                  "torch_save fsyncs its file; torch_load copies into the live tensors",
                  ("stall: a training iteration (MLP + Adam) that starts with a checkpoint; "
                   "ftkit: Checkpointer.blocked_seconds (save + the next optimizer.step's "
                   "wait for the background copy); DCP: async_save until it returns"),
                  "every timed section starts after sync(2) and a barrier; reads are cold"],
    }
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=1))


def _stall_line(t: dict[str, float], skipped: dict[str, str], nbytes: int) -> str:
    """The stall figures of a training iteration (see ``_stall``)."""
    plain = t["iteration_plain"]
    s = (f"ftkit_pfs_stall: {t['ftkit_pfs_stall']:.4f} s (training: {nbytes / 2**20:.0f} "
         f"MiB of MLP + Adam per rank; iteration {plain:.3f} s plain, "
         f"{t['iteration_ftkit_pfs_save']:.3f} s starting with a PFS save)")
    if "torch_dcp_async_save_blocking" in t:
        return s + (f"\ntorch_dcp_async_save_blocking: {t['torch_dcp_async_save_blocking']:.4f}"
                    f" s (iteration {t['iteration_dcp_async_save']:.3f} s starting with it)")
    why = skipped.get("torch_dcp_async_save_blocking")
    return s + f"\ntorch_dcp_async_save_blocking: skipped ({why})"


def main() -> None:
    ap = _mpi.parser(__doc__)
    ap.add_argument("--ranks-per-node", type=int, default=0,
                    help="ftkit virtual nodes of this many ranks (0: real nodes)")
    ap.add_argument("--pfs-root", default="/tmp",
                    help="directory on the file system all methods write to")
    ap.add_argument("--dcp-threads", type=int, default=4,
                    help="writer threads of the second DCP save")
    ap.add_argument("--name", default="hdf5_vs_dcp", help="report name: <out>/<name>.json")
    ap.add_argument("--load-repeat", type=int, default=0,
                    help="rounds of the restores (0: --repeat); a cold read is cheaper "
                         "than a save and this disk's reads differ the most")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: 256 KiB per rank, one repeat")
    args = ap.parse_args()
    if args.quick:
        args.repeat, args.load_repeat = 1, 1
    _mpi.run(__file__, args, _child)


if __name__ == "__main__":
    main()

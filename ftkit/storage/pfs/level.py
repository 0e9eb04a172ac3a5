"""Parallel-file-system level: committed steps flushed to self-describing HDF5.

Flush of step ``s`` (phase ``flush``; runs on its own thread and communicators right after
``s`` was committed; a new flush waits for the previous one — back-pressure of one):

0. rank 0 creates ``step-<s>`` durably (fsync of the parent) and, when ``step-<s>`` already
   holds a ``COMMITTED`` record (the step number is saved again after a restore fell back to
   an older step), removes that record durably (unlink, fsync) *before* any node file is
   rewritten; all ranks agree on it;
1. every rank writes ``step-<s>/rank-<r>.h5`` straight from its node-local permanent shard,
   all ranks in parallel (temp name, fsync, rename), verifying every tensor's bytes against
   the shard's checksum as it copies them (a corrupt shard fails the flush: corruption is
   never copied to the PFS); each node leader also writes ``step-<s>/node-<id>.h5``, which
   holds only external links ``/rank/<r>`` to its ranks' files. No data crosses the
   network: no rank holds more than its own mapped shard. (With ``FTKIT_PFS_FILES=shared``
   all ranks write one ``step-<s>/ranks.h5`` instead: rank 0 creates every rank's datasets,
   each rank writes its own tensors into it, :mod:`ftkit.storage.pfs.h5shared`; rank 0
   renames it into place in 3.);
2. all ranks agree that every file is durable (waiting for the slowest node's bytes,
   :func:`io_allowance`) and send rank 0 the byte digests of the files they wrote
   (:mod:`ftkit.storage.pfs.h5files`);
3. rank 0 writes the index ``ftkit.h5`` (fsync, rename) and then ``COMMITTED`` (with the run
   id, the node of every rank and the digest of every file, under its own checksum); all
   ranks agree that it did;
4. retention: rank 0 retracts the committed steps older than the ``FTKIT_PFS_KEEP`` newest
   — only now, after a newer step is committed — and its reaper thread deletes their files
   behind the training (:mod:`ftkit.storage.pfs.retention`).

A rank whose early write of the step ran (:mod:`ftkit.storage.pfs.early`: its file written
from the tentative snapshot while it was captured) renames that file into place in 1 instead
of writing it.

A crash anywhere before 3 leaves a step without ``COMMITTED``, which restore ignores and
``inspect`` shows as incomplete — never a mix of two timelines under one record. An agreed
failure (a full or failing PFS) makes rank 0 remove the incomplete step directory; the next
flush removes what a crash left.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ftkit._version import __version__
from ftkit.comm.dist import DistComm
from ftkit.comm.topology import Topology, coords_of
from ftkit.config import Config
from ftkit.errors import CheckpointError, ProtocolTimeout
from ftkit.faults import Faults
from ftkit.fs import fsync_dir
from ftkit.storage.local import LocalLevel
from ftkit.storage.pfs import early, h5shared, hdf5
from ftkit.storage.pfs.early import EarlyWrite
from ftkit.storage.pfs.retention import Reaper, retract_steps
from ftkit.storage.shard import Shard
from ftkit.storage.slots import NotLanding, Reservation
from ftkit.storage.stepnames import step_dirs, step_name

log = logging.getLogger(__name__)
T = TypeVar("T")


class PfsLevel:
    """One rank's part of the PFS level."""

    name = "pfs"

    def __init__(self, config: Config, topo: Topology, local: LocalLevel, dc: DistComm,
                 faults: Faults, *, run_id: str = "") -> None:
        self.config, self.topo, self.local, self.faults = config, topo, local, faults
        self.run_id = run_id              # written as ``run`` in the index and COMMITTED
        self.dc = dc                      # world (a DistComm of the PFS level's own)
        self.pruned: list[int] = []       # rank 0: steps the last flush's retention removed
        self.adopted: list[int] = []      # steps whose file of this rank was its early write
        self._reaper = Reaper()           # rank 0: deletes retired steps' files
        self.shared = config.pfs_files == "shared"     # one file of all ranks (h5shared)
        hdf5._h5py()      # import h5py now, not on the restore path of a relaunched job

    def settle(self) -> None:
        """Wait until the files of every step retention retired are deleted (local)."""
        self._reaper.wait()

    def free(self) -> None:
        """Finish deleting retired steps, release the level's communicator (local)."""
        self._reaper.close()
        self.dc.free()

    def step_dir(self, step: int) -> Path:
        return self.config.job_pfs_dir / step_name(step)

    def committed_steps(self) -> list[int]:
        """PFS steps with a COMMITTED record, newest first (local listing)."""
        steps = [s for s, p in step_dirs(self.config.job_pfs_dir)
                 if (p / "COMMITTED").is_file()]
        return sorted(steps, reverse=True)

    def write_early(self, step: int, res: Reservation, pool: cf.ThreadPoolExecutor,
                    patience: float) -> EarlyWrite | None:
        """Start this rank's early write of ``step`` from the reservation its capture fills
        (:mod:`ftkit.storage.pfs.early`); None (logged) when the staging directory cannot be
        had: the flush then writes the file itself. Per-rank files only. Local."""
        if self.shared:
            return None
        try:
            staging = early.staging_dir(self.config.job_pfs_dir)
        except OSError as exc:
            log.debug("rank %d: no early PFS write of step %d: %s", self.topo.rank, step, exc)
            return None
        return EarlyWrite(step, res, staging, self.topo.rank, self._coords(self.topo.rank),
                          pool, self.faults, patience)

    def flush(self, step: int, early_write: EarlyWrite | None = None) -> float:
        """Write committed ``step`` to HDF5 (see module doc). All ranks call; returns
        seconds; raises the same CheckpointError everywhere on failure, after rank 0 removed
        the incomplete step directory (a full PFS gets its space back, no temp file stays).
        ``early_write``: this rank's early write of ``step``, adopted as its file (or, when
        the flush fails before, discarded)."""
        t0 = time.monotonic()

        def prepare() -> int:        # everything that can fail locally, before any exchange
            self.faults.fire("flush", step)
            if self.topo.rank == 0:
                self._prepare(step)
            path = self.local.shard_path(step)
            why = self.local.file_problem(path)
            if why is not None:
                raise FileNotFoundError(f"{path}: {why}")
            return path.stat().st_size
        try:
            size = self._agreed(prepare, step) or 0
            written = self._agreed(lambda: self._write_files(step, early_write), step,
                                   allow_bytes=io_allowance(self.dc, self.topo, size, "flush",
                                                            step))
        finally:
            if early_write is not None:
                early_write.discard()          # not adopted: the flush failed before
        digests = self.dc.gather(written, "flush", step)
        self._agreed(lambda: self._commit(step, digests) if digests is not None else None, step)
        seconds = time.monotonic() - t0
        if self.topo.rank == 0:
            self.pruned = retract_steps(self.config.job_pfs_dir, step, self.config.pfs_keep)
            self._reaper.remove(self.config.job_pfs_dir, self.pruned)
        return seconds

    def _agreed(self, fn: Callable[[], T], step: int, *,
                allow_bytes: int | None = None) -> T | None:
        """Run ``fn`` on this rank; all ranks agree on the outcome and raise the same
        CheckpointError when any failed (rank 0 discards the step's files first).
        ``allow_bytes``: the agreement waits for that much bulk I/O (``DistComm.agree``)."""
        failure, result = None, None
        try:
            result = fn()
        except ProtocolTimeout:      # a peer is lost or hung: the world aborts, no agreement
            raise
        except Exception as exc:  # noqa: BLE001 - agreed below
            failure = f"{type(exc).__name__}: {exc}"
            log.debug("rank %d: flush of step %d failed: %s", self.topo.rank, step, failure)
        failures = self.dc.agree(failure, "flush", step, allow_bytes=allow_bytes)
        if failures:
            if self.topo.rank == 0:
                self._discard(step)
            raise CheckpointError(step, failures, message=f"flush of step {step} to "
                                  f"{self.step_dir(step)} (level pfs) failed; the step "
                                  f"stays incomplete and its files were removed")
        return result

    def _discard(self, step: int) -> None:
        """Rank 0, after an agreed flush failure: remove the incomplete step directory (never
        one holding a COMMITTED record)."""
        d = self.step_dir(step)
        if (d / hdf5.COMMITTED).exists() or not d.is_dir():
            return
        shutil.rmtree(d, ignore_errors=True)
        try:
            fsync_dir(d.parent)
        except OSError as exc:
            log.warning("removing incomplete PFS step %s: %s", d, exc)

    def _prepare(self, step: int) -> None:
        """Rank 0: create the step directory durably; retract an old COMMITTED record of the
        same step number before anything of the step is rewritten; remove what crashed
        flushes left (incomplete step directories, temp files), once the previous flush's
        retired steps are gone."""
        self._reaper.wait()
        hdf5.make_step_dir(self.step_dir(step))
        if hdf5.retract_commit(self.step_dir(step)):
            log.warning("PFS step %d is written again (an older timeline's step %d was "
                        "committed there); its COMMITTED record was removed first",
                        step, step)
        for other, d in step_dirs(self.config.job_pfs_dir):
            if other != step and not (d / hdf5.COMMITTED).exists():
                log.warning("removing incomplete PFS step directory %s (left by a flush "
                            "that did not finish)", d)
                shutil.rmtree(d, ignore_errors=True)
        for tmp in self.step_dir(step).glob(".*.tmp"):
            tmp.unlink(missing_ok=True)

    def _write_files(self, step: int, early_write: EarlyWrite | None = None
                     ) -> list[dict[str, Any]]:
        """Write this rank's file ``rank-<r>.h5`` straight from its node-local shard (all
        ranks at once, no data crosses the network), or adopt ``early_write``'s; the node
        leader also writes the node's link file ``node-<id>.h5``. Returns
        ``[{"file", "digest"}]`` of what this rank wrote. With shared files, this rank's part
        of the shared file instead (all ranks call)."""
        if self.shared:
            return self._write_shared(step)
        t = self.topo
        written = []
        if t.node_rank == 0:
            node_file = self.step_dir(step) / f"node-{t.node}.h5"
            written.append({"file": node_file.name,
                            "digest": hdf5.write_node_links(node_file, t.ranks_on(t.node))})
        rank_file = self.step_dir(step) / f"rank-{t.rank}.h5"
        digest = self._adopt(early_write, rank_file, step)
        if digest is None:
            shard = Shard.open(self.local.shard_path(step), rank=t.rank, step=step)
            try:
                digest = hdf5.write_rank_file(rank_file, shard, self._coords(t.rank))
            finally:
                shard.close()
        self.faults.after_write(rank_file, level=self.name, step=step)
        written.append({"file": rank_file.name, "digest": digest})
        return written

    def _adopt(self, early_write: EarlyWrite | None, rank_file: Path, step: int
               ) -> dict[str, Any] | None:
        """``early_write``'s file renamed to ``rank_file``: its digest; None when there is
        none, or when it stopped because its slot was not completed (the shard was written
        another way): the caller writes the file from the shard."""
        if early_write is None:
            return None
        try:
            digest = early_write.adopt(rank_file)
        except NotLanding as exc:
            log.info("rank %d: early PFS write of step %d not used (%s); writing from the "
                     "shard", self.topo.rank, step, exc)
            return None
        self.adopted.append(step)
        return digest

    def _write_shared(self, step: int) -> list[dict[str, Any]]:
        """This rank's part of the step's shared file (:func:`h5shared.write_shared_file`;
        all ranks call, a shard that cannot be opened fails every rank alike). Returns, on
        rank 0, the file's entry (with its temp name, renamed by :meth:`_commit`)."""
        t, shard, failure = self.topo, None, None
        try:
            shard = Shard.open(self.local.shard_path(step), rank=t.rank, step=step)
        except Exception as exc:  # noqa: BLE001 - every rank learns it before a byte is written
            failure = f"{type(exc).__name__}: {exc}"
        try:
            part = h5shared.write_shared_file(self.step_dir(step), self.dc, shard,
                                              self._coords(t.rank), step, failure=failure)
        finally:
            if shard is not None:
                shard.close()
        own = [o for o in part.offsets if o is not None]
        if own:                  # a corrupt fault flips a byte of this rank's own data
            self.faults.after_write(part.temp, level=self.name, step=step, offset=own[-1])
        return [{"file": h5shared.SHARED_FILE, "digest": part.digest,
                 "temp": part.temp.name}] if t.rank == 0 else []

    def _coords(self, rank: int) -> dict[str, Any]:
        c = coords_of(rank, self.topo.dp, self.topo.tp, self.topo.pp)
        return {"dp_idx": c.dp, "tp_idx": c.tp, "pp_idx": c.pp, "node": self.topo.rank_node[rank]}

    def _commit(self, step: int, parts: list[Any]) -> None:
        """Rank 0: write the index, then COMMITTED with the byte digest of every file of the
        step (``parts``: what each rank returned from :meth:`_write_files`)."""
        t = self.topo
        meta = {"job": self.config.job, "step": step, "world": t.world, "dp": t.dp,
                "tp": t.tp, "pp": t.pp, "nodes": len(t.nodes), "ftkit": _version(),
                "run": self.run_id}
        files = {f["file"]: f["digest"] for written in parts for f in written or ()}
        for f in (f for written in parts for f in written or () if "temp" in f):
            h5shared.publish(self.step_dir(step), f["temp"])      # the shared file
        links = {r: h5shared.SHARED_FILE if self.shared else f"node-{t.rank_node[r]}.h5"
                 for r in range(t.world)}
        files[hdf5.INDEX] = hdf5.write_index(self.step_dir(step), meta, links)
        hdf5.write_commit(self.step_dir(step), {"step": step, "world": t.world,
                                                "time": time.time(), "run": self.run_id,
                                                "job": self.config.job,
                                                "nodes": [int(n) for n in t.rank_node],
                                                "files": files})


def io_allowance(dc: DistComm, topo: Topology, nbytes: int, phase: str, step: int | None
                 ) -> int:
    """Bytes the slowest node may still be moving to or from the PFS when a rank that is
    done waits for an agreement: the largest ``nbytes`` of any rank times the most ranks on
    one node (they share the node's link to the PFS). An agreement given it
    (``DistComm.agree(allow_bytes=...)``) waits that much longer, so a large state on a slow
    file system is not taken for a hung rank. All ranks of ``dc`` call."""
    biggest = dc.allreduce_max([nbytes], phase, step)[0]
    return biggest * max(len(topo.ranks_on(node)) for node in topo.nodes)


def _version() -> str:
    return __version__

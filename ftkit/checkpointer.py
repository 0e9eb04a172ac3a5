"""The public entry point: :class:`Checkpointer` (README.md, "Using it"; docs/guide.md).

``save`` captures the state (phase ``capture``) and, with ``FTKIT_ASYNC=1``, returns at
once: parameters and optimizer state are staged to host memory by a worker thread (GPU: a
side CUDA stream into pinned buffers) while the next forward/backward runs, and the rest
of the protocol runs on one background thread over a duplicated communicator. Training
blocks only when

* ``optimizer.step()`` is about to change parameters whose staging is unfinished (a step
  pre-hook on every optimizer in the state calls :meth:`Checkpointer.wait_staged`), or
* the next ``save`` needs the staging buffers while the previous snapshot has not been
  written to the node-local level yet (buffers are allocated once and reused).

Protocols run one after another on the background thread, so versions never interleave.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import os
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

from mpi4py import MPI

from ftkit._version import __version__
from ftkit.capture import attached, shards
from ftkit.capture.flatten import flatten
from ftkit.capture.guard import OptimizerGuard, deferrable, optimizers_in
from ftkit.capture.staging import Stager, Staging
from ftkit.comm import flag as injob
from ftkit.comm.dist import DistComm, describe
from ftkit.comm.topology import Topology
from ftkit.config import Config
from ftkit.errors import (
    CheckpointError,
    ProtocolTimeout,
)
from ftkit.faults import Faults
from ftkit.flushes import Flushes
from ftkit.fs import write_record
from ftkit.jobdir.events import append_event, mark_progress
from ftkit.jobdir.fatal import record_death, record_fatal, recorded
from ftkit.launch.jobs import tidy_requested
from ftkit.launch.marker import write_done
from ftkit.log import setup_rank_logging
from ftkit.progress import bulk_seconds
from ftkit.protocol.twophase import (
    CLOSING,
    ProtocolMismatch,
    Snapshot,
    TwoPhase,
    raise_if_failed,
)
from ftkit.recovery import pfs_restore
from ftkit.recovery import restore as recovery
from ftkit.recovery.claim import JobClaim
from ftkit.storage.levels import Levels
from ftkit.storage.local import COMMITTED, LocalLevel
from ftkit.storage.pfs import early
from ftkit.storage.pfs.level import PfsLevel
from ftkit.storage.replicas import Sharing

log = logging.getLogger(__name__)
State = MutableMapping[str, Any]
#: seconds :meth:`Checkpointer.abandon` gives the protocol thread to end (it ends at its next
#: wait; one in the middle of a file write finishes it alone, after the recovery went on)
ABANDON_WAIT_S = 5.0


class Checkpointer:
    """Coordinated multi-level checkpoints of one job. Construct on every rank (collective).

    A failed PFS flush (full disk, permissions, I/O error) does not stop training: it is
    logged, appended to ``events.jsonl`` as ``flush-failed``, and the next step due at
    ``pfs`` is flushed as usual. Two attributes show where the PFS copy stands (identical on
    every rank; complete after :meth:`wait` or :meth:`close`):

    * ``pfs_failures`` — ``{step: reason}`` of every failed PFS flush of this process;
    * ``last_flushed`` — the newest step this process flushed to the PFS or restored from
      it, None when neither happened yet.
    """

    def __init__(self, topo: Topology, config: Config | None = None) -> None:
        with recorded(topo.rank):       # e.g. a level that cannot be placed: not retried
            self._init(topo, config)

    def _init(self, topo: Topology, config: Config | None) -> None:
        self.topo = topo
        config, fitted = (config or Config.load()).fit_to_nodes(len(topo.nodes))
        self.config = config
        setup_rank_logging(topo.rank, config.log_level)
        if fitted and topo.rank == 0:
            log.warning("%s", fitted)
        self.dc = DistComm(topo.comm, config.timeout)
        root = config.node_dir(topo.node, os.environ.get("SLURMD_NODENAME"))
        # a fault fires in an attempt's first in-job generation only: a spare that takes a
        # rank's place is a new process and would fire it again
        self.faults = Faults(config.faults if not injob.generation() else "",
                             rank=topo.rank, node=topo.node,
                             attempt=config.attempt,
                             rank_node=topo.rank_node, node_dir=root)
        self.local = LocalLevel.for_config(config, topo.node,
                                           host=os.environ.get("SLURMD_NODENAME"),
                                           rank=topo.rank, node_leader=topo.is_node_leader,
                                           faults=self.faults)
        self.local.node_ranks = set(topo.ranks_on(topo.node))
        self.local.prepare_everywhere(self.dc)
        self.claim = JobClaim(config, topo, self.dc, self.local.root)
        self.run_id = self.claim.take()
        self.identity = {"job": config.job, "run": self.run_id, "nodes": list(topo.rank_node),
                         "layout": {"dp": topo.dp, "tp": topo.tp, "pp": topo.pp}}
        if topo.rank == 0 and config.interval("pfs"):
            # what a crashed attempt's early writes left; before the next collective, so no
            # rank's early write has started
            early.remove_stale(config.job_pfs_dir / early.STAGING)
        self.levels = Levels.build(topo, config, self.dc, self.local, self.faults)
        self.restorer = recovery.Restorer(self.dc, self.levels, self.faults, self._emit)
        self.sharing = Sharing(topo, config.share_replicas == "on", config.timeout)
        self.pfs = PfsLevel(config, topo, self.local, DistComm(topo.comm, config.timeout),
                            self.faults, run_id=self.run_id) if config.interval("pfs") else None
        self.proto = TwoPhase(self.dc, self.levels.by_name(), self.faults,
                              before_write=self._retain_for, emit=self._emit,
                              stop_requested=_stop_file_exists, identity=self.identity,
                              flush_busy=lambda: self.flushes.busy())
        self.stop_requested = False       # set on every rank by a committed step's decision
        self.last_committed: int | None = None
        self.level_last: dict[str, int] = {}     # newest committed step of every level
        self.blocked_seconds: list[float] = []   # every time training waited for ftkit
        self._async = config.async_ and self._threads_ok()
        self.stager = Stager(background=self._async)
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="ftkit-ckpt") if self._async \
            else None
        self._pending: cf.Future[None] | None = None       # protocol of the newest snapshot
        self.flushes = Flushes(self.pfs, rank=topo.rank, emit=self._emit, abort=self._abort,
                               patience=lambda: self._patience, background=self._async,
                               wait_mode=config.pfs_backpressure == "wait")
        self._staging: Staging | None = None
        self._guard = OptimizerGuard(self.wait_staged)
        self._closed = False
        self._admitted = False                   # the state was checked (_admit)
        self._state_bytes = 0                    # tensor bytes of the newest snapshot
        injob.own(self)                          # abandoned if a peer fails (in-job)

    # ------------------------------------------------------------- public API
    def restore(self, state: State, init_from: str | os.PathLike[str] | None = None) -> int:
        """Load the newest step committed and intact everywhere into ``state``; return it
        (0 when none was ever committed). All ranks call.

        ``init_from``: a torch DCP checkpoint directory that seeds ``state`` when the job
        has no committed step yet (:mod:`ftkit.interop.seed`; resharded to this layout);
        ignored once the job has committed one. Returns 0 then too.

        Never deletes a committed step that no newer committed step supersedes: when
        committed steps exist but none can be used (lost beyond what the levels tolerate,
        another world size, rank to node map or run, a state of another structure), it
        raises the same :class:`UnrecoverableError` / :class:`StateMismatchError` on every
        rank and leaves every file as it was. Starting over is explicit: with
        ``FTKIT_START=fresh`` (``ftkit run --fresh``) restore deletes the job's checkpoints
        and returns 0."""
        self.wait()
        with recorded(self.topo.rank):
            self._admit(state)
            step = self._restore(state)
            if not step and init_from is not None:
                from ftkit.interop.seed import seed_everywhere
                seed_everywhere(self.dc, Path(init_from), state, self._emit)
            return step

    def _admit(self, state: State) -> None:
        """Once, before the first step: loaders get ftkit's generators, DDPs are noted, every
        leaf is checked (``capture/attached.py``; UnsupportedStateError everywhere). All ranks
        call."""
        if not self._admitted:
            attached.admit(self.dc, state)
            self._admitted = True

    def _restore(self, state: State) -> int:
        t0 = time.monotonic()
        if self.config.start == "fresh":
            self.restorer.start_fresh(self.config.job_pfs_dir, self.topo.rank_node, self.run_id,
                                      leader=self.topo.is_node_leader)
            return 0
        found = self.restorer.discover(run_id=self.run_id, rank_node=list(self.topo.rank_node),
                                       layout={"dp": self.topo.dp, "tp": self.topo.tp,
                                               "pp": self.topo.pp})
        discover_s = round(time.monotonic() - t0, 6)     # includes any rebuild
        step, level, pfs_unusable = self._load_newest(found, state)
        if not step and (found.unusable() or pfs_unusable):
            error = recovery.unrecoverable_error(found, self.local.root.parent, pfs_unusable)
            if any(pfs_restore.transient(why) for why in pfs_unusable.values()):
                error.recurs = False      # a stalled PFS read may succeed when relaunched
            self._emit("restore-failed", steps=sorted(found.unusable()) + sorted(pfs_unusable),
                       reason=str(error))
            raise error
        self._after_restore(found, step, level)
        peers: dict[str, Any] = {"loaded_from": found.loaded_from()} \
            if level == "local" and found.sources else {}
        self._emit("restore", step=step, level=level, skipped=sorted(found.unusable()),
                   discover_s=discover_s, seconds=round(time.monotonic() - t0, 6), **peers)
        self._repair(found if level == "local" else None)
        if step:
            log.info("restored step %d from level %s", step, level)
        return step

    def _repair(self, found: recovery.Discovery | None) -> None:
        """What the restored step is owed after lost shards were streamed from redundancy
        (:meth:`Restorer.repair`): on the checkpoint thread, where the next save (or
        ``wait``/``close``) waits for it; now when saves are synchronous. All ranks call."""
        if found is None or found.repair is None:
            return
        self._state_bytes = max(self._state_bytes, found.nbytes)     # the wait's patience
        if self._pool is None:
            self.restorer.repair(found)
        else:
            self._pending = self._pool.submit(self.restorer.repair, found)

    def _load_newest(self, found: Any, state: State) -> tuple[int, str, dict[int, str]]:
        """Load the newest usable step: a PFS step newer than the newest recoverable local
        one, else that local one; a local step whose final load fails on any rank becomes
        unusable and the search goes on with older steps (``found`` is updated). Returns
        (step, level, PFS steps found unusable); step 0 when none. All ranks call."""
        pfs_unusable: dict[int, str] = {}
        while True:
            if self.pfs is not None:   # the PFS may hold a newer step than the local levels
                pfs_step, unusable = pfs_restore.restore_from_pfs(
                    self.dc, self.pfs, state, self._emit, newer_than=found.step,
                    skip=set(pfs_unusable))
                pfs_unusable.update(unusable)
                if pfs_step:
                    return pfs_step, "pfs", pfs_unusable
            if not found.step or self.restorer.try_load(found, state):
                return found.step, "local", pfs_unusable

    def save(self, step: int, state: State) -> None:
        """Checkpoint ``state`` as it is after ``step`` completed steps, on every level due at
        ``step``. Async: returns once the state is captured (parameters and optimizer state
        may still be staging; see :meth:`wait_staged`) after the previous checkpoint's
        commit (whose CheckpointError it raises). All ranks call, with the same step. A
        failed PFS flush is never raised (see ``pfs_failures``).

        Until staging is done, only ``optimizer.step()`` of an optimizer in ``state`` may
        change the saved tensors (it waits for staging by itself); anything else that
        changes them in place must call :meth:`wait_staged` first. A change ftkit sees
        through a tensor's version counter aborts this step on every rank (the previous
        committed step stays); a change through ``.data`` or raw memory is not seen."""
        t0 = time.perf_counter()
        self._settle()
        with recorded(self.topo.rank):
            self._admit(state)               # once: does nothing after the first call
        if self.stop_requested:
            self._final_save(step, state)
        self.faults.fire("between", step)
        if self.last_committed is not None and step <= self.last_committed:
            raise CheckpointError(step, {}, message=(
                f"save({step}): step {step} is not newer than the last committed step "
                f"{self.last_committed}; steps must increase"))
        levels = self.config.levels_due(step)
        if not levels:
            return
        snap = self._capture(step, levels, state)
        self._staging = snap.staging
        self.blocked_seconds.append(time.perf_counter() - t0)
        if self._pool is not None:
            self._pending = self._pool.submit(self._protocol, snap)
        else:
            self._protocol(snap)

    def wait_staged(self) -> None:
        """Block until the newest snapshot is fully staged, so its tensors may change.
        Local. Every optimizer in the saved state calls it before ``step()``; call it
        yourself before changing parameters or optimizer state any other way."""
        staging, self._staging = self._staging, None
        if staging is None or staging.done():
            return
        t0 = time.perf_counter()
        try:
            staging.wait(timeout=self._patience)
        except cf.TimeoutError:
            self._abort(f"staging did not finish within {self._patience:g} s")
        self.blocked_seconds.append(time.perf_counter() - t0)

    def wait(self) -> None:
        """Wait for every background checkpoint and flush, re-raising the newest
        checkpoint's CheckpointError; a failed PFS flush is not raised (it is in
        ``pfs_failures``). All ranks call at the same point."""
        self._settle()
        self.flushes.finish(self._result)

    @property
    def pfs_failures(self) -> dict[int, str]:
        """``{step: reason}`` of every failed PFS flush of this process (agreed)."""
        return self.flushes.failures

    @property
    def last_flushed(self) -> int | None:
        """The newest step this process flushed to the PFS or restored from it."""
        return self.flushes.last_flushed

    def close(self, *, stopped: bool = False) -> None:
        """Finish background work, flush the newest committed step to the PFS when a PFS
        level exists and it is not there yet, then mark the job complete once every rank got
        here (``stopped``: ended early on a stop request). All ranks call. When the newest PFS
        flush attempted failed, rank 0 logs an ERROR (the newest committed steps are only on
        the node-local levels) but nothing is raised. Whatever the background work raised
        (the newest checkpoint's CheckpointError), the job's locks, slots and communicators
        are given back before it is re-raised: a new Checkpointer of the job may start."""
        if self._closed:
            return
        self._closed = True
        tidy = False
        try:
            try:
                self.wait()
                self.flushes.flush_last(self.last_committed, self._result)
            finally:
                self._stop_threads(wait=True)
            self.proto.exchange(CLOSING, None, "close")   # a peer in a save() skipped here
            self.flushes.report_unflushed(self.last_committed)
            tidy = all(self.dc.allgather(self._may_tidy(stopped), "close"))
            done = os.environ.get("FTKIT_DONE_FILE")
            if done and self.topo.rank == 0:
                write_done(Path(done), {"job": self.config.job, "attempt": self.config.attempt,
                                        "last_committed": self.last_committed,
                                        "time": time.time(), "stopped": stopped,
                                        "local_removed": tidy,
                                        "unflushed": self.flushes.unflushed()})
        finally:
            self._release(tidy)

    def _stop_threads(self, *, wait: bool) -> None:
        """Stop the staging, the checkpoint thread and the flushes. Local."""
        self._guard.remove()
        self.stager.close()
        if self._pool is not None:
            self._pool.shutdown(wait=wait)
        self.flushes.shutdown(wait=wait)

    def _release(self, tidy: bool) -> None:
        """Give back the levels' slots and communicators, the PFS level's, this object's
        and the job's locks, each whatever the one before raised (logged). Local."""
        parts: list[tuple[str, Callable[[], None]]] = [("levels", self.levels.free)]
        if self.pfs is not None:
            parts.append(("pfs", self.pfs.free))
        parts += [("communicator", self.dc.free), ("DP communicator", self.sharing.free),
                  ("locks", lambda: self.claim.release(tidy=tidy)),
                  ("in-job registration", lambda: injob.disown(self))]
        for what, free in parts:
            try:
                free()
            except Exception:
                log.exception("rank %d: closing the Checkpointer: releasing its %s failed",
                              self.topo.rank, what)

    def abandon(self) -> None:
        """In-job recovery, after a peer failed: stop this Checkpointer's threads and give
        its locks back, without any communication (its communicators are revoked); the next
        generation builds a new one and restores. What this generation committed stays;
        what it had not committed is discarded by that restore. Local."""
        if self._closed:
            return
        self._closed = True
        pending, self._pending = self._pending, None
        if pending is not None:     # its next wait raises PeerLost (an old generation's)
            with contextlib.suppress(Exception):
                pending.result(timeout=ABANDON_WAIT_S)
        self._stop_threads(wait=False)
        self.claim.release()
        injob.disown(self)

    def _may_tidy(self, stopped: bool) -> bool:
        """May a successful end remove the node-local copies (``ftkit run`` asked, the job
        was not stopped early, its newest committed step is on the PFS)? Local."""
        return (tidy_requested() and not stopped and self.last_committed is not None
                and self.last_flushed == self.last_committed)

    # -------------------------------------------------------------- internals
    @property
    def _patience(self) -> float:
        """How long a local wait on background work may take before the job is aborted: a
        few control timeouts plus the bulk allowance for the state's bytes (a write, copies
        or parity and a flush each move about the whole state; see ``MIN_BULK_BANDWIDTH``)."""
        return bulk_seconds(self.config.timeout * 6, 4 * self._state_bytes)

    def _final_save(self, step: int, state: State) -> None:
        """A stop was requested (time limit near): checkpoint ``step`` on every configured
        level, PFS included, wait for it, close, and end the process cleanly with
        ``SystemExit(0)`` so a requeued job resumes here. All ranks call (they all saw the
        same decision).

        If the PFS flush of the final step fails, :meth:`close` logs an ERROR and the ranks
        still exit with status 0: the step is committed on the node-local levels, so a
        requeue on the same nodes resumes from it (on other nodes, it resumes from the newest
        step on the PFS)."""
        levels = self.config.levels_all()
        log.warning("rank %d: stop requested: final checkpoint of step %d on %s",
                    self.topo.rank, step, ",".join(levels))
        if self.last_committed is None or step > self.last_committed:
            snap = self._capture(step, levels, state)
            self._protocol(snap)
        self.wait()
        self._emit("stop", step=self.last_committed, levels=list(levels))
        self.close(stopped=True)
        raise SystemExit(0)

    def _settle(self) -> None:
        """Wait for the newest snapshot's commit (its buffers are free again then), raising
        its CheckpointError. Local."""
        self.flushes.forget_done()
        pending, self._pending = self._pending, None
        if pending is not None:
            self._result(pending, "background checkpoint")

    def _result(self, future: cf.Future[None], what: str) -> None:
        """Wait for ``future`` (PeerLost at once under in-job recovery once a peer failed)
        and raise its error; abort the world past ``_patience``. Local."""
        try:
            injob.wait_done(future, self._patience, what, self.dc.generation)
        except cf.TimeoutError:
            self._abort(f"{what} did not finish within {self._patience:g} s")
            return                       # a test's abort returns; MPI's does not
        future.result()

    def _capture(self, step: int, levels: tuple[str, ...], state: State) -> Snapshot:
        """Flatten ``state`` and stage its tensors: CPU tensors straight into a reserved
        slot of the node-local level when it is due (the slot is freed first by releasing
        this rank's shards that retention drops; sync: hashed as they land, one pass),
        CUDA tensors into pinned staging buffers. A failure becomes ``snap.failure`` (this
        rank votes no). Local."""
        snap = Snapshot(step, levels)
        try:
            self.faults.fire("capture", step)
            tree, leaves = flatten(state, attached.extra)
            snap.tree, (snap.leaves, share) = tree, self.sharing.leaves(tree, leaves, step,
                                                                        levels)
            snap.meta = {"job": self.config.job, "run": self.run_id, "step": step,
                         "rank": self.topo.rank,
                         "world": self.topo.world, "topology": self.topo.describe(),
                         "time": time.time(), "ftkit": __version__,
                         **shards.describe(state, leaves), **({"share": share} if share else {})}
            self._state_bytes = sum(leaf.nbytes for leaf in leaves)
            into = None
            if "local" in levels:
                # stage CPU tensors straight into the slot, freed first (the previous
                # checkpoint has committed: save() settled it): no staging buffer. Sync:
                # hashed as they land (one pass); async: the training loop waits for plain
                # copies only, the checksums run in the background
                self.local.release(self._keep(step))
                into = self.local.reserve(step, snap.meta, tree, snap.leaves)
                snap.into = into
                if self._pool is None:
                    self._write_early(snap)      # the PFS file, as the tensors land
            snap.buffers, snap.staging = self.stager.start(snap.leaves, self._deferrable(state),
                                                             step=step, into=into)
        except Exception as exc:  # noqa: BLE001 - this rank votes no
            log.error("rank %d: capture of step %d failed: %s", self.topo.rank, step,
                      describe(exc))
            snap.failure = describe(exc)
        return snap

    def _deferrable(self, state: State) -> Any:
        """Predicate for leaves staged in the background (:func:`guard.deferrable`)."""
        if self._pool is None:
            return lambda leaf: False
        optimizers = optimizers_in(state)
        self._guard.install(optimizers)
        return deferrable(optimizers)

    def _protocol(self, snap: Snapshot) -> None:
        """Phases 2-7 of ``snap`` (all ranks call, on the checkpoint thread when async):
        its early PFS write, when the flush did not take it, is given up at the end."""
        try:
            self._run_protocol(snap)
        finally:
            self.flushes.discard_early()

    def _run_protocol(self, snap: Snapshot) -> None:
        if snap.staging is not None:
            try:
                error = snap.staging.wait(timeout=self._patience)
            except cf.TimeoutError:
                error = TimeoutError(f"staging took longer than {self._patience:g} s")
            if error is not None and snap.failure is None:
                log.error("rank %d: staging of step %d failed: %s", self.topo.rank, snap.step,
                          describe(error))
                snap.failure = describe(error)
        if self._pool is not None:
            self._write_early(snap)        # async: after the staging the training waits for
        try:
            out = self.proto.run(snap)
        except (ProtocolTimeout, ProtocolMismatch) as exc:
            record_fatal(exc, self.topo.rank)      # a mismatch recurs: not relaunched
            self._abort(str(exc))
            raise
        self.stop_requested |= out.stop
        if out.committed:
            self.last_committed = snap.step
            self.level_last.update({name: snap.step for name in snap.levels})
            if injob.take_first_step():
                self._emit("in-job-step", step=snap.step, generation=injob.generation(),
                           since_detected=round(time.time() - injob.last_failure_at(), 6))
        raise_if_failed(out)
        if self.pfs is not None:
            self.flushes.schedule(snap.step if "pfs" in snap.levels else None, out.flush_busy)

    def _write_early(self, snap: Snapshot) -> None:
        """Start the early PFS write of ``snap`` (``Flushes.write_early``) when it is due at
        ``pfs`` and captured into a reserved slot: at the start of the capture when sync
        (the PFS write overlaps the capture and the protocol the caller waits for), after
        the staging when async (overlapping the protocol; never slowing down the background
        copy the training loop may wait for). Local."""
        if snap.into is not None and "pfs" in snap.levels and snap.failure is None:
            self.flushes.write_early(snap.step, snap.into)

    def _retain_for(self, step: int) -> None:
        """Before writing tentative ``step``: keep it and the newest permanent version (the
        newest committed one on this node when this Checkpointer has not seen a commit);
        parked steps superseded by the last commit go."""
        keep = self._keep(step)
        self.local.release(keep)
        self.local.retain(keep, superseded_by=self.last_committed)

    def _keep(self, step: int) -> set[int]:
        """The node-local steps kept while ``step`` is written: it, the newest committed
        step of every level (the newest committed one on this node when this Checkpointer
        has not seen a commit) and the steps being flushed. Local."""
        keep = {step} | set(self.level_last.values()) | self.flushes.kept
        if self.last_committed is None:
            keep |= {max((s for s in self.local.steps() if self.local.is_committed(s)),
                         default=step)}
        return keep

    def _after_restore(self, found: recovery.Discovery, step: int, level: str) -> None:
        """Bookkeeping after every restore, whatever level supplied ``step``: complete the
        restored step's commit record on this node, keep it, one older usable committed step
        and the newest committed step of every level; park committed node-local steps newer
        than ``step`` (unusable, or of another world or run: kept until a newer commit
        supersedes them, so the job can save those step numbers again); drop uncommitted
        versions and versions ``step`` supersedes. All ranks call (node leaders act)."""
        usable = [s for s in found.committed if s <= step and s not in found.skipped]
        for s in reversed(usable):                      # oldest first: newest wins
            self.level_last.update({lv: s for lv in found.levels_of[s]})
        if level == "pfs" or (step and self._on_pfs(step)):
            self.level_last["pfs"] = step
            self.flushes.last_flushed = step
        self.last_committed = step or None
        if step and level == "local" and self.topo.is_node_leader \
                and not self.local.is_committed(step):
            write_record(self.local.ensure_step_dir(step) / COMMITTED,
                         self.proto.record(step, found.levels_of[step]) |
                         {"completed_by": "restore"})
        self.local.park({s for s in self.local.steps() if s > step})
        self.local.retain(set(usable[:2]) | set(self.level_last.values()))
        self.sharing.forget()                    # the replicas are compared again
        self.dc.barrier("restore-load", step)

    def _on_pfs(self, step: int) -> bool:
        """Is ``step`` committed on the PFS (rank 0 looks, every rank learns it)? A step
        restored from a node-local level often is: ``close()`` then has nothing to flush.
        All ranks call."""
        if self.pfs is None:
            return False
        return bool(self.dc.bcast(step in self.pfs.committed_steps() if self.topo.rank == 0
                                  else None, "restore-load", step))

    def _emit(self, event: str, *, any_rank: bool = False, **fields: Any) -> None:
        """Append an event line (rank 0 only, unless ``any_rank``); never fails the caller."""
        if self.topo.rank != 0 and not any_rank:
            return
        try:
            append_event(self.config.events_path, event, job=self.config.job,
                         attempt=self.config.attempt, rank=self.topo.rank, **fields)
        except OSError as exc:
            log.warning("cannot append to %s: %s", self.config.events_path, exc)
            mark_progress(self.config.events_path)

    def _threads_ok(self) -> bool:
        if MPI.Query_thread() >= MPI.THREAD_MULTIPLE:
            return True
        log.warning("MPI provides no THREAD_MULTIPLE; checkpoints run synchronously")
        return False

    def _abort(self, why: str) -> None:
        """A peer is dead or hung: no consensus is possible without it. Abort the world
        (under in-job recovery, a failure it knows of raises PeerLost instead)."""
        injob.check(why, self.dc.generation)
        log.critical("rank %d: %s; aborting the MPI job", self.topo.rank, why)
        self._emit("timeout", any_rank=True, reason=why)
        record_death(self.topo.rank, aborted=why)
        _flush_logs()
        MPI.COMM_WORLD.Abort(3)


def _stop_file_exists() -> bool:
    """Coordinator: has ``ftkit run`` asked this attempt to stop (``$FTKIT_STOP_FILE``)?"""
    path = os.environ.get("FTKIT_STOP_FILE", "")
    return bool(path) and os.path.exists(path)


def _flush_logs() -> None:
    for handler in logging.getLogger("ftkit").handlers:
        handler.flush()



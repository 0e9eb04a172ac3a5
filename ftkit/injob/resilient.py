"""``ftkit.resilient(train)``: run a training function that survives the death of ranks
without a relaunch (in-job recovery; ``ftkit run --in-job --spares K``).

Without in-job recovery (``FTKIT_SPARE_RANKS`` unset) it is ``train(MPI.COMM_WORLD)``.
With it, the job's processes are N working ranks and K spares (the last K of
``MPI_COMM_WORLD``), started by ``mpiexec --with-ft ulfm``:

1. every process starts a watcher (:mod:`ftkit.injob.watch`; with the heartbeat ring of
   :mod:`ftkit.injob.heartbeat`, which ends a process that hangs); the working ranks call
   ``train(comm)`` with a communicator of the N working ranks, the spares wait, idle;
2. a rank dies: ULFM tells the watchers, which revoke the communicators; every wait of
   ftkit ends with :class:`~ftkit.comm.flag.PeerLost`, a torch collective with the lost
   peer's connection error; ``train`` raises on every survivor;
3. every survivor and every spare: abandon the Checkpointers of the generation (threads
   stopped, locks released, no communication), destroy torch's process group (its sockets
   close, so a peer still blocked in a torch collective errors out too), shrink the world
   and give the failed ranks' places to spares (:mod:`ftkit.injob.membership`);
4. the working ranks call ``train(comm)`` again on the new communicator: same rank numbers,
   same grid, same (virtual) nodes (a node's ranks stay on one host: when the failed
   rank's host has no spare, its whole node moves to a spare host, see
   :mod:`ftkit.injob.membership`). ``train`` restores as after a relaunch: survivors read
   their node-local copies, a spare on a lost node's place gets its shard rebuilt from the
   partner/XOR/RS copies of the other nodes.

More failures than spares, a failure during recovery that repeats, or an error of
``train`` that is not a peer's failure: the process records why and aborts the world;
``ftkit run`` relaunches the job (:func:`~ftkit.injob.fallback.fall_back`).

What ``train`` must do: build everything that talks to other ranks from ``comm`` on every
call (torch.distributed with :func:`ftkit.init_torch_distributed(comm)`, a
:class:`~ftkit.Topology`, a :class:`~ftkit.Checkpointer`), restore, and train; return on
every working rank. Module state it keeps across calls survives too (the process lives on),
so it must restore all of it from the checkpoint, as a relaunched process would.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from ftkit.comm import flag
from ftkit.errors import ConfigError, FtkitError
from ftkit.injob.deadline import Deadline
from ftkit.injob.fallback import fall_back, who
from ftkit.jobdir.env import SPARES_ENV

log = logging.getLogger(__name__)
T = TypeVar("T")

#: shrink attempts when processes keep failing during a recovery
REBUILD_TRIES = 3
#: seconds MPI_Finalize may take after a recovery before the process is ended
FINALIZE_S = 5.0


def spare_ranks(env: Mapping[str, str] | None = None) -> int | None:
    """``$FTKIT_SPARE_RANKS`` (set by ``ftkit run --in-job``): None when in-job recovery is
    off; ConfigError when malformed. Pure."""
    raw = (os.environ if env is None else env).get(SPARES_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ConfigError(f"{SPARES_ENV}: expected a number of spare ranks >= 0, got {raw!r}")
    return int(raw)


def resilient(train: Callable[[Any], T]) -> T | None:
    """Run ``train(comm)`` with in-job recovery when ``ftkit run --in-job`` started the job
    (module doc), else once over ``MPI.COMM_WORLD``. Every process of the job calls it;
    returns ``train``'s result on the working ranks, None on the spares."""
    from mpi4py import MPI

    from ftkit.comm.topology import check_launcher
    check_launcher(os.environ, MPI.COMM_WORLD.Get_size())   # torchrun: refuse, not hang
    spares = spare_ranks()
    if spares is None:
        return train(MPI.COMM_WORLD)
    return InJob(spares).run(train)


class InJob:
    """The in-job recovery loop of one process."""

    def __init__(self, spares: int) -> None:
        from mpi4py import MPI
        self.n = MPI.COMM_WORLD.Get_size() - spares
        if self.n < 1:
            raise ConfigError(f"{SPARES_ENV}={spares} leaves no working rank in a world of "
                              f"{MPI.COMM_WORLD.Get_size()} processes")
        self._warmed = False
        from ftkit.config import Config
        from ftkit.faults import Faults
        cfg = Config.load()
        self.heartbeat = cfg.heartbeat
        self.timeout = cfg.timeout
        self.faults = Faults(cfg.faults, rank=MPI.COMM_WORLD.Get_rank(), node=-1,
                             attempt=cfg.attempt)

    def run(self, train: Callable[[Any], T]) -> T | None:
        from mpi4py import MPI

        from ftkit.injob import membership, sockets
        from ftkit.injob.watch import Watch
        flag.activate()
        sockets.install()
        gen = membership.first_generation(self.n)
        _started(gen)
        while True:
            deadline = Deadline(self.timeout, gen.logical, fall_back,
                                who(gen.logical, MPI.COMM_WORLD.Get_rank()))
            watch = Watch(gen.world, gen.work, gen.logical, self.heartbeat, deadline.arm)
            if gen.logical >= 0:
                try:
                    ok, result = self._train(train, gen.work)
                except SystemExit:          # a requested stop: every working rank ends
                    deadline.cancel()
                    _finish(gen, watch)
                    raise
                if ok:
                    deadline.cancel()
                    _finish(gen, watch)
                    return result
            else:
                deadline.enter("wait as a spare")
                if self._idle(watch):
                    deadline.cancel()
                    watch.join()
                    if flag.generation():   # an idle spare's finalize hangs as well
                        atexit.register(_bound_finalize)
                    return None
            watch.alarm(flag.reason() or "training failed on this rank")
            deadline.enter("teardown (abandoning its checkpointers, torch's groups)")
            _teardown()
            gen = self._recover(gen, deadline)

    def _train(self, train: Callable[[Any], T], comm: Any) -> tuple[bool, T | None]:
        """(True, result) when ``train`` returned; (False, None) when it failed because a
        peer did; any other error propagates (and aborts the world)."""
        try:
            return True, train(comm)
        except BaseException as exc:
            if isinstance(exc, SystemExit):
                raise
            if isinstance(exc, KeyboardInterrupt) or not _peer_failure(exc):
                raise
            log.warning("in-job: rank %d: training stopped: %s", comm.Get_rank(),
                        flag.reason())
            return False, None

    def _idle(self, watch: Any) -> bool:
        """A spare waits; True when the job finished, False on a failure. Once, it first
        imports what a first optimizer step would (:func:`_warm`)."""
        if not self._warmed:
            self._warmed = True
            _warm()
        while not watch.done.is_set():
            if flag.wait(0.05):
                return False
        return True

    def _recover(self, gen: Any, deadline: Deadline) -> Any:
        """Shrink and rebuild the generation (:mod:`ftkit.injob.membership`) before
        ``deadline`` (armed by the watch's alarm when the failure became known here, which
        :meth:`run` sounds before every recovery; cancelled once rebuilt)."""
        from mpi4py import MPI

        from ftkit.injob import membership
        deadline.enter("shrink (the new generation's communicators)")
        for attempt in range(REBUILD_TRIES):
            if not flag.generation():
                self.faults.fire("in-job-rebuild", None)  # tests: a failure meanwhile
            try:
                rebuilt = membership.rebuild(gen)
                break
            except membership.NotEnoughSpares as exc:
                fall_back(str(exc), gen.logical)
            except MPI.Exception as exc:
                log.warning("in-job: shrink %d failed (%s); again", attempt + 1, exc)
        else:
            fall_back(f"processes kept failing during {REBUILD_TRIES} recoveries",
                      gen.logical)
        deadline.cancel()
        new = rebuilt.generation
        if gen.logical >= 0 and new.logical < 0:
            _leave_node(gen, rebuilt.assignment.moved)
        if new.logical == 0:
            _event(rebuilt, gen)
        flag.next_generation()
        return new


def _leave_node(old: Any, moved: list[int]) -> None:
    """This process's rank moved with its node to another host; it is a spare now. The
    lowest moved rank of the node removes the node's local directory on this host (nobody
    reads it again). Local; never raises."""
    from ftkit.config import Config
    from ftkit.recovery.claim import remove_moved_node
    node = old.node_of[old.logical]
    if old.logical != min(lr for lr in moved if old.node_of[lr] == node):
        return
    try:
        cfg = Config.load()
    except FtkitError as exc:
        log.warning("in-job: cannot remove node %d's local copies: %s", node, exc)
        return
    remove_moved_node(cfg, cfg.node_dir(node, os.environ.get("SLURMD_NODENAME")))


def _peer_failure(exc: BaseException) -> bool:
    """Is ``exc`` (raised by ``train``) the echo of a peer's failure? Yes when the flag is
    tripped, MPI reports a failed process, or a torch collective lost its peer; else the
    watcher gets :data:`~ftkit.comm.flag.CONFIRM_S` to confirm one."""
    from ftkit.comm.dist import lost_peer
    from ftkit.injob.watch import is_failure
    if flag.tripped():
        return True
    if is_failure(exc) or isinstance(exc, flag.PeerLost) or lost_peer(exc):
        flag.trip(f"{type(exc).__name__}: {str(exc)[:200]}")
        return True
    return flag.confirm()


def _warm() -> None:
    """A spare imports, while it waits, what the training code's first use of torch would
    import (``torch._dynamo``, ~1.5 s, on the first optimizer built): time taken off the
    recovery it will join. Local; nothing without torch."""
    if "torch" not in sys.modules:
        return
    with contextlib.suppress(Exception):
        import torch._dynamo  # noqa: F401


def _teardown() -> None:
    """Local: abandon this generation's Checkpointers, destroy torch's process groups (the
    watcher already shut their connections down: :mod:`ftkit.injob.sockets`).

    torch names a default group by a process-wide counter, taken *before* its rendezvous;
    ``destroy_process_group`` resets it, but only when a default group exists. A generation
    whose ``init_process_group`` failed midway (a peer died while the groups were built)
    leaves the counter ahead on this process and not on a fresh spare: the next
    generation's ranks would then wait for each other's keys under different names, for
    ever. So the counter is reset here in every case."""
    for error in flag.abandon_all():
        log.warning("in-job: abandoning a checkpointer: %s", error)
    with contextlib.suppress(ImportError):
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        if dist.is_available():
            from torch.distributed import distributed_c10d as c10d
            world = getattr(c10d, "_world", None)
            if world is not None and hasattr(world, "group_count"):
                world.group_count = 0


def _finish(gen: Any, watch: Any) -> None:
    """The working ranks finished: release the spares and every watcher. All processes of
    the generation's world end up here (the spares through their watcher).

    After a recovery, MPI_Finalize may wait forever for the dead processes (Open MPI 5's
    finalize fence, open-mpi/ompi#11404: about half the runs here): logical rank 0 marks
    the attempt complete (``in_job.released`` in ``FTKIT_DONE_FILE``, which ``ftkit run``
    takes as success whatever the launcher's exit status) and every process bounds its
    MPI_Finalize at interpreter exit (:func:`_bound_finalize`)."""
    from mpi4py import MPI
    with contextlib.suppress(MPI.Exception):
        gen.work.Barrier()
    if flag.generation() and gen.logical == 0:
        _mark_released()
    watch.finish()
    if flag.generation():
        atexit.register(_bound_finalize)


def _mark_released() -> None:
    from ftkit.launch.marker import read_marker, write_done
    done = os.environ.get("FTKIT_DONE_FILE")
    if done:
        record = read_marker(Path(done))
        record["in_job"] = {"generation": flag.generation(), "released": True}
        write_done(Path(done), record)


def _bound_finalize() -> None:
    """At interpreter exit after a recovery: flush, then arm a SIGALRM (default action: the
    kernel ends the process) of :data:`FINALIZE_S` seconds for mpi4py's MPI_Finalize, which
    runs after this and holds the interpreter (no Python watchdog could run). A finalize
    that completes ends the process normally first; one stuck in the fence waiting for the
    dead processes (open-mpi/ompi#11404) is ended by the alarm — after MPI delivered what
    the process sent (ending it at once instead drops messages still queued in MPI: a
    peer then waits forever)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.setitimer(signal.ITIMER_REAL, FINALIZE_S)


def _started(gen: Any) -> None:
    """Process 0 of the first generation records that every process passed MPI_Init (the
    first generation's gather needed them all): ``ftkit run`` watches for it (its start-up
    deadline; a process that dies during MPI_Init leaves the others waiting there)."""
    from ftkit.config import Config
    from ftkit.jobdir.events import append_event, mark_progress
    if gen.world.Get_rank() != 0:
        return
    cfg = Config.load()
    try:
        append_event(cfg.events_path, "in-job-start", job=cfg.job, attempt=cfg.attempt,
                     rank=0, processes=gen.world.Get_size(), working=gen.n)
    except OSError as exc:
        log.warning("in-job: cannot record the start: %s", exc)
        mark_progress(cfg.events_path)


def _event(rebuilt: Any, old: Any) -> None:
    """Logical rank 0 of the new generation records the recovery (``in-job`` event)."""
    from ftkit.config import Config
    from ftkit.jobdir.events import append_event
    a = rebuilt.assignment
    try:
        cfg = Config.load()
        append_event(cfg.events_path, "in-job", job=cfg.job, attempt=cfg.attempt, rank=0,
                     generation=flag.generation() + 1, reason=flag.reason(),
                     failed=a.failed, replaced={str(k): v for k, v in a.replaced.items()},
                     moved=a.moved, spares_left=a.spares_left, detected=flag.tripped_at(),
                     recovered=time.time(),
                     **{k: round(v, 6) for k, v in rebuilt.timings.items()})
    except (OSError, FtkitError) as exc:
        log.warning("in-job: cannot record the recovery: %s", exc)
    moved = (f"; rank(s) {a.moved} moved with their node (their processes are spares now)"
             if a.moved else "")
    print(f"ftkit: in-job recovery: rank(s) {a.failed} failed ({flag.reason()}); "
          f"taken over by spare process(es) {list(a.replaced.values())}{moved}; "
          f"{a.spares_left} spare(s) left", file=sys.stderr, flush=True)

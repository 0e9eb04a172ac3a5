"""The ``ftkit run`` relaunch loop: launch, watch, judge, relaunch.

An attempt succeeds only when the launcher exits 0 **and** the job wrote its completion marker
(``$FTKIT_DONE_FILE``, written by rank 0 once every rank has returned from
``Checkpointer.close()``): under ULFM a SIGKILLed rank can leave ``mpiexec`` exiting 0. Every
attempt runs in its own session (process group) under a watchdog (:class:`AttemptWatch`): an
attempt whose job shows no progress for ``--stall-timeout`` seconds (default
:data:`DEFAULT_STALL_TIMEOUT`; progress: the job's ``events.jsonl``, which rank 0 appends to on
restore and at every save, commit and flush, changed, or the attempt just started) or that
runs past ``--attempt-timeout`` (default: no wall-clock limit; under Slurm the allocation's
time limit bounds it) gets SIGTERM, then SIGKILL after a grace period, and ends with
:data:`TIMEOUT_STATUS` (retried like any other failure). SIGINT/SIGTERM sent to ``ftkit run``
are forwarded to the running attempt's group and stop the loop.

Each attempt prints exactly one line to stdout and appends events (``launch``, ``attempt-end``,
``relaunch``, ``done`` / ``gave-up``) to the job's ``events.jsonl``.

Errors that a relaunch would hit again (a bad configuration, checkpoints that cannot be used, a
state that does not match the checkpoint: :attr:`ftkit.errors.FtkitError.recurs`) are not
retried: every attempt gets a fresh, empty ``$FTKIT_FATAL_DIR``
(``$FTKIT_PFS_DIR/<job>/attempt-<k>.fatal/``, removed afterwards) where a rank that raises one
leaves a record (:mod:`ftkit.jobdir.fatal`); after a failed attempt with a record the loop stops
with :data:`NOT_RETRIED_STATUS`, whatever restarts are left.

Every attempt resumes from the newest committed step (``FTKIT_START=resume``) except attempt 0
of ``ftkit run --fresh`` (or ``FTKIT_START=fresh``), which starts over; its relaunches resume
what it committed, and so does a requeued Slurm job.

Exit status of ``ftkit run``: 0 success; :data:`NOT_RETRIED_STATUS` (3) a recurring error, not
retried; :data:`TIMEOUT_STATUS` (124) the last attempt stalled or timed out;
:data:`REQUEUE_FAILED_STATUS` (75) Slurm could not requeue; 128+N interrupted by signal N;
otherwise the last attempt's exit status (a launcher that exited 0 without the completion
marker: 1).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

from ftkit.config import Config
from ftkit.errors import LaunchError
from ftkit.jobdir import paths
from ftkit.jobdir.deathsig import die_with
from ftkit.jobdir.events import append_event, restored_step
from ftkit.jobdir.fatal import FATAL_DIR_ENV, first_recurring, read_records
from ftkit.jobdir.identity import LAUNCH_ID_ENV, new_run_id
from ftkit.jobdir.lock import JobLock, holder_record
from ftkit.launch import marker
from ftkit.launch.base import Launcher, Recovery
from ftkit.launch.failures import (
    StderrTee,
    explain,
    load_failure,
    lost_daemons_reason,
    signame,
)
from ftkit.launch.jobs import TIDY_ENV, end_line
from ftkit.launch.orphans import this_host_job_dir, wait_for_orphans
from ftkit.launch.outcome import (
    AttemptResult,
    attempt_line,
    judge,
    restart_delay,
)
from ftkit.launch.spec import RunSpec
from ftkit.progress import NoProgress

log = logging.getLogger(__name__)

REQUEUE_FAILED_STATUS = 75          # EX_TEMPFAIL: resubmit to continue
_TEE_WAIT_S = 5.0     # for the launcher's last words once it exited (a process outside its
#                       group may hold the pipe: then what came so far is what is known)
_POLL_S = 0.25        # how often a waiting loop re-checks deadlines (not a synchronisation)


def done_file_path(cfg: Config, attempt: int) -> Path:
    """Absolute path of attempt ``attempt``'s completion marker."""
    return paths.done_file(cfg.job_pfs_dir, attempt)


def stop_file_path(cfg: Config) -> Path:
    """Where ``ftkit run`` asks the running attempt to stop (``$FTKIT_STOP_FILE``)."""
    return paths.stop_file(cfg.job_pfs_dir)


def fatal_dir_path(cfg: Config, attempt: int) -> Path:
    """Absolute path of attempt ``attempt``'s ``FTKIT_FATAL_DIR`` (every node sees the PFS)."""
    return paths.fatal_dir(cfg.job_pfs_dir, attempt)


def attempt_env(base: Mapping[str, str], attempt: int, done_file: Path,
                ranks_per_node: int | None = None, stop_file: Path | None = None,
                fatal_dir: Path | None = None, start: str | None = None) -> dict[str, str]:
    """Environment of one attempt: ``base`` plus ``FTKIT_ATTEMPT``/``FTKIT_DONE_FILE``/..."""
    env = dict(base)
    env["FTKIT_ATTEMPT"] = str(attempt)
    env["FTKIT_DONE_FILE"] = str(done_file)
    if stop_file is not None:
        env["FTKIT_STOP_FILE"] = str(stop_file)
    if fatal_dir is not None:
        env[FATAL_DIR_ENV] = str(fatal_dir)
    if start is not None:
        env["FTKIT_START"] = start
    if ranks_per_node is not None:
        env["FTKIT_RANKS_PER_NODE"] = str(ranks_per_node)
    return env


class _Interrupt:
    """SIGINT/SIGTERM received by ``ftkit run``; forwarded to the current attempt's group.

    The first signal is forwarded as is; a second one sends SIGKILL. SIGUSR1 (Slurm's
    ``--signal=B:USR1@T`` before the time limit) instead creates ``stop_file``: the job takes
    a final checkpoint on every level and exits cleanly.
    """

    def __init__(self, stop_file: Path | None = None) -> None:
        self.signum: int | None = None
        self.at = 0.0
        self.pgid: int | None = None
        self.stop_file = stop_file
        self.stop_asked = False

    def stop(self, _signum: int, _frame: Any) -> None:
        """SIGUSR1 handler: ask the running job to stop after its next checkpoint."""
        self.stop_asked = True
        if self.stop_file is not None:
            self.stop_file.parent.mkdir(parents=True, exist_ok=True)
            self.stop_file.touch()

    def handle(self, signum: int, _frame: Any) -> None:
        """Signal handler (runs in the main thread)."""
        first = self.signum is None
        if first:
            self.signum, self.at = signum, time.monotonic()
        if self.pgid is not None:
            signal_group(self.pgid, signum if first else signal.SIGKILL)

    def attach(self, pgid: int | None) -> None:
        """Follow a new attempt (``None``: none running); forward a signal that came early."""
        self.pgid = pgid
        if pgid is not None and self.signum is not None:
            signal_group(pgid, self.signum)


@contextlib.contextmanager
def _forwarding(interrupt: _Interrupt) -> Iterator[None]:
    """Install SIGINT/SIGTERM handlers (main thread only) and restore them afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, interrupt.handle) for s in sigs}
    previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, interrupt.stop)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def signal_group(pgid: int, signum: int) -> None:
    """Send ``signum`` to process group ``pgid``; a group that is already gone is fine."""
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _terminate(proc: subprocess.Popen[bytes], grace: float) -> int:
    """SIGTERM the attempt's group, SIGKILL it after ``grace`` seconds; return the rc."""
    signal_group(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        signal_group(proc.pid, signal.SIGKILL)
        return proc.wait()


class AttemptWatch:
    """The watchdog of one running attempt: its wall-clock limit, its start-up and its
    progress.

    ``timeout`` (0: none) counts from ``start``; ``stall`` (0: none) from the last progress:
    the start, or the last check that found ``events`` (the job's event log) changed in
    size, modification time or identity; ``startup`` (0: none) from ``start`` until the first
    such change (the job's first event: under ``--in-job``, written once every process
    passed MPI_Init). Checked by the launcher's wait loop only; a monotonic clock is passed
    in, so a test can drive it.
    """

    def __init__(self, start: float, timeout: float, stall: float, events: Path | None,
                 startup: float = 0.0) -> None:
        self.deadline = start + timeout if timeout else math.inf
        self.stall, self.events = stall, events
        self.startup_deadline = start + startup if startup and events is not None \
            else math.inf
        self.started = False                   # the event log changed since the start
        self.why: str | None = None            # "timeout", "startup" or "stall" once expired
        self._mark = self._first = self._stat()
        self._stalled = NoProgress(stall, now=start)

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.events) if self.events is not None else None
        except OSError:
            return None
        return None if st is None else (st.st_ino, st.st_size, st.st_mtime_ns)

    def progressed(self) -> bool:
        """Whether the event log changed since the start (the job wrote an event)."""
        return self.events is not None and self._stat() != self._first

    def expired(self, now: float) -> bool:
        """Whether the attempt must end at ``now`` (:attr:`why` then says which limit)."""
        if self.events is not None and (self.stall or not self.started):
            mark = self._stat()
            if mark != self._mark:
                self._mark, self.started = mark, True
                self._stalled.progress(now=now)
        if now >= self.deadline:
            self.why = "timeout"
        elif not self.started and now >= self.startup_deadline:
            self.why = "startup"
        elif self.stall and self.events is not None and self._stalled.remaining(now) <= 0:
            self.why = "stall"
        return self.why is not None


def _wait(proc: subprocess.Popen[bytes], watch: AttemptWatch, grace: float,
          interrupt: _Interrupt) -> int | None:
    """Wait for the launcher; ``None`` when ``watch`` expired (the group is then terminated)."""
    while True:
        limit = watch.deadline
        if interrupt.signum is not None:
            limit = min(limit, interrupt.at + grace)
        try:
            return proc.wait(timeout=max(0.0, min(limit - time.monotonic(), _POLL_S)))
        except subprocess.TimeoutExpired:
            now = time.monotonic()
            if interrupt.signum is not None and now >= interrupt.at + grace:
                signal_group(proc.pid, signal.SIGKILL)
                return proc.wait()
            if watch.expired(now):
                _terminate(proc, grace)
                return None


#: launches of one attempt whose launcher failed before any rank ran, beyond the first
START_RETRIES = 2


def run_attempt(launcher: Launcher, spec: RunSpec, attempt: int, done_file: Path,
                base_env: Mapping[str, str], interrupt: _Interrupt | None = None,
                fatal_dir: Path | None = None, events: Path | None = None,
                n: int | None = None) -> AttemptResult:
    """Launch one attempt on ``n`` ranks (default ``spec.n``; fewer after ``--shrink``),
    wait for it under its :class:`AttemptWatch`, and judge it.

    ``fatal_dir`` (made empty before, read and removed after) is the attempt's
    ``FTKIT_FATAL_DIR``; ``events`` is the job's event log, whose growth is the attempt's
    progress (without it, ``spec.stall_timeout`` is not watched).
    """
    interrupt = interrupt or _Interrupt()
    argv = launcher.command(spec.n if n is None else n, spec.cmd)
    marker.prepare(done_file)
    if fatal_dir is not None and not _empty_dir(fatal_dir):
        fatal_dir = None
    env = attempt_env(launcher.environ(base_env), attempt, done_file, spec.ranks_per_node,
                      interrupt.stop_file, fatal_dir, spec.start(attempt))
    log.info("attempt %d: %s", attempt, " ".join(argv))
    start = time.monotonic()
    try:
        # the preexec function calls prctl and getppid only: no lock another thread holds
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                                stderr=subprocess.PIPE,
                                preexec_fn=die_with(os.getpid()))  # noqa: PLW1509
    except OSError as exc:
        raise LaunchError(f"cannot start {argv[0]}: {exc}") from exc
    assert proc.stderr is not None
    tee = StderrTee(proc.stderr, condense=not log.isEnabledFor(logging.DEBUG))
    tee.start()
    watch = AttemptWatch(start, spec.attempt_timeout, spec.stall_timeout, events,
                         spec.startup_timeout if spec.in_job else 0.0)
    try:
        interrupt.attach(proc.pid)
        rc = _wait(proc, watch, spec.kill_grace, interrupt)
    finally:
        interrupt.attach(None)
        signal_group(proc.pid, signal.SIGKILL)     # ranks the launcher left behind
    seconds = time.monotonic() - start
    marker.cleanup(done_file)
    fatal, records = None, []
    if fatal_dir is not None:
        records = read_records(fatal_dir)          # the directory is read once
        fatal = first_recurring(records)
        shutil.rmtree(fatal_dir, ignore_errors=True)
    failed = explain(tee.found(wait=_TEE_WAIT_S), records)
    fatal = fatal or load_failure(tee.scan.load_error, watch.progressed(), failed)
    if watch.why == "stall":
        log.warning("attempt %d: %s did not change for %g s: the job is taken as hung",
                    attempt, events, spec.stall_timeout)
    released = bool(marker.read_marker(done_file).get("in_job", {}).get("released"))
    result = judge(attempt, rc, done_file.exists(), seconds, spec.attempt_timeout,
                   interrupt.signum, fatal, failed=failed,
                   stalled=spec.stall_timeout if watch.why == "stall" else None,
                   startup=spec.startup_timeout if watch.why == "startup" else None,
                   released=released, lost=lost_daemons_reason(tee.scan.lost_nodes))
    not_started = tee.scan.start_error if not result.ok and not watch.progressed() else None
    return dataclasses.replace(result, resumed=None if events is None
                               else restored_step(events, attempt), not_started=not_started)


def _empty_dir(path: Path) -> bool:
    """Make ``path`` an empty directory (a record of an earlier run is not this attempt's).
    False, with a warning, when the file system refuses (e.g. a full PFS): the attempt then
    runs without ``FTKIT_FATAL_DIR`` and a recurring error is retried like any other."""
    shutil.rmtree(path, ignore_errors=True)
    try:
        path.mkdir(parents=True)
    except OSError as exc:
        log.warning("cannot create %s %s (%s): errors that would recur cannot be recorded "
                    "in this attempt and are retried", FATAL_DIR_ENV, path, exc)
        return False
    return True


def _event(cfg: Config, event: str, **fields: Any) -> None:
    """Append to the job's event log; a log that cannot be written is only a warning."""
    try:
        append_event(cfg.events_path, event, **fields)
    except OSError as exc:
        log.warning("cannot append %r to %s: %s", event, cfg.events_path, exc)


def run_job(spec: RunSpec, cfg: Config, launcher: Launcher,
            base_env: Mapping[str, str] | None = None, out: TextIO | None = None) -> int:
    """Run attempts 0..``spec.max_restarts`` until one succeeds; return the exit status.
    Holds the job's PFS lock (:mod:`ftkit.jobdir.lock`) throughout: JobLockedError, before
    anything runs, when another instance of the job holds it, or when ranks of a killed
    ``ftkit run`` still hold its node-local locks (:mod:`ftkit.launch.orphans`). The
    launcher of every attempt gets SIGTERM when this process dies."""
    base_env = dict(os.environ if base_env is None else base_env)
    base_env[LAUNCH_ID_ENV] = new_run_id(cfg.job)      # one per ftkit run, all its attempts
    base_env.pop(TIDY_ENV, None)
    if spec.tidy:
        base_env[TIDY_ENV] = "1"
    lock = JobLock(cfg.job_pfs_dir / paths.LOCK, cfg.job)
    me = holder_record("ftkit run", base_env)
    try:
        cfg.job_pfs_dir.mkdir(parents=True, exist_ok=True)
        lock.acquire(me, what="the job's PFS directory")
    except OSError as exc:          # a failing PFS: the node-local locks still guard the job
        log.warning("cannot lock %s (%s): a second instance of job %s is refused only by "
                    "the node-local locks", lock.path, exc, cfg.job)
    try:
        wait_for_orphans(cfg.job, this_host_job_dir(cfg), me)
        return _run_attempts(spec, cfg, launcher, base_env, out)
    finally:
        lock.release()


def _run_attempts(spec: RunSpec, cfg: Config, launcher: Launcher,
                  base_env: dict[str, str], out: TextIO | None) -> int:
    """The body of :func:`run_job`, under the job lock."""
    out = sys.stdout if out is None else out
    if spec.spares and not launcher.recovers and not spec.in_job:
        log.warning("--spares %d has no effect outside a Slurm allocation", spec.spares)
    if spec.shrink and not launcher.recovers:
        log.warning("--shrink has no effect outside a Slurm allocation: mpiexec's hosts are "
                    "not ftkit's to exclude, so every relaunch has all %d ranks", spec.n)
    stop_file = stop_file_path(cfg)
    stop_file.unlink(missing_ok=True)           # a request of an earlier run is not ours
    interrupt = _Interrupt(stop_file)
    result: AttemptResult | None = None
    n = spec.n                                  # fewer after a --shrink
    with _forwarding(interrupt):
        for attempt in range(spec.max_restarts + 1):
            if interrupt.signum is not None:
                break
            if attempt:
                _event(cfg, "relaunch", attempt=attempt)
            _event(cfg, "launch", n=n, cmd=list(spec.cmd), attempt=attempt,
                   launcher=launcher.name, argv=launcher.command(n, spec.cmd),
                   spares=spec.spares, ranks_per_node=spec.ranks_per_node,
                   start=spec.start(attempt), **_placement(launcher))
            result = _launch(spec, cfg, launcher, attempt, base_env, interrupt, n, out)
            done = done_file_path(cfg, attempt)
            _event(cfg, "attempt-end", attempt=attempt, rc=result.rc, ok=result.ok,
                   seconds=result.seconds, reason=result.reason, status=result.status,
                   failed={str(r): how for r, how in result.failed.items()},
                   **_fatal_fields(result))
            launcher.follow_in_job()            # Slurm: slots follow in-job node moves
            delay = restart_delay(attempt + 1, spec.restart_delay)
            print(attempt_line(result, spec.max_restarts, delay), file=out, flush=True)
            record = marker.read_marker(done) if result.ok else {}
            if record.get("stopped"):
                return _stopped(cfg, launcher, record, out)
            if result.ok and (line := end_line(cfg, record, tidy=spec.tidy)):
                print(f"ftkit run: {line}", file=out, flush=True)
            if result.ok or result.interrupted is not None or result.fatal is not None:
                break
            if launcher.recovers and attempt < spec.max_restarts:
                rec = _recover(cfg, launcher, attempt, out, n)
                if rec.action == "requeue":
                    return _requeue(cfg, launcher, rec.message, out)
                n = rec.n or n
            if attempt < spec.max_restarts:
                _pause(delay, interrupt)
    return _finish(cfg, result, interrupt)


def _launch(spec: RunSpec, cfg: Config, launcher: Launcher, attempt: int,
            base_env: dict[str, str], interrupt: _Interrupt, n: int, out: TextIO
            ) -> AttemptResult:
    """Run ``attempt``; when the launcher's own runtime failed to come up before any rank
    ran (:attr:`AttemptResult.not_started`: a transient start-up failure of the MPI
    runtime), launch the same attempt again, up to :data:`START_RETRIES` times, without
    spending a restart (a ``launch-retry`` event and a line say so)."""
    for tries in range(START_RETRIES + 1):
        result = run_attempt(launcher, spec, attempt, done_file_path(cfg, attempt), base_env,
                             interrupt, fatal_dir_path(cfg, attempt), cfg.events_path, n)
        if result.not_started is None or tries == START_RETRIES or interrupt.signum is not None:
            return result
        print(f"ftkit run: the launcher failed before any rank ran ({result.not_started}); "
              f"launching attempt {attempt} again", file=out, flush=True)
        _event(cfg, "launch-retry", attempt=attempt, reason=result.not_started, rc=result.rc)
    return result


def _pause(seconds: float, interrupt: _Interrupt) -> None:
    """Wait ``seconds`` before a relaunch; a signal to ``ftkit run`` ends the wait."""
    until = time.monotonic() + seconds
    while interrupt.signum is None and (left := until - time.monotonic()) > 0:
        time.sleep(min(left, _POLL_S))


def _fatal_fields(result: AttemptResult) -> dict[str, Any]:
    """Event fields of an attempt that is not retried (none for the others)."""
    if result.fatal is None:
        return {}
    return {"kind": result.fatal.get("kind"), "rank": result.fatal.get("rank"),
            "rank_host": result.fatal.get("host"), "retry": False}


def _placement(launcher: Launcher) -> dict[str, Any]:
    return dict(launcher.describe())


def _recover(cfg: Config, launcher: Launcher, attempt: int, out: TextIO, n: int) -> Recovery:
    """Slurm: classify failed nodes and take spares (or shrink: fewer ranks); the launcher's
    ``Recovery`` says what comes next (``requeue`` when neither works). ``n``: the ranks of
    the attempt that failed."""
    rec = launcher.after_failure()
    shrunk = {"n_before": n, "n": rec.n} if rec.n else {}
    _event(cfg, "nodes", attempt=attempt, action=rec.action, failed=rec.failed,
           replaced=rec.replaced, reason=rec.message, **shrunk, **_placement(launcher))
    print(f"ftkit run: {rec.message}", file=out, flush=True)
    return rec


def _requeue(cfg: Config, launcher: Launcher, why: str, out: TextIO) -> int:
    """Ask Slurm to requeue this job; a clear message and EX_TEMPFAIL when it cannot."""
    ok, detail = launcher.requeue()
    _event(cfg, "requeue", ok=ok, reason=why, detail=detail)
    if ok:
        print(f"ftkit run: requeued the job ({why}); it resumes from the newest committed "
              f"step when Slurm restarts it", file=out, flush=True)
        return 0
    print(f"ftkit run: cannot requeue ({detail or 'scontrol requeue failed'}); {why}. "
          f"Committed checkpoints are kept: resubmit the job to resume.", file=out, flush=True)
    _event(cfg, "gave-up", status=REQUEUE_FAILED_STATUS, reason=f"cannot requeue: {detail}")
    return REQUEUE_FAILED_STATUS


def _stopped(cfg: Config, launcher: Any, marker: dict[str, Any], out: TextIO) -> int:
    """The job stopped on request (time limit) after its final checkpoint."""
    step = marker.get("last_committed")
    _event(cfg, "stopped", step=step)
    print(f"ftkit run: stopped on request after committing step {step} on every level",
          file=out, flush=True)
    if hasattr(launcher, "requeue"):
        return _requeue(cfg, launcher, f"time limit near, stopped at step {step}", out)
    return 0


def _finish(cfg: Config, result: AttemptResult | None, interrupt: _Interrupt) -> int:
    """Record ``done``/``gave-up`` and return the exit status of ``ftkit run``."""
    if result is not None and result.ok:
        _event(cfg, "done", attempt=result.attempt, attempts=result.attempt + 1)
        return 0
    if interrupt.signum is not None and (result is None or result.interrupted is None):
        # the signal came between attempts (or before the first): it decides the status
        signum = interrupt.signum
        reason, status = f"interrupted by {signame(signum)}", 128 + signum
        attempts = 0 if result is None else result.attempt + 1
    else:
        assert result is not None
        reason, status, attempts = result.reason, result.status, result.attempt + 1
    extra: dict[str, Any] = {}
    if result is not None and result.fatal is not None:
        extra = {**_fatal_fields(result), "message": result.fatal.get("message")}
    _event(cfg, "gave-up", attempts=attempts, status=status, reason=reason, **extra)
    return status

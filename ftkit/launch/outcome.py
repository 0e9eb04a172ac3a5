"""What one ``ftkit run`` attempt came to: its :class:`AttemptResult`, judged from what was
observed (:func:`judge`), and the one line ``ftkit run`` prints for it (:func:`attempt_line`).

Pure functions; this module imports neither mpi4py nor torch.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ftkit.jobdir.fatal import first_line
from ftkit.launch.failures import signame, summary

TIMEOUT_STATUS = 124
NOT_RETRIED_STATUS = 3              # a rank raised an error that a relaunch would hit again
DEFAULT_RESTART_DELAY = 2.0         # seconds before the first restart; doubled at every next
MAX_RESTART_DELAY = 60.0
NO_MARKER_REASON = "exited 0 but the job did not reach Checkpointer.close() on every rank"


@dataclasses.dataclass(frozen=True)
class AttemptResult:
    """Outcome of one attempt.

    ``rc`` is the launcher's exit code (128+N when killed by signal N, ``None`` when the
    watchdog ended it: a stall or a timeout);
    ``status`` is what ``ftkit run`` exits with if this is the last attempt; ``fatal`` is the
    record of an error that would recur (the attempt is then not retried).
    """

    attempt: int
    rc: int | None
    ok: bool
    seconds: float
    reason: str
    status: int
    interrupted: int | None = None       # signal number received by ftkit run, if any
    fatal: dict[str, Any] | None = None  # see ftkit.jobdir.fatal
    resumed: int | None = None           # the step the attempt restored (events.jsonl)
    failed: dict[int, str] = dataclasses.field(default_factory=dict)   # rank -> how it failed
    not_started: str | None = None       # the launcher's runtime failed before any rank ran


def stall_reason(seconds: float) -> str:
    """Why an attempt without progress for ``seconds`` was ended (pure)."""
    return f"no progress for {seconds:g} s (no checkpoint event)"


def startup_reason(seconds: float) -> str:
    """Why an attempt whose processes did not all start within ``seconds`` was ended
    (pure)."""
    return (f"the job did not start within {seconds:g} s (no event: a process died or hung "
            f"during start-up, before MPI could report it)")


def judge(attempt: int, returncode: int | None, marker: bool, seconds: float, timeout: float,
          interrupted: int | None = None, fatal: Mapping[str, Any] | None = None, *,
          stalled: float | None = None, failed: Mapping[int, str] | None = None,
          released: bool = False, lost: str = "", startup: float | None = None
          ) -> AttemptResult:
    """Turn what was observed into an :class:`AttemptResult` (pure).

    ``returncode`` is Popen's (negative: the launcher itself died of that signal), ``None``
    when the watchdog ended the attempt: after ``stalled`` seconds without progress when that
    is given, ``startup`` seconds without the job's first event when that is, else at the
    ``timeout``. ``fatal`` (a rank's record of an error that would
    recur) makes a failed attempt final, unless ``ftkit run`` was interrupted. ``failed``
    (:func:`ftkit.launch.failures.explain`) names the ranks that took the attempt down.
    ``released``: the marker says the job finished after an in-job recovery and released
    every process (``in_job.released``): success whatever the launcher's status (its
    processes end without MPI_Finalize then: ftkit.injob.resilient). ``lost``: why the
    MPI runtime ended the job itself (:func:`ftkit.launch.failures.lost_daemons_reason`).
    """
    failed = {} if failed is None else dict(failed)
    rc = None if returncode is None else (128 - returncode if returncode < 0 else returncode)
    if returncode is None:
        reason = stall_reason(stalled) if stalled is not None else \
            startup_reason(startup) if startup is not None else f"timeout after {timeout:g} s"
        status, ok = TIMEOUT_STATUS, False
    elif returncode < 0:
        reason, status, ok = f"launcher killed by {signame(-returncode)}", 128 - returncode, False
    elif rc == 0 and marker:
        reason, status, ok = "succeeded", 0, True
    elif marker and released:
        reason, status, ok = (f"succeeded (after in-job recovery; the launcher's exit "
                              f"{returncode} at teardown is not the job's)"), 0, True
    elif rc == 0:
        reason, status, ok = NO_MARKER_REASON, 1, False
    else:
        reason, status, ok = f"exit {returncode}", returncode, False
    if failed and not ok:
        reason += f": {summary(failed)}"
    if lost and not ok:
        reason += f"; {lost}" if failed else f": {lost}"
    if interrupted is not None and not ok:
        reason, status = f"interrupted by {signame(interrupted)}", 128 + interrupted
    elif fatal is not None and not ok:
        reason = f"not retried: {first_line(fatal)} (rank {fatal.get('rank', '?')})"
        status = NOT_RETRIED_STATUS
        return AttemptResult(attempt, rc, ok, round(seconds, 3), reason, status, None,
                             dict(fatal), failed=failed)
    return AttemptResult(attempt, rc, ok, round(seconds, 3), reason, status, interrupted,
                         failed=failed if not ok else {})


def restart_delay(restart: int, first: float) -> float:
    """Seconds to wait before restart ``restart`` (1, 2, ...): ``first``, doubled at every
    further restart, at most :data:`MAX_RESTART_DELAY` (pure). A crash loop does not burn
    its restarts in seconds, and a transient fault (a node rebooting, a file system
    recovering) gets time to clear."""
    if first <= 0 or restart < 1:
        return 0.0
    return float(min(first * 2.0 ** min(restart - 1, 30), MAX_RESTART_DELAY))


def attempt_line(result: AttemptResult, max_restarts: int, delay: float = 0.0) -> str:
    """The one stdout line printed for an attempt (pure); ``delay``: seconds until the
    relaunch it announces."""
    head = f"ftkit run: attempt {result.attempt}: "
    took = f"after {result.seconds:.1f} s"
    if result.resumed:
        took += f" (resumed at step {result.resumed})"
    if result.ok:
        return head + f"succeeded {took}"
    if result.interrupted is not None:
        return head + f"{result.reason} {took}; not relaunching"
    if result.fatal is not None:
        return head + f"failed: {result.reason} {took}"
    what = f"failed ({result.reason})" + ("" if result.rc is None else f" {took}")
    if result.attempt < max_restarts:
        restart = result.attempt + 1
        when = f" in {delay:g} s" if delay > 0 else ""
        return head + f"{what}; relaunching{when} (restart {restart} of {max_restarts})"
    return head + f"{what}; no restarts left"

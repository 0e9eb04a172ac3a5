"""A job does not outlive its ``ftkit run``.

``ftkit run`` starts the launcher (``mpiexec``) in a session of its own, so that it can signal
the whole attempt; that also means the launcher gets no hang-up when ``ftkit run`` dies. An
``ftkit run`` that is SIGKILLed (an OOM killer, a cancelled step, a closed terminal) would leave
the launcher and its ranks training and committing, holding the job's node-local locks, with
nobody watching. Two guards:

* :func:`ftkit.jobdir.deathsig.die_with` — the launcher is started with a *parent-death signal* (Linux
  ``PR_SET_PDEATHSIG``): when ``ftkit run`` dies, the kernel sends the launcher SIGTERM, and
  ``mpiexec`` ends its ranks as it does on any SIGTERM.
* :func:`wait_for_orphans` — before its first attempt, ``ftkit run`` looks at the job's
  node-local lock files *this host* sees: a lock still held (ranks of an ``ftkit run`` that
  died, still ending) is waited for a short grace, then refused at once with the holder named,
  instead of launching a whole attempt that its node leaders would refuse.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftkit.config import Config
from ftkit.errors import JobLockedError
from ftkit.jobdir.lock import LOCK_FILE, describe, held_by, may_take_over

log = logging.getLogger(__name__)

#: seconds ``ftkit run`` waits for the ranks of a dead predecessor to end
ORPHAN_GRACE = 30.0
_POLL = 0.2


def this_host_job_dir(cfg: Config) -> Path:
    """The job's node-local directory as this host sees it: under Slurm one tree per Slurm
    node name (``$FTKIT_LOCAL_DIR/<node>/<job>``), else ``$FTKIT_LOCAL_DIR/<job>``."""
    host = os.environ.get("SLURMD_NODENAME")
    return Path(cfg.local_dir) / host / cfg.job if host else cfg.job_local_dir


def node_locks(job_local: Path) -> list[Path]:
    """The node-local lock files of a job that this host sees (``node-<id>/LOCK``)."""
    try:
        return sorted(p / LOCK_FILE for p in job_local.iterdir()
                      if p.name.startswith("node-") and (p / LOCK_FILE).is_file())
    except OSError:
        return []


def held_locks(job_local: Path, me: Mapping[str, Any] | None = None
               ) -> dict[Path, dict[str, Any]]:
    """``{lock file: holder}`` of the job's node-local locks held now (this host's view),
    but those a node leader of ``me`` (a :func:`~ftkit.jobdir.lock.holder_record`) may take over
    (:func:`~ftkit.jobdir.lock.may_take_over`: a requeued Slurm job's predecessor, a holder
    that has ended)."""
    held = {}
    for path in node_locks(job_local):
        holder = held_by(path)
        if holder is not None and (me is None or may_take_over(holder, me) is None):
            held[path] = holder
    return held


def wait_for_orphans(job: str, job_local: Path, me: Mapping[str, Any],
                     grace: float = ORPHAN_GRACE) -> None:
    """``ftkit run`` (described by ``me``), holding the job's PFS lock, before its first
    attempt: wait up to ``grace`` seconds for the job's node-local locks (this host's view)
    to be released; JobLockedError naming the holders when they are not. Local."""
    until = time.monotonic() + grace
    held = held_locks(job_local, me)
    if held:
        log.warning("job %s: ranks of an earlier run still hold %s; waiting up to %g s for "
                    "them to end", job, ", ".join(str(p) for p in held), grace)
    while held and time.monotonic() < until:
        time.sleep(_POLL)
        held = held_locks(job_local, me)
    if held:
        who = "; ".join(f"{describe(h)} holds {p}" for p, h in held.items())
        raise JobLockedError(
            f"job {job}: no ftkit run holds it, but its ranks still run on this host ({who}): "
            f"an ftkit run that was killed left them. End them (kill the pids named) or wait "
            f"for them, then launch again to resume the job")

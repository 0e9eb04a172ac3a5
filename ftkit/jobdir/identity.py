"""The identity of a run: one id made when a job first starts, kept across relaunches and
requeues, recorded in every shard header and COMMITTED record.

A job name (``FTKIT_JOB``) can be reused by accident (another working directory, a second
``ftkit run`` with the same name): the run id tells the checkpoints of one run from those of
another, so restore never resumes someone else's training. It lives in the job's PFS
directory (``$FTKIT_PFS_DIR/<job>/RUN``, a small JSON record), which every relaunch of the
same job sees; the node-local levels only record it.
"""
from __future__ import annotations

import json
import logging
import secrets
import time
from pathlib import Path

from ftkit.fs import write_record
from ftkit.jobdir import paths

RUN_FILE = paths.RUN
LAUNCH_ID_ENV = "FTKIT_LAUNCH_ID"
log = logging.getLogger(__name__)


def new_run_id(job: str) -> str:
    """A new run id: the job name, the time and 32 random bits."""
    return f"{job}-{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(4)}"


def run_id(job_dir: Path, job: str, *, fresh: bool = False, candidate: str | None = None
           ) -> str:
    """The run id of the job whose PFS directory is ``job_dir``: read from ``RUN``, or made
    (``candidate`` when given, see below) and durably written when there is none or
    ``fresh`` asks for a new run. Rank 0 only; raises OSError when an existing record cannot
    be read and ValueError on a damaged record.

    ``candidate`` is ``$FTKIT_LAUNCH_ID``, which ``ftkit run`` makes once and passes to each
    of its attempts. When the record cannot be written (a full or failing PFS), the new id is
    used unrecorded with a warning: the attempts of one ``ftkit run`` still agree on it (so
    its relaunches resume the node-local steps), and the next attempt that finds the PFS
    writable records it."""
    path = job_dir / RUN_FILE
    if not fresh and path.is_file():
        record = json.loads(path.read_text())
        value = record.get("run") if isinstance(record, dict) else None
        if not isinstance(value, str) or not value:
            raise ValueError(f"{path}: no run id in {record!r}")
        return value
    value = candidate or new_run_id(job)
    try:
        job_dir.mkdir(parents=True, exist_ok=True)
        write_record(path, {"run": value, "job": job, "created": time.time()})
    except OSError as exc:
        log.warning("cannot record the run identity in %s (%s): this run goes on as %s "
                    "unrecorded%s", path, exc, value,
                    "; relaunches by this ftkit run keep it" if candidate else
                    "; a later launch of this job will not resume its node-local steps "
                    "(launch with ftkit run to keep them)")
    return value

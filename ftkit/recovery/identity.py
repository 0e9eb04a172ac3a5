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
import secrets
import time
from pathlib import Path

from ftkit.storage.local import write_record

RUN_FILE = "RUN"


def run_id(job_dir: Path, job: str, *, fresh: bool = False) -> str:
    """The run id of the job whose PFS directory is ``job_dir``: read from ``RUN``, or made
    (and durably written) when there is none or ``fresh`` asks for a new run. Rank 0 only;
    raises OSError when the directory is not usable and ValueError on a damaged record."""
    path = job_dir / RUN_FILE
    if not fresh and path.is_file():
        record = json.loads(path.read_text())
        value = record.get("run") if isinstance(record, dict) else None
        if not isinstance(value, str) or not value:
            raise ValueError(f"{path}: no run id in {record!r}")
        return value
    job_dir.mkdir(parents=True, exist_ok=True)
    value = f"{job}-{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(4)}"
    write_record(path, {"run": value, "job": job, "created": time.time()})
    return value

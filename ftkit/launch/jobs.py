"""Which job an ``ftkit run`` runs: a new one, or one it continues.

A job is a directory ``$FTKIT_PFS_DIR/<job>/`` (and its node-local twins). ``FTKIT_JOB`` (or
Slurm's ``SLURM_JOB_ID``, or ``job`` in ``ftkit.toml``) names the job to continue; without
one, every ``ftkit run`` starts a new job with its own id (printed, and kept by all its
relaunches), so a second run in the same directory never resumes the first by accident.
``ftkit run --resume JOB`` continues JOB; ``--resume`` alone the job whose event log changed
last. A job that ended well under ``ftkit run`` leaves no node-local copies behind when its
newest committed step is on the PFS, unless ``--keep-local`` (the ranks remove them, see
:mod:`ftkit.recovery.claim`; :func:`end_line` says what happened). This module imports
neither mpi4py nor torch.
"""
from __future__ import annotations

import dataclasses
import os
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftkit.config import Config
from ftkit.errors import ConfigError
from ftkit.jobdir import paths

NEWEST = ""                 # --resume without a job: the most recently active job
#: Set to ``1`` by ``ftkit run`` (not ``--keep-local``): a successful end removes node-local copies.
TIDY_ENV = "FTKIT_TIDY_LOCAL"


def tidy_requested(env: Mapping[str, str] | None = None) -> bool:
    """True when ``ftkit run`` asked the ranks to remove node-local copies at a good end."""
    return (os.environ if env is None else env).get(TIDY_ENV, "") == "1"


def new_job_id(now: float | None = None) -> str:
    """``20261202-061500-3f9a``: sortable by start time, unique enough for one directory."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return f"{stamp}-{secrets.token_hex(2)}"


def jobs_in(pfs_dir: Path) -> list[str]:
    """The jobs under ``pfs_dir`` (directories with an event log), most recently active
    last."""
    try:
        entries = list(os.scandir(pfs_dir))
    except OSError:
        return []
    found = []
    for entry in entries:
        try:
            mtime = os.stat(os.path.join(entry.path, paths.EVENTS)).st_mtime
        except OSError:
            continue
        found.append((mtime, entry.name))
    return [name for _, name in sorted(found)]


@dataclasses.dataclass(frozen=True)
class JobChoice:
    """The job an ``ftkit run`` runs: its Config, how to say it, whether it is new."""

    cfg: Config
    line: str
    new: bool = False


def choose_job(cfg: Config, resume: str | None) -> JobChoice:
    """The job this ``ftkit run`` runs (pure but for listing ``cfg.pfs_dir``).

    ``resume``: None (no ``--resume``), :data:`NEWEST` (``--resume`` alone) or a job id.
    Raises ConfigError for a job to continue that is not there, or one that contradicts
    ``FTKIT_JOB``.
    """
    if resume is None:
        if "job" not in cfg.defaulted:
            return JobChoice(cfg, f"job {cfg.job}")
        job = new_job_id()
        return JobChoice(dataclasses.replace(cfg, job=job),
                         f"job {job} (new; to continue it later: ftkit run --resume {job} ...)",
                         new=True)
    known = jobs_in(Path(cfg.pfs_dir))
    if resume == NEWEST:
        if not known:
            raise ConfigError(f"--resume: no job to continue under FTKIT_PFS_DIR={cfg.pfs_dir}")
        resume = known[-1]
    elif resume not in known:
        listed = ", ".join(known[-5:]) or "none"
        raise ConfigError(f"--resume {resume}: no such job under FTKIT_PFS_DIR={cfg.pfs_dir} "
                          f"(jobs there, most recent last: {listed})")
    if "job" not in cfg.defaulted and cfg.job != resume:
        raise ConfigError(f"--resume {resume} contradicts FTKIT_JOB={cfg.job}: give one")
    return JobChoice(dataclasses.replace(cfg, job=resume), f"job {resume} (continuing it)")


def end_line(cfg: Config, record: dict[str, Any], *, tidy: bool) -> str:
    """The line ``ftkit run`` prints after a successful end about the job's node-local
    copies, from the completion marker ``record`` (pure): where the newest step is when it
    is only node-local because its PFS flush failed; with ``tidy`` (the ranks were asked to
    remove the copies, :mod:`ftkit.recovery.claim`) whether they did; a marker without
    details (the PFS had no room even for it) says so. "" when there is nothing to say."""
    if not record:
        return (f"the job's completion record is empty (no room on the PFS under "
                f"{cfg.job_pfs_dir}): its newest committed steps may be only in node-local "
                f"copies under {cfg.local_dir} (ftkit status {cfg.job} shows them; ftkit run "
                f"--resume {cfg.job} ... continues from them)")
    step = record.get("last_committed")
    if not isinstance(step, int) or isinstance(step, bool):
        return ""
    lost = record.get("unflushed")
    if isinstance(lost, dict) and isinstance(lost.get("step"), int):
        newest = lost.get("last_flushed")
        on_pfs = f"step {newest} is the newest on the PFS" if isinstance(newest, int) \
            else "no step of this attempt is on the PFS"
        return (f"step {step} of job {cfg.job} is only in the node-local copies under "
                f"{cfg.local_dir} (the PFS flush of step {lost['step']} failed: "
                f"{lost.get('why', '?')}; {on_pfs}); they are kept: ftkit run --resume "
                f"{cfg.job} ... continues from them on the same nodes")
    if not tidy:
        return ""
    if record.get("local_removed"):
        return (f"removed the node-local copies of job {cfg.job} on every node (step {step} "
                f"is on the PFS; --keep-local keeps them)")
    return (f"node-local copies of job {cfg.job} kept under {cfg.local_dir}: step {step} is "
            f"not on the PFS (ftkit run --resume {cfg.job} ... continues from them; ftkit "
            f"clean {cfg.job} removes them)")

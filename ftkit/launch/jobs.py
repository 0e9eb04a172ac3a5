"""Which job an ``ftkit run`` runs: a new one, or one it continues.

A job is a directory ``$FTKIT_PFS_DIR/<job>/`` (and its node-local twins). ``FTKIT_JOB`` (or
Slurm's ``SLURM_JOB_ID``, or ``job`` in ``ftkit.toml``) names the job to continue; without
one, every ``ftkit run`` starts a new job with its own id (printed, and kept by all its
relaunches), so a second run in the same directory never resumes the first by accident.
``ftkit run --resume JOB`` continues JOB; ``--resume`` alone the job whose event log changed
last. A job that ``ftkit run`` made for itself and that ended well leaves no node-local copies
behind on this host (:func:`tidy_local`) unless ``--keep-local``. This module imports neither
mpi4py nor torch.
"""
from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from ftkit.config import Config
from ftkit.errors import ConfigError

EVENTS = "events.jsonl"
NEWEST = ""                 # --resume without a job: the most recently active job


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
            mtime = os.stat(os.path.join(entry.path, EVENTS)).st_mtime
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


def tidy_local(cfg: Config, last_committed: int | None, events: list[dict[str, Any]]) -> str:
    """After a job ended successfully: remove its node-local copies on this host when its
    newest committed step is durable on the PFS; keep them otherwise. Returns the line that
    says which (never raises: a copy that cannot be removed is only reported)."""
    where = cfg.job_local_dir
    if where.is_symlink() or not where.is_dir():
        return ""
    flushed = {e.get("step") for e in events if e.get("event") == "flush"}
    if last_committed is None:
        return ""
    if last_committed not in flushed:
        return (f"node-local copies kept in {where}: step {last_committed} is not on the PFS "
                f"(ftkit run --resume {cfg.job} ... continues from them; ftkit clean "
                f"{cfg.job} removes them)")
    try:
        shutil.rmtree(where)
    except OSError as exc:
        return f"cannot remove the node-local copies in {where}: {exc}"
    return (f"removed the node-local copies in {where} (step {last_committed} is on the PFS; "
            f"--keep-local keeps them)")

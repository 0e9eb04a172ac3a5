"""What ftkit keeps in a job's directories, spelled in one place (docs/formats.md).

``$FTKIT_PFS_DIR/<job>/`` holds the job's event log, its run identity, its lock, one
completion marker and one fatal-record directory per attempt, the stop request of ``ftkit
run`` and the Slurm slot map, beside the PFS steps. ``$FTKIT_LOCAL_DIR/<job>/node-<k>/``
holds a node's lock, its step directories and slots. The regular expressions say what
``ftkit clean`` may remove. Pure; imports nothing of ftkit.
"""
from __future__ import annotations

import os
from pathlib import Path

EVENTS = "events.jsonl"
RUN = "RUN"
LOCK = "LOCK"
SLURM_SLOTS = "slurm-slots.json"
STOP = ".stop-request"


def done_file(job_dir: Path, attempt: int) -> Path:
    """Absolute path of attempt ``attempt``'s completion marker."""
    return Path(os.path.abspath(job_dir / f".done-attempt-{attempt}"))


def stop_file(job_dir: Path) -> Path:
    """Where ``ftkit run`` asks the running attempt to stop (``$FTKIT_STOP_FILE``)."""
    return Path(os.path.abspath(job_dir / STOP))


def fatal_dir(job_dir: Path, attempt: int) -> Path:
    """Absolute path of attempt ``attempt``'s ``FTKIT_FATAL_DIR`` (every node sees the PFS)."""
    return Path(os.path.abspath(job_dir / f"attempt-{attempt}.fatal"))


#: ftkit's atomic writes cut short (``.<name>.tmp``, ``.<name>.tmp-<n>``)
TMP = r"\..+\.tmp(-\d+)?"
#: what ftkit puts in ``$FTKIT_PFS_DIR/<job>``: directories, files
PFS_DIRS = r"step-\d+|attempt-\d+\.fatal|\.early"
PFS_FILES = (r"events\.jsonl|RUN|LOCK|\.done-attempt-\d+(\.pending)?|\.stop-request"
             rf"|slurm-slots\.(json|tmp)|{TMP}")
#: ``$FTKIT_LOCAL_DIR/<job>`` holds node directories, which hold steps, slots and files
LOCAL_DIRS = r"node-\d+"
NODE_DIRS = r"(parked-)?step-\d+|slots"
NODE_FILES = rf"LOCK|\.probe-rank-\d+|{TMP}"

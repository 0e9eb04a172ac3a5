"""The completion marker of an attempt (``$FTKIT_DONE_FILE``).

``ftkit run`` counts an attempt as successful only when the launcher exits 0 **and** rank 0
wrote the marker after every rank returned from ``Checkpointer.close()``. The marker lives in
the job's PFS directory, so a full parallel file system must not make a finished job look
failed (and be relaunched): before each attempt ``ftkit run`` creates an empty placeholder
``<marker>.pending``; when the record itself cannot be written (ENOSPC, EDQUOT, ...), rank 0
renames the placeholder to the marker's name, which needs no free space. Such a marker is
empty: the attempt completed, without details (a stop request it honoured is then not seen).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from ftkit.storage.local import write_record

log = logging.getLogger(__name__)


def pending_path(done: Path) -> Path:
    """The placeholder ``ftkit run`` creates beside the marker ``done``."""
    return done.with_name(done.name + ".pending")


def prepare(done: Path) -> None:
    """``ftkit run``, before an attempt: remove an old marker, create the empty placeholder.
    A placeholder that cannot be created is only a warning."""
    done.parent.mkdir(parents=True, exist_ok=True)
    done.unlink(missing_ok=True)
    pending = pending_path(done)
    try:
        pending.unlink(missing_ok=True)
        pending.touch(mode=0o600)
    except OSError as exc:
        log.warning("cannot create %s (%s): if the job cannot write its completion marker "
                    "either, a finished attempt counts as failed", pending, exc)


def cleanup(done: Path) -> None:
    """``ftkit run``, after an attempt: remove the placeholder."""
    try:
        pending_path(done).unlink(missing_ok=True)
    except OSError as exc:
        log.warning("cannot remove %s: %s", pending_path(done), exc)


def write_done(done: Path, record: dict[str, Any]) -> None:
    """Rank 0 of the job, at close: write the marker ``done`` (a JSON record); when the
    file system refuses, rename the placeholder instead. Never raises: a job that finished
    must not fail here."""
    try:
        done.parent.mkdir(parents=True, exist_ok=True)
        write_record(done, record)
        return
    except OSError as exc:
        why = exc
    try:
        os.rename(pending_path(done), done)
    except OSError as exc:
        log.error("cannot write the completion marker %s (%s) nor rename its placeholder "
                  "(%s): ftkit run will count this finished attempt as failed", done, why, exc)
        return
    log.warning("cannot write the completion marker %s (%s); marked the attempt complete by "
                "renaming its placeholder (an empty marker)", done, why)


def read_marker(done: Path) -> dict[str, Any]:
    """The marker's record; ``{}`` when it is empty, missing or not a JSON object."""
    try:
        data = json.loads(done.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}

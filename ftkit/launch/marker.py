"""The completion marker of an attempt (``$FTKIT_DONE_FILE``).

``ftkit run`` counts an attempt as successful only when the launcher exits 0 **and** rank 0
wrote the marker after every rank returned from ``Checkpointer.close()``. The marker lives in
the job's PFS directory, so a full parallel file system must not make a finished job look
failed (and be relaunched), nor hide where its newest steps are: before each attempt
``ftkit run`` creates a placeholder ``<marker>.pending`` of :data:`PLACEHOLDER_BYTES` blanks
(the blocks allocated while there is room). When the record itself cannot be written
(ENOSPC, EDQUOT, ...), rank 0 writes it over the placeholder's blanks (the blocks are
already there) and renames the placeholder to the marker's name, which needs no free space.
Only when even that fails (a PFS full before the attempt started, a file system that copies
on write) is the marker empty: the attempt completed, without details, and ``ftkit run``
says so.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from ftkit.fs import write_record

log = logging.getLogger(__name__)
#: bytes of blanks in the placeholder: room for the record when the PFS has none left
PLACEHOLDER_BYTES = 4096


def pending_path(done: Path) -> Path:
    """The placeholder ``ftkit run`` creates beside the marker ``done``."""
    return done.with_name(done.name + ".pending")


def prepare(done: Path) -> None:
    """``ftkit run``, before an attempt: remove an old marker, create the placeholder
    (:data:`PLACEHOLDER_BYTES` blanks; empty when there is no room). A placeholder that
    cannot be created is only a warning."""
    done.parent.mkdir(parents=True, exist_ok=True)
    done.unlink(missing_ok=True)
    pending = pending_path(done)
    try:
        pending.unlink(missing_ok=True)
        fd = os.open(pending, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        log.warning("cannot create %s (%s): if the job cannot write its completion marker "
                    "either, a finished attempt counts as failed", pending, exc)
        return
    try:
        os.write(fd, b" " * PLACEHOLDER_BYTES)
        os.fsync(fd)
    except OSError as exc:
        os.ftruncate(fd, 0)
        log.warning("%s: no room for the completion record's placeholder (%s): if the job "
                    "cannot write its record either, ftkit run will not know its last "
                    "step", pending, exc)
    finally:
        os.close(fd)


def cleanup(done: Path) -> None:
    """``ftkit run``, after an attempt: remove the placeholder."""
    try:
        pending_path(done).unlink(missing_ok=True)
    except OSError as exc:
        log.warning("cannot remove %s: %s", pending_path(done), exc)


def write_done(done: Path, record: dict[str, Any]) -> None:
    """Rank 0 of the job, at close: write the marker ``done`` (a JSON record); when the
    file system refuses, write the record over the placeholder's blanks and rename the
    placeholder instead. Never raises: a job that finished must not fail here."""
    try:
        done.parent.mkdir(parents=True, exist_ok=True)
        write_record(done, record)
        return
    except OSError as exc:
        why = exc
    pending = pending_path(done)
    if not pending.exists() and done.exists():     # renamed by an earlier write_done
        kept = _over_blanks(done, record, empty_on_failure=False)
        log.warning("cannot rewrite the completion marker %s (%s); %s", done, why,
                    "wrote the record over it in place" if kept else "it stays as it was")
        return
    kept = _over_blanks(pending, record)
    try:
        os.rename(pending, done)
    except OSError as exc:
        log.error("cannot write the completion marker %s (%s) nor rename its placeholder "
                  "(%s): ftkit run will count this finished attempt as failed", done, why, exc)
        return
    log.warning("cannot write the completion marker %s (%s); marked the attempt complete by "
                "renaming its placeholder (%s)", done, why,
                "the record written over its blanks" if kept else "an empty marker")


def _over_blanks(pending: Path, record: dict[str, Any], *, empty_on_failure: bool = True
                 ) -> bool:
    """Write ``record`` over the blanks of the placeholder ``pending`` (no new block: the
    file keeps its size, the JSON its trailing blanks); True when it is there, durably.
    When it does not fit or the write fails, the file is emptied (a half record must not be
    read as one) — unless ``empty_on_failure`` is False (a marker that already holds a
    record is left as it is when the new one does not fit)."""
    data = json.dumps(record).encode()
    try:
        fd = os.open(pending, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        size = os.fstat(fd).st_size
        if size < len(data):
            if empty_on_failure:
                os.ftruncate(fd, 0)      # no room even there: an empty marker, no details
            return False
        data = data.ljust(size)          # blanks over whatever was there: one JSON value
        if os.pwrite(fd, data, 0) != len(data):
            raise OSError(f"short write of {len(data)} bytes")
        os.fsync(fd)
        return True
    except OSError as exc:
        log.warning("cannot write the completion record into %s: %s", pending, exc)
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)          # no half record: an empty marker says "no details"
        return False
    finally:
        os.close(fd)


def read_marker(done: Path) -> dict[str, Any]:
    """The marker's record; ``{}`` when it is empty, missing or not a JSON object."""
    try:
        data = json.loads(done.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}

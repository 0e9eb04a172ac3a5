"""The job's event log: ``$FTKIT_PFS_DIR/<job>/events.jsonl``, one JSON object per line.

Writers: rank 0 of the job (commit/abort, flush/flush-failed, restore events; any rank for
``timeout``) and ``ftkit run`` (launch, attempt and relaunch events); docs/formats.md lists
every event and its fields. Each line is written with a single ``O_APPEND`` write, so
lines from the two writers never interleave. On a full file system a write that fails (or
writes part of the line) is cut back, so the log never holds a torn line that would swallow
the next one; the caller then calls :func:`mark_progress`, which changes the file's
modification time without needing space (``ftkit run``'s stall watchdog sees progress).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def append_event(path: Path, event: str, **fields: Any) -> dict[str, Any]:
    """Append one event line to ``path`` (created with its directory when missing)."""
    record: dict[str, Any] = {"time": round(time.time(), 6), "event": event,
                              "host": socket.gethostname(), **fields}
    line = (json.dumps(record, sort_keys=False, default=str) + "\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            written = os.write(fd, line)
            if written != len(line):
                raise OSError(errno.ENOSPC, f"wrote {written} of {len(line)} bytes")
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)          # no torn line
            raise
    finally:
        os.close(fd)
    return record


def mark_progress(path: Path) -> None:
    """Touch ``path``'s modification time (no space needed) when an event could not be
    appended, so a watchdog that watches the log still sees the job progress. Never raises."""
    with contextlib.suppress(OSError):
        os.utime(path)


def read_events(path: Path) -> Iterator[dict[str, Any]]:
    """Yield the events of ``path`` in order; a torn last line (crash mid-write) is skipped."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return
    for line in text.splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue


def restored_step(path: Path, attempt: int) -> int | None:
    """The step attempt ``attempt`` of the newest ``ftkit run`` restored: its ``restore``
    event after its ``launch`` event (an earlier run of the job had attempts of the same
    number), or None."""
    step = None
    for e in read_events(path):
        if e.get("attempt") != attempt:
            continue
        if e.get("event") == "launch":
            step = None
        elif e.get("event") == "restore" and isinstance(e.get("step"), int):
            step = e["step"]
    return step

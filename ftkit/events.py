"""The job's event log: ``$FTKIT_PFS_DIR/<job>/events.jsonl``, one JSON object per line.

Writers: rank 0 of the job (commit/abort, flush/flush-failed, restore events; any rank for
``timeout``) and ``ftkit run`` (launch, attempt and relaunch events); docs/formats.md lists
every event and its fields. Each line is written with a single ``O_APPEND`` write, so
lines from the two writers never interleave.
"""
from __future__ import annotations

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
        os.write(fd, line)
    finally:
        os.close(fd)
    return record


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

"""Fatal records: how a rank tells ``ftkit run`` that relaunching would not help.

Some errors fail every attempt the same way: a bad configuration, committed checkpoints that
cannot be used, a state whose structure does not match the checkpoint
(:attr:`ftkit.errors.FtkitError.recurs`). Relaunching such a job only burns the restart budget
(and, under Slurm, spare nodes) before failing again. So the rank that raises one writes a
small JSON record, and ``ftkit run`` reads it after a failed attempt and stops::

    $FTKIT_FATAL_DIR/rank-<rank>.json   {"kind": "ConfigError", "message": "...",
                                         "rank": 3, "host": "n1", "time": 1718000000.0}

``ftkit run`` makes a fresh, empty ``FTKIT_FATAL_DIR`` for every attempt (under the job's PFS
directory, which every node sees) and removes it afterwards. Writers: ``Config.load``,
``Topology.create`` and the Checkpointer, on any rank, just before they raise. A record is
written atomically (temporary file, rename); the first record of a rank in an attempt is kept.
Recording never raises: a record that cannot be written is only a warning, and the attempt is
then judged (and relaunched) as before.

This module imports neither mpi4py nor torch.
"""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftkit.errors import FtkitError

log = logging.getLogger(__name__)

FATAL_DIR_ENV = "FTKIT_FATAL_DIR"
MAX_MESSAGE = 2000
#: Where launchers put the global rank of a process, in order of trust.
RANK_ENV = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
_RECORD = re.compile(r"^rank-(\d+)\.json$")


def recurs(exc: BaseException) -> bool:
    """True when ``exc`` is an ftkit error that a relaunch would hit again."""
    return isinstance(exc, FtkitError) and bool(exc.recurs)


def env_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's global rank from the launcher's environment (0 when none says)."""
    env = os.environ if env is None else env
    for key in RANK_ENV:
        raw = env.get(key, "")
        if raw.strip().isdigit():
            return int(raw)
    return 0


def record_fatal(exc: BaseException, rank: int, *, env: Mapping[str, str] | None = None
                 ) -> None:
    """Write ``$FTKIT_FATAL_DIR/rank-<rank>.json`` when ``exc`` would recur (local call).

    Does nothing when ``exc`` is not a recurring :class:`~ftkit.errors.FtkitError`, when
    ``FTKIT_FATAL_DIR`` is unset (in ``env``, default ``os.environ``) or when this rank
    already has a record. Never raises.
    """
    if not recurs(exc):
        return
    env = os.environ if env is None else env
    directory = env.get(FATAL_DIR_ENV)
    if not directory:
        return
    path = Path(directory) / f"rank-{rank}.json"
    try:
        if path.exists():
            return
        message = str(exc)
        if len(message) > MAX_MESSAGE:
            message = message[:MAX_MESSAGE] + " [...]"
        record = {"kind": type(exc).__name__, "message": message, "rank": rank,
                  "host": socket.gethostname(), "time": round(time.time(), 3)}
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except Exception as err:  # noqa: BLE001 - the error being reported matters more
        log.warning("rank %d: cannot write the fatal record %s (%s: %s); ftkit run may "
                    "relaunch a job that will fail the same way", rank, path,
                    type(err).__name__, err)


def read_fatal(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The record of the lowest rank in ``directory``, or None (no directory, no record).

    Unreadable or malformed files are skipped.
    """
    try:
        names = os.listdir(directory)
    except OSError:
        return None
    ranks = sorted(int(m.group(1)) for name in names if (m := _RECORD.match(name)))
    for rank in ranks:
        try:
            record = json.loads((Path(directory) / f"rank-{rank}.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and {"kind", "message"} <= record.keys():
            record.setdefault("rank", rank)
            return record
    return None


def first_line(record: Mapping[str, Any]) -> str:
    """``<kind>: <first line of message>`` of a record (pure)."""
    lines = str(record.get("message", "")).strip().splitlines()
    return f"{record.get('kind', '?')}: {lines[0] if lines else ''}".rstrip(": ")

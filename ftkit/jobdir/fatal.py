"""Fatal records: how a rank tells ``ftkit run`` that relaunching would not help.

Some errors fail every attempt the same way: a bad configuration, committed checkpoints that
cannot be used, a state whose structure does not match the checkpoint
(:attr:`ftkit.errors.FtkitError.recurs`). Relaunching such a job only burns the restart budget
(and, under Slurm, spare nodes) before failing again. So the rank that raises one writes a
small JSON record, and ``ftkit run`` reads it after a failed attempt and stops::

    $FTKIT_FATAL_DIR/rank-<rank>.json   {"kind": "ConfigError", "message": "...",
                                         "rank": 3, "recurs": true, "host": "n1",
                                         "time": 1718000000.123456}

``ftkit run`` makes a fresh, empty ``FTKIT_FATAL_DIR`` for every attempt (under the job's PFS
directory, which every node sees) and removes it afterwards. Writers: ``Config.load``,
``Topology.create`` and the Checkpointer, on any rank, just before they raise. A record is
written atomically (temporary file, rename); the first record of a rank in an attempt is kept.
Recording never raises: a record that cannot be written is only a warning, and the attempt is
then judged (and relaunched) as before.

A rank that takes the job down for any other reason records it the same way
(:func:`record_death`, with ``"recurs": false``): the abort hooks on an uncaught exception, the
Checkpointer when it gives up on a dead or hung peer. ``ftkit run`` names those ranks and
reasons in its attempt line (:mod:`ftkit.launch.failures`) and relaunches as usual.

This module imports neither mpi4py nor torch.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ftkit.errors import FtkitError
from ftkit.fs import write_text_atomic

log = logging.getLogger(__name__)

FATAL_DIR_ENV = "FTKIT_FATAL_DIR"
MAX_MESSAGE = 2000
#: Where launchers put the global rank of a process, in order of trust.
RANK_ENV = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
_RECORD = re.compile(r"^rank-(\d+)\.json$")
ABORTED = "aborted"         # the kind of a record of a rank that gave up on its peers


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
    if recurs(exc):
        _write(rank, type(exc).__name__, str(exc), True, env)


@contextlib.contextmanager
def recorded(rank: int | Callable[[], int], *catch: type[BaseException],
             env: Mapping[str, str] | None = None) -> Iterator[None]:
    """An entry point's guard: an exception of the ``catch`` types (default FtkitError)
    raised inside is recorded with :func:`record_fatal` (when it recurs) for ``rank`` (or
    ``rank()``, asked only then), and propagates. Local."""
    types = catch or (FtkitError,)
    try:
        yield
    except types as exc:
        record_fatal(exc, rank() if callable(rank) else rank, env=env)
        raise


def record_death(rank: int, exc: BaseException | None = None, *, aborted: str | None = None,
                 env: Mapping[str, str] | None = None) -> None:
    """Record why this rank is about to take the job down (local call, never raises).

    ``exc``: the uncaught exception (the abort hooks); ``aborted``: why the rank gave up on
    its peers (a peer dead or hung). ``ftkit run`` names the rank and this reason in its
    attempt line; the record makes the attempt final only when ``exc`` would recur.
    """
    if exc is not None:
        _write(rank, type(exc).__name__, str(exc), recurs(exc), env)
    elif aborted is not None:
        _write(rank, ABORTED, aborted, False, env)


def _write(rank: int, kind: str, message: str, recurring: bool,
           env: Mapping[str, str] | None) -> None:
    env = os.environ if env is None else env
    directory = env.get(FATAL_DIR_ENV)
    if not directory:
        return
    path = Path(directory) / f"rank-{rank}.json"
    try:
        if path.exists():
            return
        if len(message) > MAX_MESSAGE:
            message = message[:MAX_MESSAGE] + " [...]"
        record = {"kind": kind, "message": message, "rank": rank, "recurs": recurring,
                  "host": socket.gethostname(), "time": round(time.time(), 6)}
        write_text_atomic(path, json.dumps(record))
    except Exception as err:  # noqa: BLE001 - the error being reported matters more
        log.warning("rank %d: cannot write the record %s (%s: %s); ftkit run may not say "
                    "why the attempt failed, and may relaunch a job that will fail the same "
                    "way", rank, path, type(err).__name__, err)


def read_records(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every rank's record in ``directory``, oldest first ([] without a directory).

    Unreadable or malformed files are skipped; a record without ``recurs`` (an older
    writer's) is a recurring one.
    """
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    records = []
    for rank in sorted(int(m.group(1)) for name in names if (m := _RECORD.match(name))):
        try:
            record = json.loads((Path(directory) / f"rank-{rank}.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and {"kind", "message"} <= record.keys():
            record.setdefault("rank", rank)
            record.setdefault("recurs", True)
            records.append(record)
    return sorted(records, key=lambda r: (_number(r.get("time")), _number(r.get("rank"))))


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0


def read_fatal(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The recurring record of the lowest rank in ``directory``, or None (no directory, no
    such record)."""
    return first_recurring(read_records(directory))


def first_recurring(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The recurring record of the lowest rank among ``records`` (:func:`read_records`), or
    None (pure)."""
    recurring = [r for r in records if r["recurs"]]
    return min(recurring, key=lambda r: _number(r.get("rank")), default=None)


def first_line(record: Mapping[str, Any]) -> str:
    """``<kind>: <first line of message>`` of a record (pure)."""
    lines = str(record.get("message", "")).strip().splitlines()
    return f"{record.get('kind', '?')}: {lines[0] if lines else ''}".rstrip(": ")

"""Has a peer of this in-job generation failed? The process-wide failure flag.

In-job recovery (:mod:`ftkit.injob`) keeps the processes of a job alive across a rank's
death. Once a failure is known on this rank (ULFM reported it to the watcher thread, or a
collective of the training loop lost a peer), every wait of ftkit must end at once instead
of running into its deadline, and the thread hooks must not abort the MPI world for an
error that is only the failure's echo. This module is that shared knowledge: a flag, the
time it was tripped, the generation (how many in-job recoveries this process went through)
and the objects to tear down before the next generation. It imports nothing heavy (no MPI),
so every ftkit module may ask it.
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time
import weakref
from typing import Any, Protocol

from ftkit.errors import FtkitError


class PeerLost(FtkitError):
    """A rank of this job failed while this rank waited on it; in-job recovery takes over
    (raised on every surviving rank's waits once the failure is known; never recurs)."""


class Abandonable(Protocol):
    def abandon(self) -> None: ...


class _Flag:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.reason = ""
        self.at = 0.0                   # time.time() when tripped here
        self.generation = 0
        self.active = False             # this process runs under ftkit.resilient in-job
        self.owned: weakref.WeakSet[Any] = weakref.WeakSet()
        self.first_step_due = False     # the first save after a recovery reports its time
        self.last_at = 0.0              # when the failure of the previous generation tripped


_FLAG = _Flag()


def activate() -> None:
    """This process runs in-job recovery (called by :func:`ftkit.resilient`). Local."""
    _FLAG.active = True


def active() -> bool:
    """Whether this process runs under in-job recovery (local, pure read)."""
    return _FLAG.active


def trip(reason: str) -> bool:
    """Record that a peer failed (the first reason wins); True if this call tripped it."""
    if _FLAG.event.is_set():
        return False
    _FLAG.reason, _FLAG.at = reason, time.time()
    _FLAG.event.set()
    return True


def tripped() -> bool:
    """Whether a failure of this generation is known on this rank (local)."""
    return _FLAG.event.is_set()


def reason() -> str:
    return _FLAG.reason


def tripped_at() -> float:
    return _FLAG.at


def wait(timeout: float) -> bool:
    """Block up to ``timeout`` seconds for the flag; returns whether it is set."""
    return _FLAG.event.wait(timeout)


#: seconds an error that may be the echo of a peer's failure waits for the watcher to confirm
#: one before it counts as the error it is (ULFM reports a death within ~0.3 s here)
CONFIRM_S = 2.0


def confirm() -> bool:
    """Whether a failure is known, or becomes known within :data:`CONFIRM_S` (blocks)."""
    return _FLAG.event.wait(CONFIRM_S)


def check(what: str, generation: int | None = None) -> None:
    """Raise :class:`PeerLost` when a failure is known, or when the caller belongs to an
    earlier ``generation`` (a thread of an abandoned Checkpointer: its peers are gone).
    Every polling wait of ftkit calls it."""
    if _FLAG.event.is_set():
        raise PeerLost(f"{what}: a peer rank failed ({_FLAG.reason}); in-job recovery")
    if generation is not None and generation != _FLAG.generation:
        raise PeerLost(f"{what}: abandoned (generation {generation}, now "
                       f"{_FLAG.generation}) after a peer failed; in-job recovery")


#: seconds between two looks at the flag while a thread waits for another's future
FUTURE_POLL_S = 0.05


def wait_done(future: cf.Future[Any], timeout: float, what: str,
              generation: int | None = None) -> None:
    """Block until ``future`` is done, up to ``timeout`` seconds
    (``concurrent.futures.TimeoutError`` after). Under in-job recovery it looks at the flag
    every :data:`FUTURE_POLL_S` and raises :class:`PeerLost` (see :func:`check`) once a
    failure is known: a thread waiting for another must not sit out its patience after a
    peer died, whatever the other thread is blocked in. Does not fetch the result."""
    if not _FLAG.active:
        cf.wait([future], timeout=timeout)
    else:
        end = time.monotonic() + timeout
        while not future.done():
            check(what, generation)
            left = end - time.monotonic()
            if left <= 0:
                break
            cf.wait([future], timeout=min(FUTURE_POLL_S, left))
    if not future.done():
        raise cf.TimeoutError(f"{what}: not done within {timeout:g} s")


def generation() -> int:
    """In-job recoveries this process went through (0: the launch's first generation)."""
    return _FLAG.generation


def next_generation() -> None:
    """Clear the flag for the generation that starts after a recovery. Local."""
    _FLAG.generation += 1
    _FLAG.last_at = _FLAG.at
    _FLAG.reason, _FLAG.at = "", 0.0
    _FLAG.first_step_due = True
    _FLAG.event.clear()


def last_failure_at() -> float:
    """``time.time()`` when the failure that started this generation tripped here."""
    return _FLAG.last_at


def take_first_step() -> bool:
    """True once per generation after a recovery: the caller reports the first step."""
    due, _FLAG.first_step_due = _FLAG.first_step_due, False
    return due


def own(obj: Abandonable) -> None:
    """Register ``obj`` (a Checkpointer) to be abandoned before the next generation."""
    if _FLAG.active:
        _FLAG.owned.add(obj)


def disown(obj: Abandonable) -> None:
    _FLAG.owned.discard(obj)


def abandon_all() -> list[str]:
    """Abandon every registered object (local, no communication); returns the errors."""
    errors = []
    for obj in list(_FLAG.owned):
        try:
            obj.abandon()
        except Exception as exc:  # noqa: BLE001 - keep tearing down the rest
            errors.append(f"{type(exc).__name__}: {exc}")
        _FLAG.owned.discard(obj)
    return errors



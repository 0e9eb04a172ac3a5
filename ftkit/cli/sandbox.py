"""Run checkpoint reading in a child process under a no-progress deadline (``ftkit
inspect/verify/export``).

libhdf5 parses whatever file it is given; a damaged byte can make it loop forever or crash
the process (SIGSEGV), and a file given to the CLI on its own, or a step without a
``COMMITTED`` record, has no digest to check first. So the CLI does its HDF5 work in a forked
child (:func:`run`):

* the child reports progress (what it is reading, bytes and datasets done) as JSON lines on a
  pipe (:class:`Reporter`); the parent restarts a deadline on every report and kills the
  child (SIGKILL) when none arrives within ``timeout`` seconds (:class:`Stalled`);
* a child killed by a signal is reported as a crash of the HDF5 library (:class:`Crashed`);
* the result comes back as one JSON line, never pickle; an exception of a class the caller
  lists in ``passthrough`` is raised again in the parent with its message, any other becomes
  :class:`Failed` (its traceback is logged at DEBUG level).

The CLI is single threaded and imports neither mpi4py nor torch at import time, so a plain
``os.fork`` is safe; the child leaves with ``os._exit`` (no atexit handlers, no buffered output
of the parent written twice) and never prints.
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import select
import signal
import traceback
from collections.abc import Callable
from typing import Any

from ftkit.progress import NoProgress

log = logging.getLogger(__name__)

_READ = 1 << 16
_REAP_S = 10.0          # how long to wait for a killed child to exit
ProgressHook = Callable[[int, int], None]     # (bytes, datasets) done since the last report


class SandboxError(Exception):
    """The child delivered no result. ``where``: what it was reading last (or what it was
    asked to read); ``why``: what happened."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"{where}: {why}")
        self.where, self.why = where, why


class Stalled(SandboxError):
    """No progress report within the deadline; the child was killed."""


class Crashed(SandboxError):
    """The child was killed by a signal (a crash of the HDF5 library, or the OOM killer)."""

    def __init__(self, where: str, signum: int) -> None:
        name = _signal_name(signum)
        why = (f"the worker reading it was killed (signal {signum}, {name}; out of memory?)"
               if signum == signal.SIGKILL else
               f"the HDF5 library crashed reading it (signal {signum}, {name})")
        super().__init__(where, why)
        self.signum = signum


class Failed(SandboxError):
    """The child raised an exception the caller did not expect, or exited without a
    result."""


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return "unknown signal"


class Reporter:
    """The child's end of the pipe: progress reports and the outcome, one JSON line each."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def progress(self, where: str | None = None, nbytes: int = 0, datasets: int = 0) -> None:
        """Tell the parent the child is alive: it now reads ``where`` (a file, or
        ``file:/object``), and has read ``nbytes`` more bytes and finished ``datasets``
        more datasets since the last report."""
        msg: dict[str, Any] = {"p": where}
        if nbytes or datasets:
            msg.update(b=nbytes, d=datasets)
        self._send(msg)

    def _send(self, msg: dict[str, Any]) -> None:
        data = (json.dumps(msg, default=_jsonable) + "\n").encode()
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]


def _jsonable(value: Any) -> Any:
    """JSON fallback for values read from files (bytes, numpy scalars): their text."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    item = getattr(value, "item", None)
    if callable(item):
        with contextlib.suppress(Exception):
            return item()
    return repr(value)


def _child(work: Callable[[Reporter], Any], fd: int,
           passthrough: tuple[type[Exception], ...]) -> None:
    """Body of the forked child: run ``work``, send its result or error, ``os._exit``."""
    status = 1
    try:
        faulthandler.disable()      # a crash is reported by the parent, in one line
        rep = Reporter(fd)
        try:
            rep._send({"ok": work(rep)})        # a result JSON cannot encode: an error too
            status = 0
        except passthrough as exc:
            rep._send({"err": [type(exc).__name__, str(exc), ""]})
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, never raised
            rep._send({"err": ["", f"{type(exc).__name__}: {exc}", traceback.format_exc()]})
    finally:
        os._exit(status)


def run(work: Callable[[Reporter], Any], *, timeout: float, what: str,
        passthrough: tuple[type[Exception], ...] = (),
        on_progress: ProgressHook | None = None) -> Any:
    """``work(reporter)`` in a forked child; its JSON-able result. The child must report
    progress at least every ``timeout`` seconds (:class:`Stalled` else). ``what`` names the
    work in errors until the child reports what it reads. Raises :class:`SandboxError`, or
    an exception of a ``passthrough`` class (built from its message) that ``work`` raised."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:                                    # pragma: no cover - in the child
        os.close(rfd)
        _child(work, wfd, passthrough)
    os.close(wfd)
    watch = _Watch(pid, timeout, what, on_progress)
    try:
        msg = watch.wait(rfd)
    finally:
        os.close(rfd)
        watch.finish()
    if "ok" in msg:
        return msg["ok"]
    kind, message, trace = msg["err"]
    for cls in passthrough:
        if kind == cls.__name__:
            raise cls(message)
    if trace:
        log.debug("worker traceback (%s):\n%s", watch.where, trace)
    raise Failed(watch.where, f"unexpected error: {message}")


class _Watch:
    """The parent's side: reads reports, enforces the deadline, reaps the child."""

    def __init__(self, pid: int, timeout: float, what: str,
                 on_progress: ProgressHook | None) -> None:
        self.pid, self.timeout, self.where = pid, timeout, what
        self.on_progress = on_progress
        self.reaped = False
        self.status: int | None = None      # wait status; None: unknown (not reaped)

    def wait(self, fd: int) -> dict[str, Any]:
        """The child's outcome message ({"ok": ...} or {"err": ...}); raises SandboxError
        when it stalls, crashes or exits without one."""
        buf = bytearray()
        outcome: dict[str, Any] | None = None
        clock = NoProgress(self.timeout)
        while True:
            left = clock.remaining()
            if left <= 0:
                self._reap(kill=True)
                raise Stalled(self.where, f"reading it did not progress within "
                                          f"{self.timeout:g} s; stopped (a damaged file can make "
                                          f"the HDF5 library loop; --timeout SECONDS or "
                                          f"FTKIT_TIMEOUT wait longer on a slow file system)")
            if not select.select([fd], [], [], left)[0]:
                continue
            chunk = os.read(fd, _READ)
            if not chunk:
                break
            clock.progress()
            buf += chunk
            while (end := buf.find(b"\n")) >= 0:
                line = bytes(buf[:end])
                del buf[:end + 1]
                outcome = self._handle(line) or outcome
        self._reap(kill=False)
        return self._outcome(outcome)

    def _handle(self, line: bytes) -> dict[str, Any] | None:
        try:
            msg = json.loads(line)
        except ValueError:
            return {"err": ["", f"the worker sent an unreadable message: {line[:200]!r}", ""]}
        if "p" not in msg:
            return msg if isinstance(msg, dict) else None
        if msg["p"] is not None:
            self.where = str(msg["p"])
        if self.on_progress is not None and ("b" in msg or "d" in msg):
            self.on_progress(int(msg.get("b", 0)), int(msg.get("d", 0)))
        return None

    def _outcome(self, outcome: dict[str, Any] | None) -> dict[str, Any]:
        status = self.status
        if status is not None and os.WIFSIGNALED(status):
            raise Crashed(self.where, os.WTERMSIG(status))
        if outcome is None:
            code = os.WEXITSTATUS(status) if status is not None else "unknown"
            raise Failed(self.where, f"the worker exited (status {code}) without a result")
        return outcome

    def _reap(self, *, kill: bool) -> None:
        """Wait (at most ``_REAP_S``; SIGKILL first with ``kill``) for the child to exit."""
        if self.reaped:
            return
        self.reaped = True
        if kill:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        try:
            pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            self.status = os.waitpid(self.pid, 0)[1]
            return
        try:
            select.select([pidfd], [], [], _REAP_S)
        finally:
            os.close(pidfd)
        done, status = os.waitpid(self.pid, os.WNOHANG)
        if done:
            self.status = status
        else:
            log.warning("worker %d did not exit within %.0f s; left behind", self.pid, _REAP_S)

    def finish(self) -> None:
        """Never leave the child running (KeyboardInterrupt, an error in a hook)."""
        self._reap(kill=True)

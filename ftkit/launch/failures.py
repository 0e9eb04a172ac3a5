"""Which ranks took an attempt down, and how: what ``ftkit run`` says when an attempt fails.

Two sources, joined by :func:`explain`:

* **The launcher's report** (its stderr, copied through unchanged by :class:`StderrTee` while
  it is scanned): a rank killed by a signal is known only to the launcher.
  Open MPI (``prterun``/``mpiexec``)::

      prterun noticed that process rank 1 with PID 15921 on node n3 exited on
      signal 9 (Killed).
      MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD ... Errorcode: 5
      prterun detected that one or more processes exited with non-zero status, ...
         Process name: [prterun-n0-16106@1,1]
         Exit code:    3

  Slurm's ``srun``::

      srun: error: n3: task 1: Killed
      srun: error: n3: tasks 4-5: Exited with exit code 1

  Open MPI wraps its messages over lines, so the scanner matches a sliding window of the last
  few lines with whitespace collapsed.
* **The ranks' own records** (:mod:`ftkit.jobdir.fatal`): the exception a rank died of, or
  why it gave up on a dead or hung peer.

The result maps each failed rank to a predicate ("killed by SIGKILL on node n3",
"raised RuntimeError: boom", "called MPI_Abort (errorcode 5)"); :func:`summary` makes the
short phrase of the attempt line. This module imports neither mpi4py nor torch.
"""
from __future__ import annotations

import collections
import logging
import re
import signal
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import IO, Any, TextIO

from ftkit.jobdir.fatal import ABORTED, first_line

log = logging.getLogger(__name__)

WINDOW = 8              # lines of launcher output matched together (Open MPI wraps at ~72)
MAX_LINE = 1 << 16      # a longer line is copied through in pieces
SHOWN = 3               # ranks named in an attempt line; the rest are counted
SHORT = 160             # characters of one rank's reason in an attempt line
MAX_BLOCK = 60          # lines of a framed launcher report held back at most
_RULE = re.compile(r"^-{74}\s*$")      # Open MPI frames its reports with exactly these

_OMPI_SIGNAL = re.compile(r"noticed that process rank (\d+) with PID \d+ on node (\S+) "
                          r"exited on signal (\d+)")
_OMPI_ABORT = re.compile(r"MPI_ABORT was invoked on rank (\d+) in communicator \S+"
                         r"(?: with errorcode (-?\d+)| Proc: \S+ Errorcode: (-?\d+))")
_OMPI_EXIT = re.compile(r"exited with non-zero status, .*? Process name: (\S+) Exit code: (\d+)")
_OMPI_CALLED_ABORT = re.compile(r"has exited due to process rank (\d+) with PID \d+ on node "
                                r"(\S+) calling \"?abort")
_SRUN = re.compile(r"srun: error: (\S+): tasks? ([\d,\-]+): (.+)$")
#: a Python error printed by a rank that the same script hits again at every launch: the
#: script or a module it imports cannot be loaded (a typo, a missing package, a directory
#: named like a package beside the script shadowing it)
_STARTUP_ERROR = re.compile(r"^((?:ModuleNotFoundError|ImportError|SyntaxError|IndentationError)"
                            r": .+|AttributeError: (?:partially initialized )?module '[^']+' "
                            r"has no attribute .+)$")
#: the launcher's own runtime failed to come up: no rank ran, so a new launch is not a restart
_LAUNCHER_START = re.compile(r"(The PMIx server's listener thread failed to start)")
_OMPI_LOST_DAEMON = re.compile(r"lost communication with a remote daemon\. .*?Remote daemon: "
                               r"\S+ on node (\S+)")


def signame(signum: int) -> str:
    """``SIGKILL`` for 9; ``signal 42`` for numbers without a name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _ranks(spec: str) -> list[int]:
    """``0-2,5`` -> [0, 1, 2, 5] (srun's task lists)."""
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (not hi or hi.isdigit()):
            out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def scan(window: str) -> dict[int, str]:
    """Failed ranks reported in ``window`` (launcher output, whitespace collapsed; pure)."""
    found: dict[int, str] = {}
    for m in _OMPI_SIGNAL.finditer(window):
        found[int(m.group(1))] = f"killed by {signame(int(m.group(3)))} on node {m.group(2)}"
    for m in _OMPI_ABORT.finditer(window):
        found[int(m.group(1))] = f"called MPI_Abort (errorcode {m.group(2) or m.group(3)})"
    for m in _OMPI_CALLED_ABORT.finditer(window):
        found.setdefault(int(m.group(1)), f"called MPI_Abort on node {m.group(2)}")
    for m in _OMPI_EXIT.finditer(window):
        numbers = re.findall(r"\d+", m.group(1))   # [prterun-n0-16106@1,1] or [[18037,1],1]
        if numbers:
            found[int(numbers[-1])] = f"exited with status {m.group(2)}"
    srun = _SRUN.search(window)
    if srun:
        how = srun.group(3).strip()
        how = how[0].lower() + how[1:] if how else "failed"
        for rank in _ranks(srun.group(2)):
            found[rank] = f"{how} on node {srun.group(1)}"
    return found


class LauncherScan:
    """Feed launcher output line by line; :attr:`found` holds each rank's first report."""

    def __init__(self) -> None:
        self.found: dict[int, str] = {}
        self.lost_nodes: list[str] = []      # nodes whose MPI runtime daemon was lost
        self.load_error: str | None = None   # the first "ImportError: ..." a rank printed
        self.start_error: str | None = None  # the launcher's runtime did not come up
        self._lines: collections.deque[str] = collections.deque(maxlen=WINDOW)

    def feed(self, line: str) -> None:
        """Take one more line of launcher output (local call)."""
        if self.load_error is None and (m := _STARTUP_ERROR.match(line.strip())):
            self.load_error = m.group(1)[:SHORT * 2]
        if self.start_error is None and (m := _LAUNCHER_START.search(line)):
            self.start_error = m.group(1)
        self._lines.append(" ".join(line.split()))
        if line.startswith("srun: error:"):
            hits = scan(self._lines[-1])          # one line each; never joined with the next
        else:
            window = " ".join(self._lines)
            hits = scan(window)
            for m in _OMPI_LOST_DAEMON.finditer(window):
                if m.group(1) not in self.lost_nodes:
                    self.lost_nodes.append(m.group(1))
        for rank, how in hits.items():
            self.found.setdefault(rank, how)


class StderrTee(threading.Thread):
    """Copy a launcher's stderr to ``sink`` as it comes, scanning it with a
    :class:`LauncherScan`. Ends when every writer of the pipe has closed it.

    With ``condense`` (the default), a launcher's framed report (Open MPI's text between two
    lines of dashes) that names a failed rank is not copied: the attempt line of ``ftkit run``
    says the same in one line. Every other line passes through unchanged, in order.
    """

    def __init__(self, source: IO[bytes], sink: TextIO | None = None, *,
                 condense: bool = True) -> None:
        super().__init__(name="ftkit-stderr", daemon=True)
        self.source = source
        self.sink = sink
        self.condense = condense
        self.scan = LauncherScan()
        self._block: list[str] | None = None

    def run(self) -> None:
        with self.source:
            for raw in iter(lambda: self.source.readline(MAX_LINE), b""):
                text = raw.decode("utf-8", errors="replace")
                self.scan.feed(text)
                if text.endswith("\n") or text.strip():    # not Open MPI's stray last " "
                    self._take(text)
        if self._block:
            self._write(self._block)

    def _take(self, text: str) -> None:
        """Copy ``text`` through, or hold it while a framed report is open."""
        rule = self.condense and _RULE.match(text) is not None
        if self._block is None:
            if rule:
                self._block = [text]
            else:
                self._write([text])
            return
        self._block.append(text)
        if rule or len(self._block) > MAX_BLOCK:
            block, self._block = self._block, None
            if not (rule and scan(" ".join("".join(block).split()))):
                self._write(block)

    def _write(self, lines: list[str]) -> None:
        sink = self.sink if self.sink is not None else sys.stderr
        try:
            sink.write("".join(lines))
            sink.flush()
        except (OSError, ValueError):
            pass                          # ftkit run's own stderr is gone: keep scanning

    def found(self, wait: float) -> dict[int, str]:
        """The ranks found so far, after up to ``wait`` seconds for the pipe to end."""
        self.join(wait)
        return dict(self.scan.found)


def load_failure(error: str | None, progressed: bool, failed: Mapping[int, str]
                 ) -> dict[str, Any] | None:
    """A fatal record (:mod:`ftkit.jobdir.fatal`'s shape) for a failed attempt in which a rank
    printed ``error`` (:attr:`LauncherScan.load_error`) before the job wrote any event
    (``progressed`` False): the script cannot even be loaded, and a relaunch would fail the
    same way. The rank is the first of ``failed`` (the launcher names who aborted). None
    otherwise (pure)."""
    if error is None or progressed:
        return None
    kind, _, message = error.partition(": ")
    return {"rank": next(iter(failed), "?"), "kind": kind, "recurs": True,
            "message": f"{message} (before the job started: the script or a module it "
                       f"imports cannot be loaded)"}


def lost_daemons_reason(nodes: Sequence[str]) -> str:
    """What an attempt line adds when the MPI runtime lost the daemons of ``nodes`` (pure;
    '' when none): Open MPI 5's runtime ends the whole job then, in-job recovery included."""
    if not nodes:
        return ""
    return (f"the MPI runtime lost its daemon on node {', '.join(nodes)} (a failed node) and "
            f"ended the whole job; in-job recovery cannot continue past a lost node")


def explain(found: Mapping[int, str], records: Iterable[Mapping[str, Any]]) -> dict[int, str]:
    """Each failed rank and how, causes first (pure).

    Ranks killed by a signal come first (a signal is never another rank's doing under these
    launchers, which report only the first death), then the ranks' own records oldest first
    (an exception says more than the MPI_Abort it led to), then the rest of the launcher's
    report.
    """
    out: dict[int, str] = {}
    for rank, how in found.items():
        if how.startswith("killed by"):
            out[rank] = how
    for record in records:
        who = record.get("rank")
        if isinstance(who, int) and who not in out:
            out[who] = _record_how(record)
    for rank, how in found.items():
        out.setdefault(rank, how)
    return out


def _record_how(record: Mapping[str, Any]) -> str:
    if record.get("kind") == ABORTED:
        lines = str(record.get("message", "")).strip().splitlines()
        return f"gave up on its peers: {lines[0] if lines else '?'}"
    return f"raised {first_line(record)}"


def _short(how: str) -> str:
    """``how`` on one line (an exception's text may hold newlines: gloo's do), cut to
    :data:`SHORT` characters."""
    how = " ".join(how.split())
    return how if len(how) <= SHORT else how[:SHORT - 5].rstrip() + " [...]"


def summary(failed: Mapping[int, str], limit: int = SHOWN) -> str:
    """``rank 1 killed by SIGKILL on node n3; rank 0 ...`` (pure); '' when none."""
    items: Sequence[tuple[int, str]] = list(failed.items())
    text = "; ".join(f"rank {rank} {_short(how)}" for rank, how in items[:limit])
    if len(items) > limit:
        text += f"; {len(items) - limit} more"
    return text

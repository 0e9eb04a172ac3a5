"""Fault injection driven by ``FTKIT_FAULTS`` (docs/protocol.md).

``FTKIT_FAULTS="kind:key=val:key=val;kind:..."``. Protocol code calls :meth:`Faults.fire`
at the start of every phase, :meth:`Faults.after_write` right after a file is written and
:meth:`Faults.corrupt_buffer` on data received over MPI, before it is verified.
A fault fires once per process, only on the launch attempt named by ``attempt`` (default 0).

Where ``corrupt`` strikes depends on its level: for ``local`` and ``pfs`` it flips a byte of
the rank's file right after it is written (corruption at rest); for ``partner``, ``xor`` and
``rs``, whose data travels over MPI, it flips a byte of what the rank *receives* (a corrupted
transfer): the first non-empty chunk of a partner copy (or of a shard sent back at rebuild),
or the parity this rank receives at the end of an XOR/RS encoding ring. Receivers verify
that data before it is kept, so the step is refused, never committed with a bad copy.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ftkit import levelnames
from ftkit.errors import ConfigError, InjectedFault

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

KINDS = ("kill", "exit", "raise", "hang", "corrupt", "node")
PHASES = ("between", "capture", "write-local", "encode", "vote", "decide", "announce", "commit",
          "flush", "flush-early",
          "restore-discover", "restore-rebuild", "restore-load", "in-job-rebuild")
KEYS = ("rank", "node", "step", "phase", "level", "attempt", "code")
_INT_KEYS = ("rank", "node", "step", "attempt", "code")


@dataclasses.dataclass(frozen=True)
class Fault:
    """One parsed fault; ``None`` fields match anything."""

    kind: str
    rank: int | None = None
    node: int | None = None
    step: int | None = None
    phase: str | None = None
    level: str | None = None
    attempt: int = 0
    code: int = 1

    def matches(self, *, phase: str | None, step: int | None, rank: int, node: int,
                attempt: int, level: str | None = None) -> bool:
        """True when every key given in the spec equals the call site's value."""
        if self.attempt != attempt:
            return False
        if self.kind == "node":
            # `node` names its victim node directly or through a rank living on it
            pass
        elif self.rank is not None and self.rank != rank:
            return False
        if self.kind != "node" and self.node is not None and self.node != node:
            return False
        pairs = ((self.step, step), (self.phase, phase), (self.level, level))
        return all(want is None or want == got for want, got in pairs)


def parse_faults(spec: str) -> tuple[Fault, ...]:
    """Parse an ``FTKIT_FAULTS`` string; raises :class:`ConfigError` naming the bad part."""
    faults = []
    for part in (p.strip() for p in spec.split(";")):
        if not part:
            continue
        kind, *pairs = part.split(":")
        if kind not in KINDS:
            raise ConfigError(f"FTKIT_FAULTS: unknown kind {kind!r} in {part!r}; "
                              f"valid: {', '.join(KINDS)}")
        fields: dict[str, object] = {"kind": kind}
        for pair in pairs:
            key, eq, val = pair.partition("=")
            if key not in KEYS or not eq:
                raise ConfigError(f"FTKIT_FAULTS: bad key {pair!r} in {part!r}; "
                                  f"valid keys: {', '.join(KEYS)} (as key=value)")
            if key in _INT_KEYS:
                try:
                    fields[key] = int(val)
                except ValueError:
                    raise ConfigError(f"FTKIT_FAULTS: {key} must be an integer, got {val!r} "
                                      f"in {part!r}") from None
            else:
                fields[key] = val
        phase, level = fields.get("phase"), fields.get("level")
        if phase is not None and phase not in PHASES:
            raise ConfigError(f"FTKIT_FAULTS: unknown phase {phase!r} in {part!r}; "
                              f"valid: {', '.join(PHASES)}")
        if level is not None and level not in levelnames.names():
            raise ConfigError(f"FTKIT_FAULTS: unknown level {level!r} in {part!r}; "
                              f"valid: {', '.join(levelnames.names())}")
        if kind == "corrupt" and level is None:
            fields["level"] = "local"
        if kind == "node" and fields.get("rank") is None and fields.get("node") is None:
            raise ConfigError(f"FTKIT_FAULTS: 'node' needs rank= or node= in {part!r}")
        faults.append(Fault(**fields))  # type: ignore[arg-type]
    return tuple(faults)


class Faults:
    """Per-process fault injector bound to one rank's identity."""

    def __init__(self, spec: str, *, rank: int, node: int, attempt: int,
                 rank_node: Sequence[int] = (), node_dir: Path | None = None) -> None:
        self.faults = parse_faults(spec) if spec else ()
        self.rank, self.node, self.attempt = rank, node, attempt
        self.rank_node = list(rank_node)     # node of every rank (Topology.rank_node)
        self.node_dir = node_dir
        self._fired: set[int] = set()

    def __bool__(self) -> bool:
        return bool(self.faults)

    def fire(self, phase: str, step: int | None) -> None:
        """Fault hook at the start of ``phase`` (every rank calls it; it is local)."""
        for i, f in self._matching(phase, step):
            self._fired.add(i)
            self._trigger(f, phase, step)

    def _matching(self, phase: str, step: int | None) -> list[tuple[int, Fault]]:
        out = []
        for i, f in enumerate(self.faults):
            if f.kind == "corrupt" or i in self._fired:
                continue
            if f.kind == "node":
                victim = f.node if f.node is not None else self._node_of(f.rank or 0)
                if victim != self.node:
                    continue
            if f.matches(phase=phase, step=step, rank=self.rank, node=self.node,
                         attempt=self.attempt):
                out.append((i, f))
        return out

    def _node_of(self, rank: int) -> int | None:
        return self.rank_node[rank] if 0 <= rank < len(self.rank_node) else None

    def after_write(self, path: Path, *, level: str, step: int, offset: int | None = None
                    ) -> None:
        """Corrupt hook: flip one byte of ``path`` (a file holding only this rank's data: its
        shard, its PFS rank file; or, at ``offset``, a byte of this rank's data in a shared
        file) if a ``corrupt`` fault matches."""
        if self._take_corrupt(level, step):
            flip_byte(path, offset)
            log.warning("injected fault: flipped a byte of %s (rank %d, step %d, level %s)",
                        path, self.rank, step, level)

    def corrupt_buffer(self, buf: np.ndarray, *, level: str, step: int) -> bool:
        """Corrupt hook on received data: flip one byte of ``buf`` (a writable uint8 array,
        a chunk just received over MPI) if a ``corrupt`` fault for this rank, ``level`` and
        ``step`` matches; returns whether it did. Empty buffers are never hit."""
        if len(buf) == 0 or not self._take_corrupt(level, step):
            return False
        pos = len(buf) - 1 - len(buf) // 4          # where flip_byte hits a whole file
        buf[pos] ^= 0xFF
        log.warning("injected fault: flipped byte %d of data received at level %s (rank %d, "
                    "step %d)", pos, level, self.rank, step)
        return True

    def _take_corrupt(self, level: str, step: int) -> bool:
        """Mark the first matching, not yet fired ``corrupt`` fault fired; True if any."""
        for i, f in enumerate(self.faults):
            if f.kind != "corrupt" or i in self._fired:
                continue
            if f.matches(phase=None, step=step, rank=self.rank, node=self.node,
                         attempt=self.attempt, level=level):
                self._fired.add(i)
                return True
        return False

    def _trigger(self, f: Fault, phase: str, step: int | None) -> None:
        where = f"rank {self.rank}, node {self.node}, phase {phase}, step {step}"
        log.warning("injected fault %s at %s", f.kind, where)
        if f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.kind == "exit":
            os._exit(f.code)
        elif f.kind == "raise":
            raise InjectedFault(f"injected fault at {where}")
        elif f.kind == "hang":
            while True:
                time.sleep(3600)
        elif f.kind == "node":
            if self.node_dir is not None:
                shutil.rmtree(self.node_dir, ignore_errors=True)
            os.kill(os.getpid(), signal.SIGKILL)


def flip_byte(path: Path, offset: int | None = None) -> int:
    """Flip all bits of one byte of ``path`` (default: a byte in the data area's middle)."""
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"cannot corrupt empty file {path}")
    pos = size - 1 - (size // 4) if offset is None else offset
    with open(path, "r+b") as fh:
        fh.seek(pos)
        byte = fh.read(1)
        fh.seek(pos)
        fh.write(bytes([byte[0] ^ 0xFF]))
        fh.flush()
        os.fsync(fh.fileno())
    return pos

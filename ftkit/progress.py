"""No-progress deadlines: the one home of "how long may this wait before it is an error".

A wait in ftkit (an MPI transfer, a read of the parallel file system, a sandboxed reader, an
attempt of ``ftkit run``) is allowed ``seconds`` from its last progress, plus the time the
bytes it still has to move need at :data:`MIN_BULK_BANDWIDTH` — so a large state on a slow
link is not mistaken for a dead peer, and a hung one is still found. Local; no threads.
"""
from __future__ import annotations

import time
from collections.abc import Callable

#: The slowest rate (bytes/s) at which a bulk transfer or read may progress before it counts
#: as stuck: moving ``n`` bytes is allowed ``seconds + n / MIN_BULK_BANDWIDTH``. 50 MB/s is
#: far below any link ftkit runs on (TCP ~2 GB/s, shared memory ~4 GB/s, a busy 1 GbE
#: ~100 MB/s), so only a peer (or a file system) that is dead or hung runs into it.
MIN_BULK_BANDWIDTH = 50e6


def bulk_seconds(seconds: float, nbytes: int) -> float:
    """Seconds a move of ``nbytes`` may take: ``seconds + nbytes / MIN_BULK_BANDWIDTH``."""
    return seconds + max(0, nbytes) / MIN_BULK_BANDWIDTH


class NoProgress:
    """Expires ``seconds`` (plus :func:`bulk_seconds` of the bytes announced with the last
    progress) after the last call of :meth:`progress` — or after its creation. ``clock``
    and ``now`` arguments let a caller (or a test) drive time. :meth:`progress` may be
    called from another thread than the one that waits (one atomic assignment)."""

    def __init__(self, seconds: float, *, nbytes: int = 0, now: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds, self._clock = seconds, clock
        self._mark = (clock() if now is None else now, nbytes)   # last progress, bytes

    def progress(self, nbytes: int = 0, now: float | None = None) -> None:
        """Progress was made; ``nbytes`` more are to move before the next."""
        self._mark = (self._clock() if now is None else now, nbytes)

    @property
    def allowed(self) -> float:
        """Seconds allowed from the last progress."""
        return bulk_seconds(self.seconds, self._mark[1])

    def since(self, now: float | None = None) -> float:
        """Seconds since the last progress."""
        return (self._clock() if now is None else now) - self._mark[0]

    def remaining(self, now: float | None = None) -> float:
        """Seconds left (< 0 once expired)."""
        at, nbytes = self._mark
        return bulk_seconds(self.seconds, nbytes) - ((self._clock() if now is None else now) - at)

    def expired(self, now: float | None = None) -> bool:
        """Whether more than the allowed seconds passed since the last progress."""
        return self.remaining(now) < 0

"""In-job recovery: survive a rank's death without relaunching the job (ULFM, spare ranks).

:func:`resilient` is the entry point (:mod:`ftkit.injob.resilient`); :mod:`ftkit.comm.flag` is the
process-wide failure flag every wait of ftkit consults, :mod:`.watch` the thread that sets
it from ULFM, :mod:`.membership` the shrink and the spares' takeover.
"""
from __future__ import annotations

from ftkit.comm.flag import PeerLost
from ftkit.injob.resilient import SPARES_ENV, resilient, spare_ranks

__all__ = ["SPARES_ENV", "PeerLost", "resilient", "spare_ranks"]

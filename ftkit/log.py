"""Logging set-up for ranks: lines tagged with rank and host, level from FTKIT_LOG_LEVEL.

Only the ``ftkit`` logger is configured (never the root logger), and only once.
"""
from __future__ import annotations

import logging
import socket
import sys

_FORMAT = "ftkit[rank {rank}@{host}] %(levelname)s %(name)s: %(message)s"


def setup_rank_logging(rank: int, level: str) -> None:
    """Attach a stderr handler to the ``ftkit`` logger (idempotent; later calls update it)."""
    logger = logging.getLogger("ftkit")
    fmt = logging.Formatter(_FORMAT.format(rank=rank, host=socket.gethostname()))
    for handler in logger.handlers:
        if getattr(handler, "_ftkit", False):
            handler.setFormatter(fmt)
            break
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler._ftkit = True  # type: ignore[attr-defined]
        handler.setFormatter(fmt)
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level)

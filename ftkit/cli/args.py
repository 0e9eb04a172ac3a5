"""What every ``ftkit`` subcommand shares: argument types, the usage-error exit and the
logging set-up (the only place the command line configures logging)."""
from __future__ import annotations

import argparse
import logging
import sys

from ftkit.config import LOG_LEVELS

#: exit status of a usage, configuration or launch-setup error
USAGE_STATUS = 2
_LOG_FORMAT = "ftkit: %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    """Send the ``ftkit`` logger to stderr at ``level`` (idempotent; root logger untouched)."""
    logger = logging.getLogger("ftkit")
    if not any(getattr(h, "_ftkit_cli", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler._ftkit_cli = True  # type: ignore[attr-defined]
        handler.setFormatter(logging.Formatter(_LOG_FORMAT))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level if level in LOG_LEVELS else "WARNING")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):          # False for nan too
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def error(command: str, exc: Exception) -> int:
    print(f"ftkit {command}: error: {exc}", file=sys.stderr, flush=True)
    return USAGE_STATUS

"""ftkit: fault tolerance for hybrid-parallel training.

Public API: :class:`Checkpointer`, :class:`Topology`, :class:`Config`, :class:`RNGState`,
:func:`init_torch_distributed`, :func:`declare_shard`, :func:`resilient` (in-job
recovery) and the error classes. ``Checkpointer`` and ``Topology`` import mpi4py on first use, so
``import ftkit`` works on a login node without MPI.
"""
from __future__ import annotations

from typing import Any

from ftkit._version import __version__
from ftkit.capture.rng import RNGState
from ftkit.capture.shards import declare_shard
from ftkit.config import Config
from ftkit.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    FtkitError,
    JobLockedError,
    LaunchError,
    NoCheckpointError,
    StateMismatchError,
    UnrecoverableError,
    UnsupportedStateError,
)
from ftkit.injob import resilient

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "Config",
    "ConfigError",
    "CorruptCheckpointError",
    "FtkitError",
    "JobLockedError",
    "LaunchError",
    "NoCheckpointError",
    "RNGState",
    "StateMismatchError",
    "Topology",
    "UnrecoverableError",
    "UnsupportedStateError",
    "__version__",
    "declare_shard",
    "init_torch_distributed",
    "resilient",
]


def __getattr__(name: str) -> Any:
    if name == "Topology":
        from ftkit.comm.topology import Topology
        return Topology
    if name == "Checkpointer":
        from ftkit.checkpointer import Checkpointer
        return Checkpointer
    if name == "init_torch_distributed":
        from ftkit.torchdist import init_torch_distributed
        return init_torch_distributed
    raise AttributeError(f"module 'ftkit' has no attribute {name!r}")

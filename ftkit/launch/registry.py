"""Which launchers ``ftkit run --launcher`` knows: name -> builder, and what ``auto`` picks.

``auto`` takes the first registered launcher whose ``detect`` holds for the request (Slurm:
inside an allocation, no ``--mpiexec``), else :data:`DEFAULT`. A new launcher is one module
plus one :func:`register` call.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ftkit.errors import LaunchError
from ftkit.launch.base import Launcher, Request
from ftkit.launch.mpiexec import MpiexecLauncher
from ftkit.launch.slurm import SlurmLauncher

DEFAULT = "mpiexec"


@dataclasses.dataclass(frozen=True)
class Entry:
    build: Callable[[Request], Launcher]
    detect: Callable[[Request], bool] | None = None     # auto picks it when this holds


_ENTRIES: dict[str, Entry] = {}


def register(name: str, build: Callable[[Request], Launcher],
             detect: Callable[[Request], bool] | None = None) -> None:
    """Make ``--launcher name`` build ``build(request)``; ``detect``: ``auto`` picks it
    when this holds. ValueError when ``name`` is taken."""
    if name in _ENTRIES or name == "auto":
        raise ValueError(f"launcher {name!r} is registered already")
    _ENTRIES[name] = Entry(build, detect)


def names() -> tuple[str, ...]:
    """``auto`` and every registered launcher, for ``--launcher``'s choices."""
    return ("auto", *_ENTRIES)


def resolve(choice: str, request: Request) -> Launcher:
    """The launcher ``--launcher choice`` means for ``request``; LaunchError for an unknown
    name or a launcher that cannot run here."""
    if choice == "auto":
        choice = next((name for name, e in _ENTRIES.items()
                       if e.detect is not None and e.detect(request)), DEFAULT)
    entry = _ENTRIES.get(choice)
    if entry is None:
        raise LaunchError(f"unknown launcher {choice!r}; valid: {', '.join(names())}")
    return entry.build(request)


register("mpiexec", MpiexecLauncher.build)
register("srun", SlurmLauncher.build, detect=SlurmLauncher.detect)

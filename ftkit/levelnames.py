"""The names of ftkit's storage levels and their order, shared by the configuration
(``FTKIT_LEVELS``) and the fault injection (``FTKIT_FAULTS``'s ``level=``) without either
importing a level.

A redundancy level registered with :func:`ftkit.storage.registry.register` adds its name here
(between the levels it reads, ``local``, and the one written last, ``pfs``).
"""
from __future__ import annotations

import re

LOCAL = "local"
PFS = "pfs"
#: redundancy levels: they copy or encode the node-local shard onto other nodes, in the order
#: they encode (mutable only through :func:`add_redundancy`)
_REDUNDANCY: list[str] = ["partner", "xor", "rs"]
_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


def names() -> tuple[str, ...]:
    """Every level name, in the order levels are written."""
    return (LOCAL, *_REDUNDANCY, PFS)


def redundancy() -> tuple[str, ...]:
    """The redundancy levels' names, in the order they encode."""
    return tuple(_REDUNDANCY)


def add_redundancy(name: str) -> None:
    """Make ``name`` a redundancy level name, encoded after those before it (idempotent).
    Raises ValueError for a name that is not lower-case letters, digits and ``_``, or that
    is ``local`` / ``pfs``."""
    if not _NAME.fullmatch(name) or name in (LOCAL, PFS):
        raise ValueError(f"level name {name!r}: use 1-32 lower-case letters, digits or _ "
                         f"(not {LOCAL!r} or {PFS!r})")
    if name not in _REDUNDANCY:
        _REDUNDANCY.append(name)

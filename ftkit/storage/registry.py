"""Which redundancy levels exist: level name -> the builder of its rank-side object.

A redundancy level is one module (a :class:`~ftkit.storage.level.Redundancy` with its
:class:`~ftkit.storage.level.Cover`) plus one :func:`register` call here or in the module
that defines it; the configuration (``FTKIT_LEVELS``), fault injection (``level=``), the
two-phase protocol (write, encode, commit, discard), the restore plan and the rebuild then
handle it like the built-in ones. Levels encode in the order they were registered.
"""
from __future__ import annotations

from collections.abc import Callable

from ftkit import levelnames
from ftkit.storage.level import Redundancy
from ftkit.storage.redundancy.erasure import ErasureLevel
from ftkit.storage.redundancy.partner import PartnerLevel
from ftkit.storage.site import Site

#: builds this rank's object of a level; all ranks call it (communicators are split there)
Builder = Callable[[Site], Redundancy]
_BUILDERS: dict[str, Builder] = {}


def register(name: str, build: Builder) -> None:
    """Make ``name`` a redundancy level built by ``build`` (its name joins ``FTKIT_LEVELS``'
    valid names, after the levels registered before it). ValueError for a name that is not
    a valid level name or is registered already."""
    if name in _BUILDERS:
        raise ValueError(f"storage level {name!r} is registered already")
    levelnames.add_redundancy(name)
    _BUILDERS[name] = build


def builder(name: str) -> Builder:
    """The builder of redundancy level ``name``; KeyError naming the registered ones."""
    try:
        return _BUILDERS[name]
    except KeyError:
        raise KeyError(f"no redundancy level {name!r} is registered in this process "
                       f"(registered: {', '.join(_BUILDERS)}); import the module that "
                       f"registers it before ftkit builds its levels") from None


register("partner", PartnerLevel.build)
register("xor", ErasureLevel.builder("xor", "xor_set", 1))
register("rs", ErasureLevel.builder("rs", "rs_set", "rs_parity"))

"""Close torch's connections from any thread, so no rank stays blocked in a collective.

A rank blocked in a gloo collective waits for a peer's bytes on a TCP connection; if that
peer is alive but left the collective (it saw the failure first), nothing ever arrives:
torch's own ``ProcessGroup.shutdown``/``abort`` do not wake the waiting rank, and
destroying the group closes its connections only once the last reference to it is gone.
``shutdown(2)`` of the sockets does: the blocked read returns end-of-file on this rank, and
the peers at the other ends see theirs closed, so a whole generation's collectives end
within milliseconds of the failure.

Which sockets are torch's: :func:`install` wraps the constructor of gloo's process group
(``distributed_c10d.ProcessGroupGloo``, used for the default group and every
``new_group``) and records the sockets that appeared while it ran (its listener and its
connections to every peer; MPI's connections stay untouched: nothing else of the process
opens connections while a group is built). :func:`shut_down` shuts those down (checking each
descriptor still is the socket recorded). Linux only (``/proc/self/fd``); elsewhere nothing
is recorded and recovery relies on torch's timeout.
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_recorded: dict[int, str] = {}          # fd -> its /proc link ("socket:[inode]")
_lock = threading.Lock()
_installed = False


def _sockets() -> dict[int, str]:
    """This process's socket descriptors and their links (empty without /proc)."""
    out = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                link = os.readlink(f"/proc/self/fd/{name}")
                if link.startswith("socket:"):
                    out[int(name)] = link
    return out


def recording(build: Callable[[], Any]) -> Any:
    """Run ``build`` and record the sockets it opened."""
    before = _sockets()
    try:
        return build()
    finally:
        new = {fd: link for fd, link in _sockets().items() if before.get(fd) != link}
        with _lock:
            _recorded.update(new)


def install() -> None:
    """Record the sockets of every gloo process group built from now on (idempotent)."""
    global _installed
    if _installed:
        return
    try:
        from torch.distributed import distributed_c10d as c10d
    except ImportError:
        return
    base = getattr(c10d, "ProcessGroupGloo", None)
    if base is None:
        return

    class RecordedGloo(base):  # type: ignore[misc, valid-type]
        """gloo's process group; its sockets are recorded (:func:`recording`)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            recording(lambda: base.__init__(self, *args, **kwargs))  # type: ignore[misc]

    c10d.ProcessGroupGloo = RecordedGloo  # type: ignore[misc]
    _installed = True


def shut_down() -> int:
    """Shut down (``SHUT_RDWR``) every recorded socket that is still open; returns how
    many. Any thread; never raises. The descriptors stay open: whoever owns them closes."""
    with _lock:
        items = list(_recorded.items())
        _recorded.clear()
    current = _sockets()
    done = 0
    for fd, link in items:
        if current.get(fd) != link:
            continue                     # closed, or the number now names another socket
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) \
                    and sock.type == socket.SOCK_STREAM:
                with contextlib.suppress(OSError):
                    sock.getpeername()           # a listener has none: gloo's loop thread
                    sock.shutdown(socket.SHUT_RDWR)   # dies when its accept() fails
                    done += 1
        finally:
            sock.detach()
    return done

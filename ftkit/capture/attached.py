"""What ftkit saves with an object beside its own state dict, and the check before step 1.

Some objects of a training state need more than their ``state_dict`` to resume bit-exactly.
ftkit stores that part inside the object's state, under the key
:data:`ftkit.capture.flatten.RESERVED`, as a dict of tensors:

* a stateful data loader: ``generator``, its base-seed generator (:mod:`ftkit.capture.loaders`);
* a ``DistributedDataParallel`` (or a module one wraps): ``ddp_buckets``, its gradient-bucket
  layout (:mod:`ftkit.capture.ddp`).

These tensors are rank-local (:func:`ftkit.capture.rng.rank_local_indices`): a reshard gives a
rank its template rank's. :func:`ftkit.capture.apply.load_into` takes the part out
(:func:`load_saved`) before the object's own ``load_state_dict`` sees it.
"""
from __future__ import annotations

import logging
from typing import Any

from ftkit.capture import companions, ddp, loaders

log = logging.getLogger(__name__)


def admit(dc: Any, state: Any) -> None:
    """Before the first step (``restore()``, or the first ``save()`` without one): give the
    state's loaders ftkit's generators, note the DDPs of its modules, and check every leaf;
    when any rank finds one ftkit cannot checkpoint (or resume bit-exactly), raise the same
    UnsupportedStateError on every rank (not retried by ``ftkit run``). Rank 0 warns about
    a scheduler or weight average left out of the state (:mod:`ftkit.capture.companions`).
    All ranks call (``dc``: a DistComm)."""
    from ftkit.errors import UnsupportedStateError
    loaders.adopt(state)
    ddp.find(state)
    failures = dc.agree(loaders.unsupported(state) or ddp.unsupported(state), "prepare", -1)
    if failures:
        first = min(failures)
        raise UnsupportedStateError(f"rank {first}: cannot checkpoint this state: "
                                    f"{failures[first]}")
    if dc.rank == 0:
        for line in companions.left_out(state):
            log.warning("%s", line)


def _merged(*parts: dict[str, Any] | None) -> dict[str, Any] | None:
    out: dict[str, Any] = {}
    for part in parts:
        out.update(part or {})
    return out or None


def extra(obj: Any) -> dict[str, Any] | None:
    """What ftkit saves with ``obj`` (None: nothing). For :func:`flatten`'s ``extra``."""
    return _merged(loaders.extra(obj), ddp.extra(obj))


def extra_layout(obj: Any) -> dict[str, Any] | None:
    """:func:`extra`'s leaves (same paths, dtypes, shapes) without side effects."""
    return _merged(loaders.extra_layout(obj), ddp.extra_layout(obj))


def load_saved(obj: Any, saved: Any) -> None:
    """Restore: put what :func:`extra` saved back into ``obj`` (before its own
    ``load_state_dict``)."""
    loaders.load_saved(obj, saved)
    ddp.load_saved(obj, saved)

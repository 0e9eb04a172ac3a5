"""The keys an exported state dict has: the user's, not ftkit's.

``ftkit export`` writes the tensors of one step under their state paths. Two things in those
paths are ftkit's, not the user's:

* what ftkit saved beside an object's state (:data:`ftkit.capture.flatten.RESERVED`: a
  loader's generator, a DDP's bucket layout) is left out: it only means something to a
  resumed job, and ``load_state_dict`` would refuse it as an unexpected key;
* a ``DistributedDataParallel`` in the state saved its module's tensors as ``module.<name>``
  (DDP's own ``state_dict``). Like torch's ``get_model_state_dict``, the prefix is cut, so
  ``model/module.fc.weight`` is exported as ``model/fc.weight`` (and the optimizer state
  keyed by it alike): the keys of the unwrapped model. ftkit knows a state path was a DDP by
  the bucket layout it saved with it; a step saved before ftkit did has no such mark, and its
  keys keep the prefix (torch's ``consume_prefix_in_state_dict_if_present(sd, "module.")``
  cuts it).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from ftkit.capture.ddp import KEY as DDP_KEY
from ftkit.capture.flatten import RESERVED, reserved

_PREFIX = "module."


class Keyed(Protocol):
    key: str
    path: str


K = TypeVar("K", bound=Keyed)


def user_view(items: Sequence[K]) -> list[K]:
    """``items`` without ftkit's own tensors, DDP's ``module.`` cut from the keys of each
    state path that held a DDP (module doc). Keys are changed in place."""
    wrapped = [item.path.split("/")[0] for item in items
               if item.path.endswith(f"/{RESERVED}/{DDP_KEY}")]
    kept = [item for item in items if not reserved(item.path)]
    for top in wrapped:
        inside = f"{top}/{_PREFIX}"
        if not all(item.key.startswith(inside) for item in kept
                   if item.key.startswith(f"{top}/")):
            continue
        for item in kept:
            item.key = item.key.replace(inside, f"{top}/", 1) if item.key.startswith(inside) \
                else item.key.replace(f"/{inside}", f"/{top}/", 1)
    return kept

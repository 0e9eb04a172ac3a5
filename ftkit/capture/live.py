"""The objects of some classes alive in this process: one scan of the garbage collector's
objects (``restore()`` or the first ``save()`` only). Looking at every object's class trips
the deprecation warnings of torch's module proxies (``torch.distributed.reduce_op``):
silenced here, they are not the user's."""
from __future__ import annotations

import gc
import warnings
from typing import Any


def instances(*classes: type) -> list[Any]:
    """Every live object that is an instance of one of ``classes``. Local."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if isinstance(o, classes)]

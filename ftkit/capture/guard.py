"""Which staged tensors may be copied in the background.

A tensor can be staged while training goes on only if nothing changes it before the copy
has finished. For parameters and optimizer state the only writer is ``optimizer.step()``,
which ftkit guards with a step pre-hook that waits for staging; those tensors are
*deferrable*. Everything else (module buffers changed by the next forward, user tensors) is
copied before ``save`` returns.

Any other in-place change of a deferrable tensor before its staging is done (weight
clipping, model averaging, re-initialisation under ``torch.no_grad()`` right after
``save``) is caught by its version counter in :mod:`ftkit.capture.staging`: the step is
aborted instead of committing a torn snapshot. Changes made through ``p.data`` (which has
its own version counter) or through NumPy views of the memory are not seen; call
``Checkpointer.wait_staged()`` before making them.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

from ftkit.capture.flatten import TensorLeaf


def optimizers_in(state: Any) -> list[Any]:
    """The torch optimizers found in the containers (dicts, lists, tuples) of ``state``."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    return [x for x in _walk(state) if isinstance(x, torch.optim.Optimizer)]


def _walk(x: Any) -> Iterator[Any]:
    yield x
    if isinstance(x, dict):
        for v in x.values():
            yield from _walk(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _walk(v)


def guarded_storage(optimizers: list[Any]) -> set[int]:
    """Data pointers of every parameter and optimizer-state tensor of ``optimizers`` (none
    without any: a state of NumPy arrays never imports torch)."""
    if not optimizers:
        return set()
    torch = sys.modules["torch"]
    ptrs: set[int] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            ptrs.update(p.data_ptr() for p in group["params"])
        for per_param in opt.state.values():
            ptrs.update(v.data_ptr() for v in per_param.values() if isinstance(v, torch.Tensor))
    ptrs.discard(0)
    return ptrs


def deferrable(optimizers: list[Any]) -> Callable[[TensorLeaf], bool]:
    """Whether a leaf may be staged in the background: a parameter or state tensor of one
    of ``optimizers`` (whose step waits for the staging), or a span of one (a view of its
    bytes, as a shard shared by DP replicas writes)."""
    ptrs = guarded_storage(optimizers)

    def pred(leaf: TensorLeaf) -> bool:
        src = leaf.source if leaf.kind == "torch" else None
        return src is not None and (src.data_ptr() in ptrs or (
            src._base is not None and src._base.data_ptr() in ptrs))
    return pred


class OptimizerGuard:
    """Registers ``wait`` as a step pre-hook on each optimizer once; ``remove`` undoes it."""

    def __init__(self, wait: Callable[[], None]) -> None:
        self._wait = wait
        self._handles: dict[int, Any] = {}

    def install(self, optimizers: list[Any]) -> None:
        for opt in optimizers:
            if id(opt) not in self._handles:
                self._handles[id(opt)] = opt.register_step_pre_hook(
                    lambda _opt, _args, _kwargs: self._wait())

    def remove(self) -> None:
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()

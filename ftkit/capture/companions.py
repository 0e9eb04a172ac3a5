"""Training objects tied to the state but left out of it, named once before the first step.

A learning-rate scheduler of an optimizer in the state, or a weight average
(``torch.optim.swa_utils.AveragedModel``: EMA, SWA) of a training whose modules are in the
state, changes with every step. Left out of the state, a resumed run starts it over — the
warmup again, the average from the current weights — and silently trains another model.
:func:`left_out` finds them among the process's live objects (one scan of the garbage
collector's objects, at ``restore()`` or the first ``save()``), each named with its fix.
"""
from __future__ import annotations

import sys
from typing import Any

from ftkit.capture.live import instances
from ftkit.capture.loaders import walk


def left_out(state: Any) -> list[str]:
    """One line per live scheduler of a state optimizer, or weight average of a state with
    modules, that the state does not hold. Local; [] without torch."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    leaves = [(path, value) for path, value in walk(state)]
    held = {id(value) for _, value in leaves}
    optimizers = {id(v): path for path, v in leaves if isinstance(v, torch.optim.Optimizer)}
    modules = any(isinstance(v, torch.nn.Module) for _, v in leaves)
    if not optimizers and not modules:
        return []
    from torch.optim.lr_scheduler import LRScheduler
    from torch.optim.swa_utils import AveragedModel
    out = []
    for obj in instances(LRScheduler, AveragedModel):
        if id(obj) in held:
            continue
        if isinstance(obj, LRScheduler) and id(getattr(obj, "optimizer", None)) in optimizers:
            out.append(f"a {type(obj).__name__} of the optimizer state"
                       f"[{optimizers[id(obj.optimizer)]!r}] is not in the state: a resumed run "
                       f"would start its schedule over; add it (state['scheduler'] = ...)")
        elif modules and isinstance(obj, AveragedModel):
            out.append("an AveragedModel (EMA/SWA) is not in the state: a resumed run would "
                       "average from the current weights; add it (state['ema'] = ...)")
    return out

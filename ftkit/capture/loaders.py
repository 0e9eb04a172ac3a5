"""Data loaders as checkpoint state: what is refused, and the base-seed draw made replayable.

A plain ``torch.utils.data.DataLoader`` has no ``state_dict``: its position in an epoch is lost
with the process, so it cannot resume mid-epoch. :func:`unsupported` finds it (and any other
leaf ftkit cannot checkpoint) so that ``restore()`` refuses the state before the first step,
with what to use instead.

A stateful loader (torchdata's ``StatefulDataLoader``, or any ``DataLoader`` with
``state_dict``/``load_state_dict``) is a leaf like any other object with a state. One thing
breaks bit-exact resume with it: every new iterator (every epoch, and the first ``for`` after a
restore) draws a *base seed* from the loader's ``generator`` — from torch's global generator
when it has none. The uninterrupted run draws at the start of the epoch; a run resumed mid-epoch
draws again after ftkit restored the global generator, so the global stream (dropout, ...)
shifts by one draw.

:func:`adopt`, :func:`extra` and :func:`load_saved` fix that in two parts, applied alike in an uninterrupted and a resumed
run from the first ``restore()`` on:

1. *Ownership.* A loader without a generator gets one of ftkit's (seeded from
   ``torch.initial_seed()`` and the leaf's path), so its draws leave the global generator alone.
   So does a loader whose generator its sampler shares (``StatefulDataLoader(shuffle=True,
   generator=g)``): the sampler keeps ``g`` (torchdata saves and restores it with the
   sampler's position, rewinding it, which would lose the base-seed draw of a resumed
   epoch), the base-seed draws move to ftkit's generator. A generator of the loader's own is
   kept and replayed the same way.
2. *Replay.* The owned generator changes only by base-seed draws (one 64-bit draw per new
   iterator). At each save ftkit records its state *before the draw that made the current
   iterator* (found by replaying draws on a shadow generator); a restored loader then re-draws
   the same base seed when its iterator is re-created. (torchdata re-creates the current
   iterator on resume and, if it had finished, the next one: both draws then match the
   uninterrupted run's.)

The saved part travels inside the loader's state, under the key :data:`RESERVED`, which
:func:`ftkit.capture.apply.load_into` takes out (:func:`load_saved`) before the
loader's own ``load_state_dict`` sees it.
"""
from __future__ import annotations

import hashlib
import logging
import sys
import weakref
from collections.abc import Iterator
from typing import Any

from ftkit.capture.flatten import RESERVED

log = logging.getLogger(__name__)
__all__ = ["RESERVED", "adopt", "extra", "is_loader", "load_saved", "split_by_dp", "unsupported",
           "walk"]
_MAX_REPLAY = 100_000          # draws searched for the current state (one per epoch)


def is_loader(x: Any) -> bool:
    """Whether ``x`` is a ``torch.utils.data.DataLoader`` (never imports torch)."""
    data = sys.modules.get("torch.utils.data")
    return data is not None and isinstance(x, data.DataLoader)


def _stateful(x: Any) -> bool:
    return hasattr(x, "state_dict") and hasattr(x, "load_state_dict")


def walk(state: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, value) of every leaf of a state: dict/list/tuple containers are entered, an
    object with a ``state_dict`` or a DataLoader is a leaf."""
    if isinstance(state, dict):
        for key, value in state.items():
            yield from walk(value, f"{path}/{key}" if path else str(key))
    elif isinstance(state, (list, tuple)) and not _stateful(state):
        for i, value in enumerate(state):
            yield from walk(value, f"{path}/{i}" if path else str(i))
    else:
        yield path, state


def unsupported(state: Any) -> str | None:
    """Why ``state`` cannot be checkpointed as it is (one line naming the first leaf), or None.
    Local, cheap: calls ``state_dict()`` of the objects, copies nothing."""
    from ftkit.capture.flatten import UnsupportedLeaf, flatten
    for path, value in walk(state):
        if is_loader(value):
            if _stateful(value):
                continue          # its state_dict() would start an iterator (and workers)
            return (f"state[{path!r}] is a plain torch.utils.data.DataLoader, whose position in "
                    f"an epoch cannot be saved: use torchdata.stateful_dataloader."
                    f"StatefulDataLoader (pip install torchdata; a drop-in replacement ftkit "
                    f"checkpoints), or keep the loader out of the state and save its position "
                    f"(epoch, batches done) in a dict of your own")
        try:
            flatten({path: value})
        except UnsupportedLeaf as exc:
            return str(exc)
    return None


def split_by_dp(state: Any) -> str | None:
    """Path of the first stateful loader of ``state`` whose sampler splits the data among
    data-parallel ranks (it has ``num_replicas``, as ``DistributedSampler``): its saved
    position counts the samples of one rank's share, which another DP size cuts otherwise.
    None when there is none. Local."""
    for path, value in walk(state):
        if is_loader(value) and _stateful(value) and \
                hasattr(getattr(value, "sampler", None), "num_replicas"):
            return path
    return None


class _Owned:
    """ftkit's generator of one loader and what is known of its draws."""

    def __init__(self, generator: Any) -> None:
        self.generator = generator
        self.before = generator.get_state()    # state before the newest known draw
        self.after = self.before                # the newest known state

    def replay_state(self) -> Any:
        """The state before the draw that made the loader's current iterator (None when
        the generator was used by something else: it then cannot be replayed)."""
        import torch
        now = self.generator.get_state()
        if torch.equal(now, self.after):
            return self.before
        shadow = torch.Generator()
        shadow.set_state(self.after)
        for _ in range(_MAX_REPLAY):
            prev = shadow.get_state()
            torch.empty((), dtype=torch.int64).random_(generator=shadow)
            if torch.equal(shadow.get_state(), now):
                self.before, self.after = prev, now
                return prev
        return None


#: loader -> ftkit's generator of it (module-wide: a loader has one, whichever Checkpointer
#: saves or restores it)
_OWNED: weakref.WeakKeyDictionary[Any, _Owned] = weakref.WeakKeyDictionary()
_warned: list[bool] = [False]


def adopt(state: Any) -> None:
    """Give every stateful DataLoader of ``state`` that has no generator of its own (none,
    or its sampler's) one of ftkit's, seeded from ``torch.initial_seed()`` and its path (the
    same in every run of the job); keep track of every such loader's generator, its own
    included, to replay its draws (module doc). Local; idempotent."""
    for path, value in walk(state):
        if not is_loader(value) or not _stateful(value) or value in _OWNED:
            continue
        generator = getattr(value, "generator", None)
        if generator is None or getattr(value.sampler, "generator", None) is generator:
            import torch
            seed = hashlib.blake2b(f"{torch.initial_seed()}:{path}".encode(), digest_size=8)
            generator = torch.Generator()
            generator.manual_seed(int.from_bytes(seed.digest(), "little") & ((1 << 63) - 1))
            value.generator = generator
        _OWNED[value] = _Owned(generator)     # a generator of the loader's own: kept, replayed


def _owned(obj: Any) -> _Owned | None:
    """ftkit's record of loader ``obj`` when :func:`adopt` saw it and its generator is
    still ftkit's, else None."""
    owned = _OWNED.get(obj) if is_loader(obj) else None
    generator = getattr(obj, "generator", None)
    if owned is None or generator is None or owned.generator is not generator:
        return None
    return owned


def extra_layout(obj: Any) -> dict[str, Any] | None:
    """What :func:`extra` adds for ``obj``, the generator's current state standing in for
    the replayed one: the same leaves, no side effects (a restore matches the live state's
    leaves against a checkpoint's with it)."""
    owned = _owned(obj)
    return None if owned is None else {"generator": owned.generator.get_state()}


def extra(obj: Any) -> dict[str, Any] | None:
    """What ftkit saves with loader ``obj`` (``{"generator": state}``), or None (not a loader
    :func:`adopt` saw). For :func:`ftkit.capture.flatten.flatten`."""
    owned = _owned(obj)
    if owned is None:
        return None
    generator = owned.generator
    state = owned.replay_state()
    if state is None:
        if not _warned[0]:
            log.warning("a DataLoader's generator was used by something other than its "
                        "base-seed draws; its state is saved as it is and a resumed run may "
                        "draw differently")
            _warned[0] = True
        state = generator.get_state()
    return {"generator": state.clone()}


def load_saved(obj: Any, saved: Any) -> None:
    """Restore: put what :func:`extra` saved into ``obj``'s generator, before the loader's
    own ``load_state_dict`` (a loader :func:`adopt` did not see is left as it is)."""
    owned = _OWNED.get(obj) if is_loader(obj) else None
    generator = getattr(obj, "generator", None)
    state = saved.get("generator") if isinstance(saved, dict) else None
    if owned is None or state is None or generator is None or owned.generator is not generator:
        return
    generator.set_state(state)
    owned.before = owned.after = generator.get_state()

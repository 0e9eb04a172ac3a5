"""Data loaders as state (ftkit.capture.loaders): a plain DataLoader is refused before the first
step; a StatefulDataLoader resumed mid-epoch replays its base-seed draw, so torch's global
generator (dropout) and the loader's own draws go on exactly as in the uninterrupted run (with
workers: from the next epoch on, whose workers are seeded from the replayed base seed; the
items drawn from a worker's generator in the rest of the resumed epoch are not).

The two runs are simulated in one process: run A goes through three epochs, saving the state
(ftkit's flatten, as ``save`` captures it) after every batch; run B is built anew, restored from
A's save after batch ``k`` (unflatten + load_into, as ``restore`` does) and continues. Every
batch and a draw from the global generator after every batch must match A's.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ftkit.capture import attached, loaders
from ftkit.capture.apply import load_into
from ftkit.capture.flatten import flatten, unflatten
from ftkit.capture.rng import RNGState
from ftkit.errors import UnsupportedStateError

sdl = pytest.importorskip("torchdata.stateful_dataloader",
                          reason="torchdata (the optional StatefulDataLoader) not installed")

EPOCHS, N, BATCH = 3, 24, 4          # 6 batches per epoch


class FakeDC:
    """The agreement of a 1-rank world."""

    rank = 0

    def agree(self, failure: str | None, _phase: str, _step: int) -> dict[int, str]:
        return {0: failure} if failure else {}


class Noisy(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A random augmentation: drawn from torch's generator of the process that loads the
    item (a worker's is seeded from the loader's base seed)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor]:
        return (torch.tensor([2.0 * i, 2.0 * i + 1]) + torch.rand(2),)


def _make(workers: int, generator: bool, sampler: str) -> dict[str, Any]:
    torch.manual_seed(1234)
    data = Noisy()
    kw: dict[str, Any] = {"batch_size": BATCH, "num_workers": workers}
    if sampler == "distributed":
        kw["sampler"] = torch.utils.data.distributed.DistributedSampler(
            data, num_replicas=1, rank=0, shuffle=True, seed=7)
    else:
        kw["shuffle"] = True
    if generator:
        kw["generator"] = torch.Generator().manual_seed(99)
    loader = sdl.StatefulDataLoader(data, **kw)
    return {"data": loader, "rng": RNGState()}


def _run(state: dict[str, Any], start: int, saves: dict[int, Any] | None) -> list[Any]:
    """Batches from global batch ``start`` to the end; after each: the batch and a draw from
    torch's generator (a dropout mask). ``saves``: step -> (skeleton, tensors) of A."""
    loader, out, step = state["data"], [], start
    while step < EPOCHS * (N // BATCH):
        sampler = loader.sampler
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(step // (N // BATCH))
        for (x,) in loader:
            step += 1
            out.append((step, x.tolist(), torch.rand(3).tolist()))
            if saves is not None:
                tree, leaves = flatten(state, loaders.extra)
                saves[step] = (tree, [leaf.source.clone() if hasattr(leaf.source, "clone")
                                      else leaf.source.copy() for leaf in leaves])
            if step >= EPOCHS * (N // BATCH):
                break
    return out


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("generator", [False, True])
@pytest.mark.parametrize("sampler", ["distributed", "shuffle"])
def test_resume_mid_epoch_is_bit_exact(workers: int, generator: bool, sampler: str) -> None:
    a = _make(workers, generator, sampler)
    attached.admit(FakeDC(), a)
    saves: dict[int, Any] = {}
    ref = _run(a, 0, saves)
    per_epoch = N // BATCH
    for k in (3, 6, 9):               # mid-epoch, at an epoch's end, mid-epoch again
        b = _make(workers, generator, sampler)
        attached.admit(FakeDC(), b)
        tree, tensors = saves[k]
        load_into(b, unflatten(tree, [t.clone() if hasattr(t, "clone") else t.copy()
                                      for t in tensors]), k)
        got = _run(b, k, None)
        assert [g[0] for g in got] == [r[0] for r in ref[k:]]
        assert [g[2] for g in got] == [r[2] for r in ref[k:]], k     # the global generator
        # the batches; with workers, the rest of the resumed epoch draws its augmentations
        # from re-created workers (their generators' positions are not saved: documented),
        # the epochs after it from workers seeded by the replayed base seeds
        first = k if workers == 0 else -(-k // per_epoch) * per_epoch
        assert got[first - k:] == ref[first:], (k, got[first - k][:2], ref[first][:2])
        assert len(ref) - first >= per_epoch


def test_loader_generators_are_ftkits_or_its_own_and_saved() -> None:
    state = _make(0, False, "distributed")
    assert state["data"].generator is None
    loaders.adopt(state)
    gen = state["data"].generator
    assert isinstance(gen, torch.Generator)
    loaders.adopt(state)
    assert state["data"].generator is gen                     # idempotent
    tree, _ = flatten(state, loaders.extra)
    obj = tree["items"][0][1]
    assert obj["t"] == "obj" and obj["v"]["items"][0][0] == loaders.RESERVED
    own = _make(0, True, "distributed")
    users = own["data"].generator
    loaders.adopt(own)
    assert own["data"].generator is users and loaders.extra(own["data"]) is not None
    shared = _make(0, True, "shuffle")            # torchdata's sampler shares the generator
    users = shared["data"].generator
    assert shared["data"].sampler.generator is users
    loaders.adopt(shared)
    assert shared["data"].generator is not users and shared["data"].sampler.generator is users


def test_plain_dataloader_refused_before_the_first_step() -> None:
    data = TensorDataset(torch.zeros(8, 2))
    state = {"model": torch.nn.Linear(2, 2), "data": DataLoader(data, batch_size=2)}
    with pytest.raises(UnsupportedStateError) as err:
        attached.admit(FakeDC(), state)
    msg = str(err.value)
    assert "state['data'] is a plain torch.utils.data.DataLoader" in msg
    assert "StatefulDataLoader" in msg and err.value.recurs


def test_other_unsupported_leaf_refused_before_the_first_step() -> None:
    with pytest.raises(UnsupportedStateError, match=r"cannot checkpoint this state: .*object"):
        attached.admit(FakeDC(), {"w": torch.zeros(2), "odd": object()})


def test_extra_layout_has_the_leaves_of_extra_without_its_side_effects() -> None:
    """A restore flattens the live state with ``extra_layout`` to find where each saved tensor
    goes in place: the same leaves (paths, dtypes, shapes) as a save's ``extra``, and the
    generator is neither replayed nor drawn from."""
    state = _make(0, False, "distributed")
    loaders.adopt(state)
    gen = state["data"].generator
    saved = [(lf.path, lf.dtype, lf.shape) for lf in flatten(state, loaders.extra)[1]]
    before = gen.get_state().clone()
    layout = [(lf.path, lf.dtype, lf.shape) for lf in flatten(state, loaders.extra_layout)[1]]
    assert layout == saved and any(loaders.RESERVED in path for path, _, _ in layout)
    assert torch.equal(gen.get_state(), before)
    assert loaders.extra_layout(object()) is None

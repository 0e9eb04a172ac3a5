"""DistributedDataParallel with its defaults on 4 MPI ranks (gloo): a run resumed from a
checkpoint ends bit-identical to the uninterrupted one, although DDP rebuilt its gradient
buckets after its first iteration (in the order the gradients became ready, which differs
from the parameters' order here) and a fresh DDP starts with its initial layout.

The control (``test_a_fresh_ddp_without_the_saved_layout_drifts``) shows the model is one
where the layout matters: resuming with torch alone differs in the last bits."""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

import ftkit

from .mpi_helpers import RANK, WORLD, topology

torch = pytest.importorskip("torch")
STEPS, SAVED = 6, 3


class Net(torch.nn.Module):
    """Layers defined in the reverse of their use: gradients become ready in an order
    unlike the parameters' (and bias before weight), over ~2.3 MiB (several buckets)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.late = torch.nn.Linear(384, 8)
        self.mid = torch.nn.Linear(384, 384)
        self.wide = torch.nn.Linear(384, 1024)
        self.back = torch.nn.Linear(1024, 384)
        self.early = torch.nn.Linear(16, 384)

    def forward(self, x: Any) -> Any:
        h = torch.tanh(self.early(x))
        h = torch.tanh(self.back(torch.tanh(self.wide(h))))
        return self.late(torch.tanh(self.mid(h)))


def _train(model: Any, opt: Any, first: int, last: int) -> None:
    for step in range(first, last):
        g = torch.Generator().manual_seed(1000 * step + RANK)
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _fresh(**ddp_kw: Any) -> tuple[Any, Any, Any]:
    from torch.nn.parallel import DistributedDataParallel
    net = Net()
    model = DistributedDataParallel(net, **ddp_kw)
    return net, model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _params(net: Any) -> list[Any]:
    return [p.detach().clone() for p in net.parameters()]


def _uninterrupted(save: Callable[[Any, Any, Any], None] | None = None,
                   **ddp_kw: Any) -> list[Any]:
    net, model, opt = _fresh(**ddp_kw)
    _train(model, opt, 0, SAVED)
    assert model._has_rebuilt_buckets
    if save is not None:
        save(net, model, opt)
    _train(model, opt, SAVED, STEPS)
    return _params(net)


@pytest.mark.parametrize("ddp_kw,holds", [({}, "ddp"), ({}, "inner"),
                                          ({"static_graph": True}, "ddp"),
                                          ({"gradient_as_bucket_view": True}, "inner")])
def test_a_resumed_ddp_reduces_like_the_uninterrupted_run(
        ftkit_env: Any, torch_group: None, ddp_kw: dict[str, Any], holds: str) -> None:
    def state_of(net: Any, model: Any, opt: Any) -> dict[str, Any]:
        return {"model": model if holds == "ddp" else net, "optim": opt}

    def save(net: Any, model: Any, opt: Any) -> None:
        with topology() as topo:
            ckpt = ftkit.Checkpointer(topo)
            ckpt.restore(state_of(net, model, opt))
            ckpt.save(SAVED, state_of(net, model, opt))
            ckpt.close()

    want = _uninterrupted(save, **ddp_kw)
    net, model, opt = _fresh(**ddp_kw)
    with topology() as topo:
        ckpt = ftkit.Checkpointer(topo)
        assert ckpt.restore(state_of(net, model, opt)) == SAVED
        _train(model, opt, SAVED, STEPS)
        ckpt.close()
    got = _params(net)
    assert all(torch.equal(a, b) for a, b in zip(want, got)), \
        f"rank {RANK}: the resumed run differs from the uninterrupted one"


def test_a_fresh_ddp_without_the_saved_layout_drifts(torch_group: None) -> None:
    saved: dict[str, Any] = {}

    def keep(net: Any, model: Any, opt: Any) -> None:
        saved.update(net=copy.deepcopy(net.state_dict()), opt=copy.deepcopy(opt.state_dict()))

    want = _uninterrupted(keep)
    net, model, opt = _fresh()
    net.load_state_dict(saved["net"])
    opt.load_state_dict(saved["opt"])
    _train(model, opt, SAVED, STEPS)
    differs = not all(torch.equal(a, b) for a, b in zip(want, _params(net)))
    assert WORLD.allreduce(differs) > 0, "the model does not show DDP's bucket rebuild"


def test_a_ddp_ftkit_cannot_put_buckets_back_is_refused_before_step_one(
        ftkit_env: Any, torch_group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """With DDP internals ftkit needs missing, a rebuilding DDP is refused (the fix named);
    one that never rebuilds is accepted."""
    from torch.nn.parallel import DistributedDataParallel
    _, model, opt = _fresh()
    with monkeypatch.context() as patch, topology() as topo:
        patch.delattr(DistributedDataParallel, "_ddp_init_helper")
        ckpt = ftkit.Checkpointer(topo)
        with pytest.raises(ftkit.UnsupportedStateError,
                           match="state\\['model'\\] is under a DistributedDataParallel.*"
                                 "find_unused_parameters=True"):
            ckpt.restore({"model": model, "optim": opt})
        ckpt.close()
    _, model, opt = _fresh(find_unused_parameters=True)      # never rebuilds: accepted
    with topology() as topo:
        ckpt = ftkit.Checkpointer(topo)
        assert ckpt.restore({"model": model, "optim": opt}) == 0
        ckpt.close()

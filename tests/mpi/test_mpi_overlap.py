"""Overlapped snapshots: ``save`` returns while parameters and optimizer state are still being
staged; ``optimizer.step()`` waits for staging; module buffers are copied before ``save``
returns. 4 ranks / 2 virtual nodes."""
from __future__ import annotations

import threading
from typing import Any

import pytest

from ftkit import Checkpointer, Config
from ftkit.capture.staging import Stager

from .mpi_helpers import RANK, canon, diff, model_and_optimizer, topology, train_step


def gated_staging(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """From now on, background staging waits for the returned event before copying
    anything (also used by test_mpi_torn.py)."""
    gate = threading.Event()
    original = Stager._copy_all

    def gated(self: Stager, *args: Any, **kwargs: Any) -> None:
        assert gate.wait(timeout=60), "the test never opened the staging gate"
        original(self, *args, **kwargs)
    monkeypatch.setattr(Stager, "_copy_all", gated)
    return gate


def test_optimizer_waits_for_staging_and_buffers_are_copied_at_save(ftkit_env, monkeypatch):
    gate = gated_staging(monkeypatch)
    model, opt = model_and_optimizer(seed=RANK)
    state = {"model": model, "optim": opt}
    opt.register_step_pre_hook(lambda *_: gate.set())       # runs before ftkit's hook
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(levels="local:1,partner:1"))
        assert ckpt.restore(state) == 0
        want = canon({"model": model.state_dict(), "optim": opt.state_dict()})
        ckpt.save(1, state)
        staging = ckpt._staging
        assert staging is not None and not staging.done(), "save waited for staging"
        seen: list[bool] = []
        opt.register_step_pre_hook(lambda *_: seen.append(staging.done()))  # after ftkit's
        train_step(model, opt)      # forward changes BatchNorm statistics, step the weights
        assert seen == [True], "optimizer.step() ran before staging finished"
        assert ckpt.blocked_seconds, "blocking time not recorded"
        ckpt.close()
    fresh, fresh_opt = model_and_optimizer(seed=100 + RANK)
    loaded = {"model": fresh, "optim": fresh_opt}
    with topology() as topo:
        again = Checkpointer(topo, Config.load(levels="local:1,partner:1"))
        assert again.restore(loaded) == 1
        again.close()
    got = canon({"model": fresh.state_dict(), "optim": fresh_opt.state_dict()})
    assert not diff(want, got), diff(want, got)


def test_sync_mode_stages_before_save_returns(ftkit_env):
    model, opt = model_and_optimizer(seed=RANK)
    state = {"model": model, "optim": opt}
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(async_=False))
        ckpt.save(1, state)
        assert ckpt._staging is None or ckpt._staging.done()
        ckpt.close()

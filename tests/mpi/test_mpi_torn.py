"""An async snapshot is never torn by an in-place change made outside ``optimizer.step()``.

Rank 1 zeroes a weight (``with torch.no_grad(): w.mul_(0)``) right after an async ``save``
while its background staging is held at a gate: the step must be aborted on every rank
(CheckpointError naming the tensor) and a restore must give the previous committed step
bit for bit. Without the change the same sequence commits and restores the new step.
4 ranks / 2 virtual nodes.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from ftkit import Checkpointer, CheckpointError, Config

from .mpi_helpers import (
    RANK,
    canon,
    catch,
    diff,
    error_summary,
    model_and_optimizer,
    same_on_all_ranks,
    topology,
    train_step,
)
from .test_mpi_overlap import gated_staging

MUTATING_RANK = 1
TENSOR = "model/0.weight"


def _snapshot(state: dict[str, Any]) -> Any:
    return canon({"model": state["model"].state_dict(), "optim": state["optim"].state_dict()})


def _step_one_committed(topo: Any, levels: str, state: dict[str, Any]) -> Checkpointer:
    """An async Checkpointer that restored nothing and committed step 1 of ``state``."""
    ckpt = Checkpointer(topo, Config.load(levels=levels, async_=True))
    assert ckpt.restore(state) == 0
    ckpt.save(1, state)
    ckpt.wait()
    assert ckpt.last_committed == 1
    return ckpt


@pytest.mark.parametrize("change", [True, False], ids=["in-place-change", "untouched"])
def test_in_place_change_during_staging_aborts_the_step(ftkit_env, monkeypatch, change):
    model, opt = model_and_optimizer(seed=RANK)
    state = {"model": model, "optim": opt}
    with topology() as topo:
        ckpt = _step_one_committed(topo, "local:1,partner:1", state)
        want = {1: _snapshot(state)}
        train_step(model, opt)
        want[2] = _snapshot(state)
        gate = gated_staging(monkeypatch)
        ckpt.save(2, state)
        assert ckpt._staging is not None and not ckpt._staging.done()
        if change and RANK == MUTATING_RANK:
            with torch.no_grad():
                model[0].weight.mul_(0)          # outside optimizer.step(), no wait_staged()
        gate.set()
        error = catch(ckpt.wait)
        summary = same_on_all_ranks(error_summary(error), "step-2 outcome")
        ckpt.close()
    if change:
        assert isinstance(error, CheckpointError) and error.step == 2, summary
        assert list(error.failures) == [MUTATING_RANK], summary
        why = error.failures[MUTATING_RANK]
        assert TENSOR in why and "changed in place while its snapshot was being staged" in why
        assert "ckpt.wait_staged()" in why
    else:
        assert error is None, summary

    fresh, fresh_opt = model_and_optimizer(seed=100 + RANK)
    loaded = {"model": fresh, "optim": fresh_opt}
    with topology() as topo:
        again = Checkpointer(topo, Config.load(levels="local:1,partner:1", async_=True))
        step = again.restore(loaded)
        assert step == (1 if change else 2)
        got = _snapshot(loaded)
        assert not diff(want[step], got), diff(want[step], got)
        assert fresh[0].weight.abs().sum() > 0, "restored a zeroed weight"
        train_step(fresh, fresh_opt)
        again.save(3, loaded)                # the next save works normally
        again.wait()
        assert again.last_committed == 3
        again.close()


def test_a_close_that_raises_gives_the_job_back(ftkit_env, monkeypatch):
    """The torn step's CheckpointError raised by ``close()`` itself (no ``wait()`` first):
    close still gives back the job's locks, slots and communicators, so a new Checkpointer of
    the same job in the same process restores the previous step; a second close is a no-op."""
    model, opt = model_and_optimizer(seed=RANK)
    state = {"model": model, "optim": opt}
    with topology() as topo:
        ckpt = _step_one_committed(topo, "local:1", state)
        want = _snapshot(state)
        train_step(model, opt)
        gate = gated_staging(monkeypatch)
        ckpt.save(2, state)
        if RANK == MUTATING_RANK:
            with torch.no_grad():
                model[0].weight.mul_(0)
        gate.set()
        error = catch(ckpt.close)
        same_on_all_ranks(error_summary(error), "close outcome")
        assert isinstance(error, CheckpointError) and error.step == 2, error_summary(error)
        ckpt.close()                                    # closed: nothing more, no raise

    fresh, fresh_opt = model_and_optimizer(seed=100 + RANK)
    loaded = {"model": fresh, "optim": fresh_opt}
    with topology() as topo:
        again = Checkpointer(topo, Config.load(levels="local:1", async_=True))
        assert again.restore(loaded) == 1
        assert not diff(want, _snapshot(loaded))
        again.close()

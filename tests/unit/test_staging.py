"""ftkit.capture.staging: background staging, and a snapshot never torn by an in-place change.

The worker is held at a gate (an Event, never a sleep) between ``Stager.start`` and the copy,
so "changed while staging" is deterministic.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from ftkit.capture import staging as staging_mod
from ftkit.capture.flatten import flatten
from ftkit.capture.staging import Stager, TornSnapshotError
from ftkit.errors import FtkitError

HINT = "call ckpt.wait_staged() before modifying parameters outside optimizer.step()"


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Background staging waits for the returned event before copying anything."""
    event = threading.Event()
    original = Stager._copy_all

    def gated(self: Stager, *args: Any, **kwargs: Any) -> None:
        assert event.wait(timeout=30), "test never opened the gate"
        original(self, *args, **kwargs)
    monkeypatch.setattr(Stager, "_copy_all", gated)
    yield event
    event.set()


@pytest.fixture
def stager() -> Iterator[Stager]:
    s = Stager(background=True)
    yield s
    s.close()


def _model_state() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt, {"model": model, "optim": opt}


def test_only_deferrable_leaves_are_copied_in_the_background(gate: threading.Event,
                                                             stager: Stager) -> None:
    """Deferrable leaves are copied by the worker (here held back by the gate); the others
    are copied before ``start`` returns, so later changes to them never reach the snapshot."""
    param, buffer = torch.arange(6, dtype=torch.float32), torch.ones(3)
    _, leaves = flatten({"param": param, "buffer": buffer})
    bufs, staging = stager.start(leaves, lambda leaf: leaf.path == "param")
    assert not staging.done()                      # the worker waits at the gate
    buffer.add_(5)                                 # too late to matter: already copied
    assert np.array_equal(bufs[1].view(np.float32), np.ones(3, dtype=np.float32))
    gate.set()
    assert staging.wait(timeout=30) is None
    assert np.array_equal(bufs[0].view(np.float32), np.arange(6, dtype=np.float32))
    assert all(leaf.source is None for leaf in leaves)   # no live references kept


def test_background_errors_are_reported(stager: Stager) -> None:
    _, leaves = flatten({"p": torch.zeros(4)})
    leaves[0].source = torch.zeros(5)              # shape no longer matches the leaf
    _, staging = stager.start(leaves, lambda leaf: True)
    error = staging.wait(timeout=30)
    assert isinstance(error, RuntimeError) and not isinstance(error, TornSnapshotError)


def test_in_place_change_while_held_tears_nothing_and_names_the_tensor(
        gate: threading.Event, stager: Stager, caplog: pytest.LogCaptureFixture) -> None:
    weight = torch.arange(6, dtype=torch.float32)
    other = torch.ones(3)
    _, leaves = flatten({"model": {"weight": weight, "bias": other}})
    _, staging = stager.start(leaves, lambda leaf: True, step=7)
    assert not staging.done()
    with torch.no_grad():
        weight.mul_(0)                       # weight clipping / averaging / re-init
    with caplog.at_level(logging.WARNING, logger="ftkit.capture.staging"):
        gate.set()
        error = staging.wait(timeout=30)
    assert isinstance(error, TornSnapshotError) and isinstance(error, FtkitError)
    text = str(error)
    assert "model/weight" in text and "model/bias" not in text
    assert "step 7" in text
    assert "changed in place while its snapshot was being staged" in text and HINT in text
    assert (error.path, error.step) == ("model/weight", 7)
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [text]


def test_no_change_means_no_error(gate: threading.Event, stager: Stager) -> None:
    weight = torch.arange(6, dtype=torch.float32)
    _, leaves = flatten({"weight": weight})
    bufs, staging = stager.start(leaves, lambda leaf: True)
    assert not staging.done()
    gate.set()
    assert staging.wait(timeout=30) is None
    assert np.array_equal(bufs[0].view(np.float32), np.arange(6, dtype=np.float32))


def test_change_after_staging_completed_is_fine(stager: Stager) -> None:
    weight = torch.arange(6, dtype=torch.float32)
    _, leaves = flatten({"weight": weight})
    bufs, staging = stager.start(leaves, lambda leaf: True)
    assert staging.wait(timeout=30) is None
    with torch.no_grad():
        weight.mul_(0)
    assert staging.wait(timeout=30) is None
    assert np.array_equal(bufs[0].view(np.float32), np.arange(6, dtype=np.float32))


def test_parameter_changes_are_seen_through_state_dict_views(
        gate: threading.Event, stager: Stager) -> None:
    """Leaves come from ``state_dict()``: ``param.detach()`` views and the optimizer's own
    state tensors. An in-place change of the *parameter* must bump the counter we read."""
    model, _, state = _model_state()
    _, leaves = flatten(state)
    _, staging = stager.start(leaves, lambda leaf: leaf.kind == "torch", step=2)
    with torch.no_grad():
        model.weight.clamp_(-1e-3, 1e-3)
    gate.set()
    error = staging.wait(timeout=30)
    assert isinstance(error, TornSnapshotError), error
    assert error.path == "model/weight"


def test_optimizer_state_change_is_detected(gate: threading.Event, stager: Stager) -> None:
    model, opt, state = _model_state()
    _, leaves = flatten(state)
    _, staging = stager.start(leaves, lambda leaf: leaf.kind == "torch")
    opt.state[model.bias]["momentum_buffer"].zero_()
    gate.set()
    error = staging.wait(timeout=30)
    assert isinstance(error, TornSnapshotError) and error.path == "optim/state/1/momentum_buffer"
    assert "step" not in str(error).split("changed")[0]      # step unknown: not invented


def test_next_start_after_a_torn_one_works_and_reuses_buffers(
        gate: threading.Event, stager: Stager) -> None:
    weight = torch.arange(6, dtype=torch.float32)
    _, leaves = flatten({"weight": weight})
    bufs, staging = stager.start(leaves, lambda leaf: True)
    weight.add_(1)
    gate.set()
    assert isinstance(staging.wait(timeout=30), TornSnapshotError)
    allocated = stager.allocated_bytes
    _, leaves2 = flatten({"weight": weight})
    bufs2, staging2 = stager.start(leaves2, lambda leaf: True)
    assert staging2.wait(timeout=30) is None
    assert stager.allocated_bytes == allocated and bufs2[0] is bufs[0]
    assert np.array_equal(bufs2[0].view(np.float32), np.arange(6, dtype=np.float32) + 1)


def test_change_before_the_whole_batch_landed_is_refused(
        monkeypatch: pytest.MonkeyPatch, stager: Stager) -> None:
    """The rule is "no in-place change of a deferred tensor until staging is done": ``a``
    changed after its own copy, while ``b`` is still being copied, fails the staging too
    (the final re-check). This also catches a change that overlapped ``a``'s copy but bumped
    the counter only after ``a``'s per-leaf check."""
    a_copied, b_may_go = threading.Event(), threading.Event()
    original = staging_mod.copy_leaf

    def copy(leaf: Any, buf: np.ndarray) -> None:
        if leaf.path == "b":
            a_copied.set()
            assert b_may_go.wait(timeout=30)
        original(leaf, buf)
    monkeypatch.setattr(staging_mod, "copy_leaf", copy)
    a, b = torch.zeros(3), torch.ones(3)
    _, leaves = flatten({"a": a, "b": b})
    _, staging = stager.start(leaves, lambda leaf: True)
    assert a_copied.wait(timeout=30)
    a.add_(1)
    b_may_go.set()
    error = staging.wait(timeout=30)
    assert isinstance(error, TornSnapshotError) and error.path == "a"


def test_numpy_leaves_are_never_deferred(gate: threading.Event, stager: Stager) -> None:
    """NumPy arrays have no version counter: copied before ``start`` returns, even when the
    predicate says they may be deferred, so a later change never reaches the snapshot."""
    arr = np.arange(5, dtype=np.int64) + 10
    _, leaves = flatten({"a": arr, "t": torch.zeros(2)})
    bufs, staging = stager.start(leaves, lambda leaf: True)
    assert np.array_equal(bufs[0].view(np.int64), np.arange(5) + 10)   # gate still shut
    arr[...] = 0
    gate.set()
    assert staging.wait(timeout=30) is None
    assert np.array_equal(bufs[0].view(np.int64), np.arange(5) + 10)


def test_inference_tensors_have_no_counter_and_are_copied_at_once(
        gate: threading.Event, stager: Stager) -> None:
    with torch.inference_mode():
        t = torch.arange(4, dtype=torch.float32)
    _, leaves = flatten({"t": t})
    bufs, staging = stager.start(leaves, lambda leaf: True)
    assert staging.done()
    assert np.array_equal(bufs[0].view(np.float32), np.arange(4, dtype=np.float32))


def test_changes_through_dot_data_are_not_detected(gate: threading.Event,
                                                   stager: Stager) -> None:
    """The documented limit: ``p.data`` has its own version counter, so ``p.data.mul_()``
    bypasses the check (as it bypasses autograd's). Pinned so the docs stay true."""
    p = torch.nn.Parameter(torch.arange(4, dtype=torch.float32))
    _, leaves = flatten({"p": p})
    bufs, staging = stager.start(leaves, lambda leaf: True)
    p.data.mul_(0)
    gate.set()
    assert staging.wait(timeout=30) is None
    assert not bufs[0].view(np.float32).any()            # torn, undetected


def test_torn_snapshot_error_describes_itself() -> None:
    err = TornSnapshotError("model/w", 3)
    assert str(err).startswith("tensor model/w (step 3) changed in place")
    assert HINT in str(err)
    assert TornSnapshotError("x", None).step is None


_PADDED = np.dtype({"names": ["a", "b"], "formats": ["u1", "<f8"]}, align=True)   # 7 pad


def test_structured_array_is_staged_byte_for_byte_padding_included() -> None:
    """A contiguous structured array's padding bytes are copied as they are, not left as
    whatever the reused staging buffer held (they would land in the shard)."""
    arr = np.zeros(4, dtype=_PADDED)
    arr.view(np.uint8)[:] = np.arange(arr.nbytes, dtype=np.uint8)
    _, leaves = flatten({"a": arr})
    stager = Stager()
    stager.buffer(0, arr.nbytes).fill(0x78)            # stale bytes of an earlier step
    (buf,) = stager.capture(leaves)
    assert bytes(buf) == arr.tobytes()


def test_strided_structured_array_padding_is_zeroed() -> None:
    base = np.zeros(8, dtype=_PADDED)
    base.view(np.uint8)[:] = 0xAB
    arr = base[::2]                                     # not contiguous: copied by field
    _, leaves = flatten({"a": arr})
    stager = Stager()
    stager.buffer(0, leaves[0].nbytes).fill(0x78)
    (buf,) = stager.capture(leaves)
    rows = buf.reshape(4, _PADDED.itemsize)
    assert (rows[:, 0] == 0xAB).all() and (rows[:, 8:] == 0xAB).all()   # the fields
    assert (rows[:, 1:8] == 0).all()                                     # the padding

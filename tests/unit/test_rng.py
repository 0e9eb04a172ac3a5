"""ftkit.capture.rng.RNGState: Python, NumPy global and torch CPU generators round-trip."""
from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from ftkit import RNGState

Roundtrip = Callable[[Any], Any]


def _draw() -> tuple[Any, ...]:
    return (random.random(), random.getrandbits(80), random.gauss(0.0, 1.0),
            np.random.random(4).tolist(), np.random.randn(3).tolist(),
            np.random.randint(0, 2**31, 5).tolist(),
            torch.rand(4).tolist(), torch.randint(0, 1000, (5,)).tolist())


def _advance_all(n: int = 7) -> None:
    for _ in range(n):
        _draw()


@pytest.fixture(autouse=True)
def _keep_global_rng() -> Any:
    """Leave the process-wide generators as the test found them."""
    py, npy, tch = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(py)
    np.random.set_state(npy)
    torch.set_rng_state(tch)


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def test_direct_state_dict_roundtrip() -> None:
    _seed(1)
    _advance_all(3)
    rng = RNGState()
    sd = rng.state_dict()
    expected = _draw()
    _advance_all()
    assert _draw() != expected                  # the generators did move on
    RNGState().load_state_dict(sd)
    assert _draw() == expected


def test_pending_gaussians_are_restored() -> None:
    """Python's gauss() and NumPy's legacy randn() cache a second value."""
    _seed(2)
    random.gauss(0.0, 1.0)                      # leaves gauss_next set
    np.random.standard_normal()                 # leaves has_gauss=1
    sd = RNGState().state_dict()
    assert sd["python"]["gauss"] is not None
    assert sd["numpy"]["has_gauss"] == 1
    expected = (random.gauss(0.0, 1.0), np.random.standard_normal())
    _advance_all()
    RNGState().load_state_dict(sd)
    assert (random.gauss(0.0, 1.0), np.random.standard_normal()) == expected


def test_roundtrip_through_a_shard(roundtrip: Roundtrip) -> None:
    _seed(3)
    _advance_all(2)
    random.gauss(0.0, 1.0)
    rng = RNGState()
    state = {"rng": rng, "other": torch.zeros(2)}
    restored = roundtrip(state)                 # flatten captures rng.state_dict() now
    expected = _draw()
    _advance_all(11)
    rng.load_state_dict(restored["rng"])
    assert _draw() == expected


def test_each_generator_restored_independently() -> None:
    _seed(4)
    sd = RNGState().state_dict()
    want_py, want_np, want_t = random.random(), np.random.random(), torch.rand(1).item()
    for restore_check in (
        lambda: random.random() == want_py,
        lambda: np.random.random() == want_np,
        lambda: torch.rand(1).item() == want_t,
    ):
        _advance_all(2)
        RNGState().load_state_dict(sd)
        assert restore_check()


def test_state_dict_holds_no_pickle_only_types() -> None:
    sd = RNGState().state_dict()
    assert set(sd) >= {"python", "numpy", "torch"}
    assert isinstance(sd["python"]["state"], np.ndarray)
    assert sd["python"]["state"].shape == (625,)
    assert sd["numpy"]["kind"] == "MT19937"
    assert sd["numpy"]["keys"].dtype == np.uint32 and sd["numpy"]["keys"].shape == (624,)
    assert isinstance(sd["torch"], torch.Tensor) and sd["torch"].dtype == torch.uint8
    if not torch.cuda.is_available():
        assert "cuda" not in sd


def test_load_without_torch_entry_leaves_torch_alone() -> None:
    _seed(5)
    sd = RNGState().state_dict()
    del sd["torch"]
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    RNGState().load_state_dict(sd)
    assert torch.equal(torch.rand(3), want)


def test_cuda_state_without_cuda_is_skipped_with_warning(caplog: pytest.LogCaptureFixture,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _seed(6)
    sd = RNGState().state_dict()
    sd["cuda"] = [torch.zeros(16, dtype=torch.uint8)]
    expected = _draw()
    _advance_all()
    with caplog.at_level("WARNING", logger="ftkit.capture.rng"):
        RNGState().load_state_dict(sd)
    assert _draw() == expected
    assert "CUDA" in caplog.text

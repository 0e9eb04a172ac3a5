"""Seeding a state that has no checkpoint from a torch DCP checkpoint
(``ftkit/interop/seed.py``): each tensor found by its global name, the rank's part cut
from the saved chunks."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import ftkit
from ftkit.errors import UnrecoverableError
from ftkit.interop.seed import seed, targets

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")


def _full() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {"weight": torch.randn(4, 6, generator=g), "bias": torch.randn(4, generator=g)}


def _saved(tmp_path: Path, **extra: Any) -> Path:
    path = tmp_path / "dcp"
    dcp.save({"model": _full(), **extra}, checkpoint_id=str(path), no_dist=True)
    return path


def _rows(first: int, count: int) -> torch.nn.Linear:
    """Rows first..first+count of the (4, 6) Linear, declared as a slice of it."""
    lin = torch.nn.Linear(6, count)
    ftkit.declare_shard(lin.weight, (4, 6), (first, 0))
    ftkit.declare_shard(lin.bias, (4,), (first,))
    return lin


def test_seed_cuts_the_rank_part_from_the_saved_tensors(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    lin = _rows(1, 2)
    weight = lin.weight
    done = seed(path, {"model": lin, "rng": ftkit.RNGState()})
    full = _full()
    assert lin.weight is weight                                  # filled in place
    assert torch.equal(lin.weight.detach(), full["weight"][1:3])
    assert torch.equal(lin.bias.detach(), full["bias"][1:3])
    assert done == {"tensors": 2, "missing": [], "unused": []}


def test_whole_tensors_and_optional_ones(tmp_path: Path) -> None:
    """An undeclared module tensor is whole; an optimizer's existing state is seeded when
    DCP has it and listed as missing when not; RNG state is never a target."""
    path = _saved(tmp_path, extra={"count": torch.tensor(3)})
    lin = torch.nn.Linear(6, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    lin(torch.ones(1, 6)).sum().backward()
    opt.step()
    state = {"model": lin, "optim": opt, "extra": {"count": torch.tensor(0)},
             "rng": ftkit.RNGState()}
    names = [t.fqn for t in targets(state)]
    assert "model.weight" in names and "extra.count" in names
    assert not [n for n in names if n.startswith("rng")], names
    done = seed(path, state)
    assert torch.equal(lin.weight.detach(), _full()["weight"])
    assert int(state["extra"]["count"]) == 3
    assert done["missing"] == ["optim.state.model.bias.momentum_buffer",
                               "optim.state.model.weight.momentum_buffer"], done


def test_a_missing_or_different_module_tensor_is_refused(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    with pytest.raises(UnrecoverableError, match=r"it has no other\.weight, other\.bias; it "
                                                 r"holds model\.bias, model\.weight"):
        seed(path, {"other": torch.nn.Linear(6, 4)})
    wide = torch.nn.Linear(6, 4).double()
    with pytest.raises(UnrecoverableError, match=r"model\.weight is torch\.float32 \[4, 6\] "
                                                 r"there, torch\.float64 \[4, 6\] in the state"):
        seed(path, {"model": wide})
    with pytest.raises(UnrecoverableError, match=r"model\.weight is torch\.float32 \[4, 6\] "
                                                 r"there, torch\.float32 \[5, 6\]"):
        seed(path, {"model": torch.nn.Linear(6, 5)})


def test_a_directory_that_is_not_a_dcp_checkpoint_is_named(tmp_path: Path) -> None:
    from ftkit.errors import CorruptCheckpointError
    with pytest.raises(CorruptCheckpointError, match=r"nowhere/\.metadata .*cannot read the "
                                                     r"DCP metadata"):
        seed(tmp_path / "nowhere", {"model": torch.nn.Linear(2, 2)})

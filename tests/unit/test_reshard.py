"""Resharding a PFS step onto another layout (ftkit.recovery.reshard), one process: steps
written with ftkit's own writers by "ranks" of a TP=2 job (declared slices, Adam state after
one step, a plain counter), loaded by single ranks of TP=1 and TP=4 jobs and compared with
the same model trained whole."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

import ftkit
from ftkit.capture.apply import load_into
from ftkit.capture.flatten import RESERVED
from ftkit.capture.landing import Gate
from ftkit.errors import CheckpointError
from ftkit.recovery.reshard import Resharded, declared, template_rank
from ftkit.storage.pfs.h5read import StepReader
from tests.unit.test_hdf5_meta import write_step

torch = pytest.importorskip("torch")
nn = torch.nn
H = 8


def _full() -> dict[str, Any]:
    g = torch.Generator().manual_seed(11)
    return {"up": torch.randn(4 * H, H, generator=g), "ln": torch.randn(H, generator=g),
            "grad_up": torch.randn(4 * H, H, generator=g),
            "grad_ln": torch.randn(H, generator=g)}


class Tiny(nn.Module):
    """A column-parallel weight (rows cut by TP, declared) and a replicated vector."""

    def __init__(self, full: dict[str, Any], tp: int, t: int) -> None:
        super().__init__()
        rows = 4 * H // tp
        self.up = nn.Parameter(full["up"][t * rows:(t + 1) * rows].clone())
        ftkit.declare_shard(self.up, (4 * H, H), (t * rows, 0))
        self.ln = nn.Parameter(full["ln"].clone())


def _state(full: dict[str, Any], tp: int, t: int, *, stepped: bool, lr: float = 0.1,
           pos: int = 0) -> dict[str, Any]:
    model = Tiny(full, tp, t)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    if stepped:
        rows = 4 * H // tp
        model.up.grad = full["grad_up"][t * rows:(t + 1) * rows].clone()
        model.ln.grad = full["grad_ln"].clone()
        opt.step()
    return {"model": model, "optim": opt, "data": {"pos": pos}}


@dataclasses.dataclass
class Coords:
    dp: int = 0
    tp: int = 0
    pp: int = 0


@dataclasses.dataclass
class Topo:
    rank: int
    coords: Coords


def _saved(tmp_path: Path, full: dict[str, Any], tp: int = 2, **kw: Any) -> Path:
    step_dir = tmp_path / "job" / "step-1"
    states = [_state(full, tp, t, stepped=True, lr=0.01, pos=5 + t, **kw) for t in range(tp)]
    write_step(step_dir, states, tp=tp, rank_files=True)
    return step_dir


def _restore(step_dir: Path, state: dict[str, Any], topo: Topo) -> None:
    with StepReader(step_dir, 1) as reader:
        groups = {r: reader.group(r) for r in range(int(reader.meta["world"]))}
        assert declared(groups)
        opened = Resharded(reader, groups, topo, state, 1)
        opened.read(Gate(), lambda n: None)
        load_into(state, opened.reading.tree, 1)


@pytest.mark.parametrize("tp,t", [(1, 0), (4, 3), (4, 1)])
def test_tp2_checkpoint_restored_at_another_tp(tmp_path: Path, tp: int, t: int) -> None:
    """Parameters, Adam moments (the parameter's slice of the global moments) and Adam's
    step come from the saved TP=2 pieces; param_groups and the plain counter from the
    template rank (TP index t mod 2); the result is the whole model's one Adam step."""
    full = _full()
    step_dir = _saved(tmp_path, full)
    whole = _state(full, 1, 0, stepped=True, lr=0.01)
    state = _state(full, tp, t, stepped=False, lr=0.5)
    live_up = state["model"].up
    _restore(step_dir, state, Topo(t, Coords(tp=t)))
    rows = 4 * H // tp
    mine = slice(t * rows, (t + 1) * rows)
    assert state["model"].up is live_up                        # loaded in place
    assert torch.equal(live_up.detach(), whole["model"].up.detach()[mine])
    assert torch.equal(state["model"].ln.detach(), whole["model"].ln.detach())
    opt, ref = state["optim"], whole["optim"]
    assert opt.param_groups[0]["lr"] == 0.01                   # the saved hyperparameters
    got = opt.state[state["model"].up]
    want = ref.state[whole["model"].up]
    assert torch.equal(got["exp_avg"], want["exp_avg"][mine])
    assert torch.equal(got["exp_avg_sq"], want["exp_avg_sq"][mine])
    assert float(got["step"]) == 1.0
    assert torch.equal(opt.state[state["model"].ln]["exp_avg"],
                       ref.state[whole["model"].ln]["exp_avg"])
    assert state["data"] == {"pos": 5 + template_rank((1, 2, 1), Coords(tp=t))}


def test_replicas_that_differ_are_refused(tmp_path: Path) -> None:
    """An undeclared tensor held by two ranks with different contents (e.g. ZeRO-sharded
    state nobody declared) cannot be resharded: the error names it and both ranks."""
    full = _full()
    step_dir = tmp_path / "job" / "step-1"
    states = [_state(full, 2, t, stepped=True) for t in range(2)]
    with torch.no_grad():
        states[1]["model"].ln.add_(1.0)
    write_step(step_dir, states, tp=2, rank_files=True)
    with pytest.raises(CheckpointError, match=r"tensor 'model/ln' is held as the same piece "
                                              r"by ranks 0 and 1 with different contents"):
        _restore(step_dir, _state(full, 1, 0, stepped=False), Topo(0, Coords()))


def test_a_tensor_the_checkpoint_lacks_is_refused(tmp_path: Path) -> None:
    full = _full()
    step_dir = _saved(tmp_path, full)
    state = _state(full, 1, 0, stepped=False)
    state["model"].extra = nn.Parameter(torch.zeros(3))
    with pytest.raises(CheckpointError, match=r"model/extra: in the state .* but not in the "
                                              r"checkpoint"):
        _restore(step_dir, state, Topo(0, Coords()))


def test_another_global_shape_is_refused(tmp_path: Path) -> None:
    """A model of another size (the declared global shape differs) is not silently cut."""
    full = _full()
    step_dir = _saved(tmp_path, full)
    other = {k: torch.cat([v, v]) if k == "up" else v for k, v in full.items()}
    state = _state(other, 1, 0, stepped=False)
    ftkit.declare_shard(state["model"].up, (8 * H, H), (0, 0))
    with pytest.raises(CheckpointError, match=r"model/up: the checkpoint has float32 \[32, 8\], "
                                              r"the state float32 \[64, 8\]"):
        _restore(step_dir, state, Topo(0, Coords()))


def test_layout_change_names_both_layouts() -> None:
    """The ``reshard`` event's fields: empty on the saved layout, else both layouts and how."""
    from ftkit.recovery.pfs_restore import _layout_change
    topo = dataclasses.make_dataclass("Topo", ["world", "dp", "tp", "pp"])(4, 1, 2, 2)
    assert _layout_change({"world": 4, "tp": 2, "pp": 2}, topo, sharded=True) == {}
    moved = _layout_change({"world": 8, "tp": 2, "pp": 2}, topo, sharded=True)
    assert moved["saved"] == {"world": 8, "dp": 2, "tp": 2, "pp": 2}
    assert moved["now"] == {"world": 4, "dp": 1, "tp": 2, "pp": 2}
    assert moved["how"] == ("resharded from the saved shards: 8 ranks (dp2 tp2 pp2) -> "
                            "4 ranks (dp1 tp2 pp2)")
    replica = _layout_change({"world": 8, "tp": 1, "pp": 1}, topo, sharded=False)
    assert replica["how"].startswith("resharded from a DP replica: 8 ranks (dp8 tp1 pp1)")


class _Drawn:
    """An object whose saved state carries ftkit's rank-local part, as a loader's does (its
    generator is seeded per rank)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def state_dict(self) -> dict[str, Any]:
        return {RESERVED: {"generator": torch.full((4,), self.rank, dtype=torch.uint8)},
                "pos": self.rank}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.rank = sd["pos"]


@pytest.mark.parametrize("tp,t", [(1, 0), (4, 3)])
def test_what_ftkit_saves_beside_an_object_comes_from_the_template_rank(
        tmp_path: Path, tp: int, t: int) -> None:
    """A loader's generator differs on every rank by design: it is not compared across the
    saved ranks (no "different contents" refusal) and each rank gets its template's."""
    full = _full()
    step_dir = tmp_path / "job" / "step-1"
    states = [{**_state(full, 2, r, stepped=True), "loader": _Drawn(r)} for r in range(2)]
    write_step(step_dir, states, tp=2, rank_files=True)
    state = {**_state(full, tp, t, stepped=False), "loader": _Drawn(9)}
    with StepReader(step_dir, 1) as reader:
        groups = {r: reader.group(r) for r in range(2)}
        opened = Resharded(reader, groups, Topo(t, Coords(tp=t)), state, 1)
        opened.read(Gate(), lambda n: None)
        template = template_rank((1, 2, 1), Coords(tp=t))
        mine = opened.reading.tree["loader"][RESERVED]["generator"]
        assert torch.equal(mine, torch.full((4,), template, dtype=torch.uint8))
        load_into(state, opened.reading.tree, 1)
    assert state["loader"].rank == template


def test_a_dp_change_with_a_loader_over_a_distributed_sampler_is_refused() -> None:
    """Its position counts one rank's share of the data: refused naming it, never silently
    moved to another global sample; the same DP size, or a sampler that does not split the
    data, passes."""
    from torch.utils.data import DistributedSampler, RandomSampler, TensorDataset
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    from ftkit.recovery.pfs_restore import _check_loaders
    data = TensorDataset(torch.arange(16.0))
    split = sdl.StatefulDataLoader(data, sampler=DistributedSampler(data, num_replicas=4,
                                                                    rank=1))
    topo = dataclasses.make_dataclass("Topo", ["dp"])
    meta = {"world": 4, "tp": 1, "pp": 1}
    with pytest.raises(CheckpointError, match=r"cannot restore step 7 saved at dp4 on dp2: "
                                              r"state\['data'\] is a data loader whose sampler "
                                              r"splits the data"):
        _check_loaders(meta, topo(2), {"model": torch.nn.Linear(2, 2), "data": split}, 7)
    _check_loaders(meta, topo(4), {"data": split}, 7)
    whole = sdl.StatefulDataLoader(data, sampler=RandomSampler(data))
    _check_loaders(meta, topo(2), {"data": whole}, 7)

"""DTensor state on 4 MPI ranks (torch.distributed over gloo): each rank stores its local
tensor, described by the DTensor's placements (no declaration); ``ftkit export`` assembles the
global tensors; restore, from the node-local level and from the PFS, gives the DTensors back
in place, Adam state included."""
from __future__ import annotations

from typing import Any

import h5py
import pytest

import ftkit
from ftkit.cli.main import main
from ftkit.jobdir.events import read_events

from .mpi_helpers import RANK, WORLD, events, from_rank0, topology

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.tensor")


def _full() -> dict[str, Any]:
    g = torch.Generator().manual_seed(11)
    return {"w": torch.randn(4, 6, generator=g), "b": torch.randn(4, generator=g),
            "rows": torch.randn(10, 3, generator=g)}


def _state(full: dict[str, Any]) -> dict[str, Any]:
    """A Linear whose weight is cut 2 x 2 over a (2, 2) mesh and whose bias is replicated,
    its Adam state after one step, and a (10, 3) tensor cut unevenly over 4 ranks."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
    grid, line = init_device_mesh("cpu", (2, 2)), init_device_mesh("cpu", (4,))
    lin = torch.nn.Linear(6, 4)
    lin.weight = torch.nn.Parameter(distribute_tensor(full["w"], grid, [Shard(0), Shard(1)]))
    lin.bias = torch.nn.Parameter(distribute_tensor(full["b"], line, [Replicate()]))
    opt = torch.optim.Adam(lin.parameters(), lr=0.1)
    for p in lin.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return {"model": lin, "optim": opt,
            "rows": distribute_tensor(full["rows"], line, [Shard(0)])}


def _locals(state: dict[str, Any]) -> dict[str, Any]:
    lin, opt = state["model"], state["optim"]
    out = {"w": lin.weight, "b": lin.bias, "rows": state["rows"],
           "w_avg": opt.state[lin.weight]["exp_avg"]}
    return {k: v.to_local().clone() for k, v in out.items()}


def test_dtensor_state_is_stored_as_local_pieces_exported_whole_and_restored(
        ftkit_env: Any, torch_group: None) -> None:
    from torch.distributed.tensor import DTensor
    full = _full()
    state = _state(full)
    saved = _locals(state)
    with topology() as topo:
        ckpt = ftkit.Checkpointer(topo, ftkit.Config.load(levels="local:1,pfs:1"))
        ckpt.save(1, state)
        ckpt.close()
        step_dir = ftkit_env.pfs_dir / ftkit_env.job / "step-1"
        WORLD.Barrier()
        with h5py.File(step_dir / f"rank-{RANK}.h5", "r") as h5:
            w = h5[f"rank/{RANK}/model/weight"]
            i, j = divmod(RANK, 2)
            assert w.shape == (2, 3) and w.attrs["shard_dim"] == -2
            assert w.attrs["shard_offsets"].tolist() == [[2 * i, 3 * j]]
            rows = h5[f"rank/{RANK}/rows"]
            assert (rows.attrs["shard_dim"], rows.shape[0]) == (0, [3, 3, 3, 1][RANK])
            assert h5[f"rank/{RANK}/optim/state/0/exp_avg"].attrs["ftkit_key"] == \
                "optim/state/model/weight/exp_avg"
        out = ftkit_env.root / "export.pt"
        rc = from_rank0(main(["export", str(step_dir), "--out", str(out)]) if RANK == 0
                        else None)
        assert rc == 0
        exported = torch.load(out, weights_only=True)
        assert torch.equal(exported["model/weight"], state["model"].weight.full_tensor())
        assert torch.equal(exported["rows"], full["rows"])
        assert torch.equal(exported["optim/state/model/weight/exp_avg"],
                           state["optim"].state[state["model"].weight]["exp_avg"].full_tensor())

        for levels, drop_local in (("local:1", False), ("local:1,pfs:1", True)):
            with torch.no_grad():
                for p in state["model"].parameters():
                    p.add_(1.0)
                state["rows"].mul_(2.0)
            weight = state["model"].weight
            WORLD.Barrier()
            if drop_local and topo.is_node_leader:
                import shutil
                shutil.rmtree(ftkit_env.node_dir(topo.node))
            WORLD.Barrier()
            ckpt = ftkit.Checkpointer(topo, ftkit.Config.load(levels=levels))
            assert ckpt.restore(state) == 1
            ckpt.close()
            assert state["model"].weight is weight and isinstance(weight, DTensor)
            got = _locals(state)
            assert all(torch.equal(got[k], saved[k]) for k in saved), levels


def _resharded_state(full: dict[str, Any]) -> dict[str, Any]:
    """The same model on the same 4 ranks cut another way: the weight's rows over all 4
    ranks, its columns whole; ``rows`` replicated; a fresh Adam (no state yet)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
    line = init_device_mesh("cpu", (4,))
    lin = torch.nn.Linear(6, 4)
    lin.weight = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 6), line, [Shard(0)]))
    lin.bias = torch.nn.Parameter(distribute_tensor(torch.zeros(4), line, [Replicate()]))
    opt = torch.optim.Adam(lin.parameters(), lr=0.5)
    return {"model": lin, "optim": opt,
            "rows": distribute_tensor(torch.zeros(10, 3), line, [Replicate()])}


def test_dtensor_state_restored_on_another_layout(ftkit_env: Any, torch_group: None) -> None:
    """Saved with tp=1 (weight cut 2 x 2, rows cut unevenly), restored under tp=2 with other
    placements: the node-local step of the other layout is not used, the PFS step is
    resharded into the new local pieces, Adam's moments follow their parameter's new cut."""
    from torch.distributed.tensor import DTensor
    full = _full()
    state = _state(full)
    whole_avg = state["optim"].state[state["model"].weight]["exp_avg"].full_tensor()
    whole_w = state["model"].weight.full_tensor()           # after the Adam step
    with topology() as topo:
        ckpt = ftkit.Checkpointer(topo, ftkit.Config.load(levels="local:1,pfs:1"))
        ckpt.save(1, state)
        ckpt.close()
    WORLD.Barrier()
    new = _resharded_state(full)
    weight = new["model"].weight
    with topology(tp=2) as topo:
        ckpt = ftkit.Checkpointer(topo, ftkit.Config.load(levels="local:1,pfs:1"))
        assert ckpt.restore(new) == 1
        ckpt.close()
    assert new["model"].weight is weight and isinstance(weight, DTensor)
    assert torch.equal(weight.to_local(), whole_w[RANK:RANK + 1])
    assert torch.equal(new["rows"].to_local(), full["rows"])
    avg = new["optim"].state[weight]["exp_avg"]
    assert torch.equal(avg.to_local(), whole_avg[RANK:RANK + 1])
    assert new["optim"].param_groups[0]["lr"] == 0.1          # the saved hyperparameters


def test_dcp_export_loads_into_another_sharding(ftkit_env: Any, torch_group: None) -> None:
    """The step's DCP export (written by rank 0, no process group) read by
    ``torch.distributed.checkpoint.load`` on the 4 ranks into other placements: the
    weight's rows over all 4 ranks, ``rows`` replicated, Adam's moment by its parameter's
    nested name (``optim.state.model.weight.exp_avg``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
    full = _full()
    state = _state(full)
    whole_avg = state["optim"].state[state["model"].weight]["exp_avg"].full_tensor()
    whole_w = state["model"].weight.full_tensor()
    with topology() as topo:
        ckpt = ftkit.Checkpointer(topo, ftkit.Config.load(levels="local:1,pfs:1"))
        ckpt.save(1, state)
        ckpt.close()
    step_dir = ftkit_env.pfs_dir / ftkit_env.job / "step-1"
    out = ftkit_env.root / "dcp"
    rc = from_rank0(main(["export", str(step_dir), "--out", str(out), "--format", "dcp"])
                    if RANK == 0 else None)
    assert rc == 0
    new = _resharded_state(full)
    avg = distribute_tensor(torch.zeros(4, 6), init_device_mesh("cpu", (4,)), [Shard(0)])
    target = {"model": {"weight": new["model"].weight, "bias": new["model"].bias},
              "rows": new["rows"], "optim": {"state": {"model": {"weight": {"exp_avg": avg}}}}}
    with torch.no_grad():
        dcp.load(target, checkpoint_id=str(out))
    assert torch.equal(new["model"].weight.to_local(), whole_w[RANK:RANK + 1])
    assert torch.equal(new["model"].bias.full_tensor(), state["model"].bias.full_tensor())
    assert torch.equal(new["rows"].to_local(), full["rows"])
    assert torch.equal(avg.to_local(), whole_avg[RANK:RANK + 1])


def test_seed_from_a_dcp_checkpoint_written_by_torch(ftkit_env: Any, torch_group: None
                                                     ) -> None:
    """torch's ``dcp.save`` on the 4 ranks (the weight's rows over 4 ranks, a replicated
    bias) seeds a job with no checkpoint whose ranks hold 2 x 2 boxes of the weight
    (declared plain tensors, tp=2): ``restore(init_from=...)`` returns 0 with each rank's
    box filled and a ``seed`` event; once the job has committed a step, init_from is not
    used."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
    full = _full()
    line = init_device_mesh("cpu", (4,))
    out = ftkit_env.root / "torch-dcp"
    dcp.save({"model": {"weight": distribute_tensor(full["w"], line, [Shard(0)]),
                        "bias": distribute_tensor(full["b"], line, [Replicate()])}},
             checkpoint_id=str(out))
    i, j = divmod(RANK, 2)
    lin = torch.nn.Linear(3, 2)
    ftkit.declare_shard(lin.weight, (4, 6), (2 * i, 3 * j))
    ftkit.declare_shard(lin.bias, (4,), (2 * i,))
    state = {"model": lin}
    with topology(tp=2) as topo:
        ckpt = ftkit.Checkpointer(topo, ftkit.Config.load(levels="local:1"))
        assert ckpt.restore(state, init_from=out) == 0
        assert torch.equal(lin.weight.detach(), full["w"][2 * i:2 * i + 2, 3 * j:3 * j + 3])
        assert torch.equal(lin.bias.detach(), full["b"][2 * i:2 * i + 2])
        ckpt.save(1, state)
        ckpt.close()
    events = from_rank0(list(read_events(ftkit_env.events_path)) if RANK == 0 else None)
    [seeded] = [e for e in events if e["event"] == "seed"]
    assert (seeded["tensors"], seeded["dir"], seeded["missing"]) == (2, str(out), [])
    with torch.no_grad():
        lin.weight.zero_()
    with topology(tp=2) as topo:
        ckpt = ftkit.Checkpointer(topo, ftkit.Config.load(levels="local:1"))
        assert ckpt.restore(state, init_from=out) == 1      # the committed step wins
        ckpt.close()
    assert torch.equal(lin.weight.detach(), full["w"][2 * i:2 * i + 2, 3 * j:3 * j + 3])
    new = _resharded_state(full)           # DTensors of other placements, in another job
    with topology() as topo:
        ckpt = ftkit.Checkpointer(topo, ftkit.Config.load(levels="local:1", job="dt"))
        assert ckpt.restore(new, init_from=out) == 0
        ckpt.close()
    assert torch.equal(new["model"].weight.to_local(), full["w"][RANK:RANK + 1])
    assert torch.equal(new["model"].bias.to_local(), full["b"])


def _swapped(full: dict[str, Any]) -> dict[str, Any]:
    """``_state``'s model with the weight's mesh placements swapped: the same local shape
    (2, 3) on every rank, but rank (a, b) now holds rows 2b.., columns 3a.."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
    grid, line = init_device_mesh("cpu", (2, 2)), init_device_mesh("cpu", (4,))
    lin = torch.nn.Linear(6, 4)
    lin.weight = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 6), grid,
                                                      [Shard(1), Shard(0)]))
    lin.bias = torch.nn.Parameter(distribute_tensor(torch.zeros(4), line, [Replicate()]))
    return {"model": lin, "optim": torch.optim.Adam(lin.parameters(), lr=0.1),
            "rows": distribute_tensor(torch.zeros(10, 3), line, [Shard(0)])}


def test_placements_changed_on_the_same_layout_are_resharded(ftkit_env: Any,
                                                             torch_group: None) -> None:
    """The same world, tp and pp, but the weight's DTensor placements swapped: every local
    piece has its old shape, so loading each rank's saved piece in place would put it in
    another rank's box. The node-local step is skipped for its other cut (named), the PFS
    step is resharded, and each rank's piece is its own box of the saved weight; with no
    PFS level the restore refuses, naming the tensor, and changes nothing."""
    full = _full()
    state = _state(full)
    whole_w = state["model"].weight.full_tensor()
    with topology() as topo:
        ckpt = ftkit.Checkpointer(topo, ftkit.Config.load(levels="local:1,pfs:1"))
        ckpt.save(1, state)
        ckpt.close()
    new = _swapped(full)
    a, b = divmod(RANK, 2)
    with topology() as topo:
        ckpt = ftkit.Checkpointer(topo, ftkit.Config.load(levels="local:1"))
        with pytest.raises(ftkit.UnrecoverableError, match="another cut: model/weight holds"):
            ckpt.restore(new)
        ckpt.close()
    assert not new["model"].weight.to_local().any()
    with topology() as topo:
        ckpt = ftkit.Checkpointer(topo, ftkit.Config.load(levels="local:1,pfs:1"))
        assert ckpt.restore(new) == 1
        ckpt.close()
    assert torch.equal(new["model"].weight.to_local(), whole_w[2 * b:2 * b + 2, 3 * a:3 * a + 3])
    skips = [e for e in events(ftkit_env.events_path) if e["event"] == "restore-skip"]
    assert skips and "another cut" in skips[-1]["reason"], skips

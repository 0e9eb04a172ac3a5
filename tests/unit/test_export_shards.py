"""Declared shards on the PFS level: their HDF5 attributes, ``inspect``, and ``export``
assembling global tensors from fused, 2-D and pipeline-split pieces (steps written with
ftkit's own writers, no job)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

import ftkit
from ftkit.cli import export
from ftkit.cli.main import main
from ftkit.storage.pfs import hdf5
from tests.unit.test_cli_hostile import _load_safetensors, recommit
from tests.unit.test_hdf5_meta import write_step

torch = pytest.importorskip("torch")
TP = 4


def _full() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {"qkv": torch.randn(3 * 8, 5, generator=g),          # fused [q; k; v], 8 rows each
            "grid": torch.randn(4, 6, generator=g),             # 2 x 2 boxes
            "cols": torch.randn(3, 8, generator=g).to(torch.bfloat16),   # split along dim 1
            "ln": torch.randn(5, generator=g)}                  # replicated, undeclared


def _tp_state(full: dict[str, Any], r: int) -> dict[str, Any]:
    """Rank r's pieces of ``full`` at tp 4, declared."""
    qkv = torch.cat([full["qkv"][8 * k + 2 * r:8 * k + 2 * r + 2] for k in range(3)])
    ftkit.declare_shard(qkv, (24, 5), chunks=[((8 * k + 2 * r, 0), (2, 5)) for k in range(3)])
    i, j = divmod(r, 2)
    grid = ftkit.declare_shard(full["grid"][2 * i:2 * i + 2, 3 * j:3 * j + 3].clone(), (4, 6),
                               (2 * i, 3 * j))
    cols = ftkit.declare_shard(full["cols"][:, 2 * r:2 * r + 2].clone(), (3, 8), (0, 2 * r))
    return {"model": {"qkv": qkv, "grid": grid, "cols": cols, "ln": full["ln"].clone()},
            "data": {"pos": 3}}


def _tp_step(tmp_path: Path, dp: int = 1) -> tuple[Path, dict[str, Any]]:
    full = _full()
    states = [_tp_state(full, r % TP) for r in range(TP * dp)]
    step_dir = tmp_path / "job" / "step-1"
    write_step(step_dir, states, tp=TP, rank_files=True)
    return step_dir, full


def test_declared_shards_are_hdf5_attributes_and_inspected(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    step_dir, _ = _tp_step(tmp_path)
    with h5py.File(step_dir / "rank-1.h5", "r") as h5:
        grp = h5["rank/1/model"]
        qkv = dict(grp["qkv"].attrs)
        assert qkv["shard_dim"] == -2 and list(qkv["global_shape"]) == [24, 5]
        assert qkv["shard_offsets"].tolist() == [[2, 0], [10, 0], [18, 0]]
        assert qkv["shard_sizes"].tolist() == [[2, 5]] * 3
        cols = dict(grp["cols"].attrs)
        assert (cols["shard_dim"], cols["shard_offset"]) == (1, 2)
        assert grp["ln"].attrs["shard_dim"] == -1 and "shard_offsets" not in grp["ln"].attrs
    assert main(["inspect", str(step_dir), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    by_path = {t["path"]: t["shard"] for t in doc["steps"][0]["ranks"]["3"]}
    assert by_path["model/grid"] == {"dim": None, "offset": None, "global_shape": [4, 6],
                                     "chunks": [[[2, 3], [2, 3]]]}
    assert by_path["model/ln"] is None


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
@pytest.mark.parametrize("block", [64 << 20, 8])
def test_export_assembles_global_tensors(tmp_path: Path, fmt: str, block: int,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """tp 4 x dp 2: fused chunks, 2-D boxes, a bfloat16 split along dim 1 and a replica
    become the global tensors (``block`` 8: placed a few elements at a time)."""
    monkeypatch.setattr(export, "BLOCK_BYTES", block)
    step_dir, full = _tp_step(tmp_path, dp=2)
    out = tmp_path / f"x.{fmt}"
    assert main(["export", str(step_dir), "--out", str(out), "--only", "model"]) == 0
    if fmt == "pt":
        sd = torch.load(out, weights_only=True)
    else:
        sd = {k: v[2] for k, v in _load_safetensors(out).items()}
        full = {k: v.view(torch.int16) if v.dtype == torch.bfloat16 else v
                for k, v in full.items()}
        sd = {k: torch.from_numpy(np.frombuffer(b, dtype=full[k].numpy().dtype).copy())
              .reshape(full[k].shape) for k, b in sd.items()}
    assert set(sd) == set(full)
    for key, want in full.items():
        assert sd[key].dtype == want.dtype and torch.equal(sd[key], want), key


def test_pipeline_stages_export_optimizer_state_by_parameter(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """pp 2: each stage's optimizer numbers its parameters from 0; the export names them
    by their parameters, so both stages' state is there."""
    states, models = [], []
    for stage in range(2):
        layer = torch.nn.Linear(3, 3)
        model = torch.nn.ModuleDict({"blocks": torch.nn.ModuleDict({str(stage): layer})})
        opt = torch.optim.Adam(model.parameters())
        layer(torch.ones(1, 3)).sum().backward()
        opt.step()
        states.append({"model": model, "optim": opt})
        models.append(model)
    step_dir = tmp_path / "job" / "step-1"
    write_step(step_dir, states, pp=2, rank_files=True)
    out = tmp_path / "x.pt"
    assert main(["export", str(step_dir), "--out", str(out)]) == 0
    sd = torch.load(out, weights_only=True)
    for stage, model in enumerate(models):
        name = f"blocks.{stage}.weight"
        assert torch.equal(sd[f"model/{name}"], model.state_dict()[name])
        opt_state = states[stage]["optim"].state[model["blocks"][str(stage)].weight]
        assert torch.equal(sd[f"optim/state/model/{name}/exp_avg"], opt_state["exp_avg"])
    assert not [k for k in sd if k.startswith("optim/state/0")]


def test_undeclared_pieces_that_differ_are_named(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    full = _full()
    states = [_tp_state(full, r) for r in range(TP)]
    states[2]["model"]["ln"] += 1                       # a TP shard nobody declared
    step_dir = tmp_path / "job" / "step-1"
    write_step(step_dir, states, tp=TP, rank_files=True)
    assert main(["export", str(step_dir), "--out", str(tmp_path / "x.pt")]) == 1
    err = capsys.readouterr().err
    assert "'model/ln'" in err and "ranks 0 and 2" in err and "different data" in err, err
    assert not (tmp_path / "x.pt").exists()


def test_pieces_that_do_not_cover_the_tensor_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    full = _full()
    states = [_tp_state(full, r) for r in range(TP)]
    for r, s in enumerate(states):                      # a gap at columns 8-9
        ftkit.declare_shard(s["model"]["cols"], (3, 10), (0, 2 * r))
    step_dir = tmp_path / "job" / "step-1"
    write_step(step_dir, states, tp=TP, rank_files=True)
    assert main(["export", str(step_dir), "--out", str(tmp_path / "x.pt")]) == 1
    err = capsys.readouterr().err
    assert "'model/cols'" in err and "cover 24 of its 30 elements" in err, err


@pytest.mark.parametrize("attr,value,needle", [
    ("shard_sizes", np.array([[2, 5], [2, 5], [3, 5]]), "hold 35 elements, the tensor 30"),
    ("shard_offsets", np.array([[2, 0], [2, 0], [18, 0]]), "overlap"),
    ("shard_dim", 0, "do not describe chunks"),
    ("global_shape", [24], "does not have the 1 dimensions"),
])
def test_shard_attributes_that_disagree_make_the_dataset_bad(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], attr: str, value: Any,
        needle: str) -> None:
    step_dir, _ = _tp_step(tmp_path)
    path = step_dir / "rank-1.h5"
    with h5py.File(path, "r+") as h5:
        h5["rank/1/model/qkv"].attrs[attr] = value
        hdf5.seal(h5["rank/1"])
    recommit(path)
    assert main(["verify", str(step_dir)]) == 1
    cap = capsys.readouterr()
    err = cap.out + cap.err
    assert "rank/1/model/qkv" in err and "bad dataset" in err and needle in err, err


def test_state_sharded_across_data_parallel_ranks_is_gathered(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """dp 4 (tp = pp = 1) with each rank holding a quarter of ``w`` (FSDP-style): export
    gathers it from every rank; the replicated ``b`` is rank 0's."""
    full = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
    states = [{"w": ftkit.declare_shard(full[2 * r:2 * r + 2].clone(), (8, 3), (2 * r, 0)),
               "b": torch.arange(3.0)} for r in range(4)]
    step_dir = tmp_path / "job" / "step-1"
    write_step(step_dir, states, rank_files=True)
    out = tmp_path / "x.pt"
    assert main(["export", str(step_dir), "--out", str(out)]) == 0
    assert "merged from ranks 0-3" in capsys.readouterr().out
    sd = torch.load(out, weights_only=True)
    assert torch.equal(sd["w"], full) and torch.equal(sd["b"], torch.arange(3.0))

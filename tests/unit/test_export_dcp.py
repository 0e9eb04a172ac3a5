"""``ftkit export --format dcp``: a committed step as a torch.distributed.checkpoint
directory that ``dcp.load`` reads without a process group (the MPI tier loads one into
another sharding: ``tests/mpi/test_mpi_dtensor.py``)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ftkit.capture.flatten import RESERVED
from ftkit.cli.main import main
from ftkit.cli.scan import ExportError
from ftkit.cli.torchfmt import nest
from tests.unit.test_export_shards import _tp_step

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")


def _empty_like(tree: dict[str, Any]) -> dict[str, Any]:
    return {k: _empty_like(v) if isinstance(v, dict) else torch.full_like(v, 7)
            for k, v in tree.items()}


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}/") if isinstance(v, dict) else {prefix + k: v})
    return out


def test_dcp_export_loads_without_a_process_group(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """tp 4 x dp 2 with fused chunks, boxes and a bfloat16 split: DCP holds the global
    tensors under nested names (``model.qkv``), equal to the pt export's, and ftkit.json
    says where they came from."""
    step_dir, full = _tp_step(tmp_path, dp=2)
    pt, out = tmp_path / "x.pt", tmp_path / "dcp"
    assert main(["export", str(step_dir), "--out", str(pt)]) == 0
    assert main(["export", str(step_dir), "--out", str(out), "--format", "dcp"]) == 0
    assert f"-> {out} (dcp)" in capsys.readouterr().out
    flat = torch.load(pt, weights_only=True)
    state = _empty_like(nest(flat))
    assert set(state) == {"model"} and set(state["model"]) == set(full)
    dcp.load(state, checkpoint_id=str(out), no_dist=True)
    for key, want in flat.items():
        got = _flat(state)[key]
        assert got.dtype == want.dtype and torch.equal(got, want), key
    assert torch.equal(state["model"]["qkv"], full["qkv"])
    keys = set(dcp.FileSystemReader(str(out)).read_metadata().state_dict_metadata)
    assert keys == {f"model.{k}" for k in full}
    meta = json.loads((out / "ftkit.json").read_text())
    assert (meta["ftkit_step"], meta["ftkit_job"]) == ("1", "synth"), meta
    assert "merged from ranks 0-3" in meta["ftkit_source"], meta
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".dcp.")]   # no scratch


def test_dcp_export_refuses_an_existing_directory(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    step_dir, _ = _tp_step(tmp_path)
    out = tmp_path / "dcp"
    out.mkdir()
    (out / "keep").write_text("mine")
    assert main(["export", str(step_dir), "--out", str(out), "--format", "dcp"]) == 2
    assert "exists; --format dcp writes a new directory" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep"]


def test_nest_splits_at_slashes_and_refuses_a_tensor_that_is_a_prefix() -> None:
    t = object()
    assert nest({"model/a.b": t, "optim/state/model/a.b/exp_avg": t}) == {
        "model": {"a.b": t}, "optim": {"state": {"model": {"a.b": {"exp_avg": t}}}}}
    for flat in ({"a/b": t, "a/b/c": t}, {"a/b/c": t, "a/b": t}):
        with pytest.raises(ExportError, match="'a/b"):
            nest(flat)


class _DDPLike:
    """What a DistributedDataParallel saves: its module's state dict under ``module.``, and
    the bucket layout ftkit keeps beside it (capture/ddp.py)."""

    def __init__(self, net: Any) -> None:
        self.net = net

    def state_dict(self) -> dict[str, Any]:
        return {RESERVED: {"ddp_buckets": torch.full((2, 4), -1, dtype=torch.int64)},
                **{f"module.{k}": v for k, v in self.net.state_dict().items()}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        raise NotImplementedError


def test_a_ddp_is_exported_under_the_unwrapped_models_keys(tmp_path: Path) -> None:
    """The README's ``dcp.load({"model": model.state_dict()})`` into an unwrapped model
    works with a step saved from a DDP: ``module.`` is cut, ftkit's layout is left out."""
    from tests.unit.test_hdf5_meta import write_step
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    step_dir = tmp_path / "job" / "step-1"
    write_step(step_dir, [{"model": _DDPLike(net)}])
    out = tmp_path / "dcp"
    assert main(["export", str(step_dir), "--out", str(out), "--format", "dcp"]) == 0
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=str(out), no_dist=True)
    fresh.load_state_dict(state["model"])
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), fresh.parameters()))
    keys = set(dcp.FileSystemReader(str(out)).read_metadata().state_dict_metadata)
    assert keys == {f"model.{k}" for k in net.state_dict()}

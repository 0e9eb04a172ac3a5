"""``ftkit inspect`` / ``verify`` / ``export`` on a real 4-rank HDF5 checkpoint (plain pytest).

One toy job (4 ranks, 2 virtual nodes, PFS every 3 steps, 6 steps: ``step-3``, ``step-6``) runs
once per session; tests that damage files work on a copy. Expected values are read from the
files with h5py directly, never through ftkit. A few synthetic steps written with ftkit's own
HDF5 writer cover dtypes the toy lacks (bfloat16, numpy leaves) and TP layouts.
"""
from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from ftkit.cli.main import main
from ftkit.cli.scan import dataset_checksum
from ftkit.storage.pfs import hdf5
from ftkit.storage.shard import checksum
from tests.e2e.jobs import REPO, run_toy
from tests.unit.test_cli_hostile import recommit
from tests.unit.test_hdf5_meta import write_step

STEPS = [3, 6]
WORLD = 4


@pytest.fixture(scope="session")
def toy_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``<pfs>/e2e`` of one failure-free run; do not modify (copy it with ``_copy``)."""
    tmp = tmp_path_factory.mktemp("cli-hdf5")
    res = run_toy(tmp, steps=6, FTKIT_LEVELS="local:1,pfs:3", max_restarts=0)
    assert res.rc == 0, res.tail()
    job = res.pfs / "e2e"
    assert sorted(p.name for p in job.glob("step-*")) == ["step-3", "step-6"]
    return job


def _copy(job: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(job, tmp_path / "e2e"))


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    rc, out, err = _run(capsys, *argv)
    assert rc in (0, 1), err
    return rc, json.loads(out)


def _h5_truth(step_dir: Path) -> dict[int, dict[str, dict[str, Any]]]:
    """{rank: {global key or state path: {dtype, shape, nbytes, checksum}}} read from the
    node files (the names ``export`` gives the tensors)."""
    truth: dict[int, dict[str, dict[str, Any]]] = {}
    for node_file in sorted(step_dir.glob("node-*.h5")):
        with h5py.File(node_file, "r") as h5:
            for name, grp in h5["rank"].items():
                found: dict[str, dict[str, Any]] = {}

                def visit(_n: str, obj: Any, found: dict[str, dict[str, Any]] = found) -> None:
                    if isinstance(obj, h5py.Dataset):
                        a = obj.attrs
                        found[str(a.get("ftkit_key", a["ftkit_path"]))] = {
                            "dtype": str(a["ftkit_dtype"]),
                            "shape": [int(x) for x in a["ftkit_shape"]],
                            "nbytes": obj.size * obj.dtype.itemsize,
                            "checksum": str(a["checksum"])}
                grp.visititems(visit)
                truth[int(name)] = found
    return truth


def _flip_byte(node_file: Path, dataset: str, at: int = 5) -> None:
    """Flip one byte inside ``dataset``'s data (contiguous layout)."""
    with h5py.File(node_file, "r") as h5:
        ds = h5[dataset]
        offset = ds.id.get_offset()
        assert offset is not None and at < ds.size * ds.dtype.itemsize
    with open(node_file, "r+b") as fh:
        fh.seek(offset + at)
        byte = fh.read(1)[0]
        fh.seek(offset + at)
        fh.write(bytes([byte ^ 0xFF]))


# ----------------------------------------------------------------------------- imports

def test_cli_imports_neither_mpi4py_nor_torch(toy_job: Path) -> None:
    """Importing the CLI, building its parser and running inspect/verify pull in neither."""
    script = textwrap.dedent(f"""
        import contextlib, io, sys
        import ftkit.cli.main
        assert 'mpi4py' not in sys.modules and 'torch' not in sys.modules
        import ftkit.cli.checkpoints
        ftkit.cli.main.build_parser()
        with contextlib.redirect_stdout(io.StringIO()):
            rcs = [ftkit.cli.main.main(['inspect', {str(toy_job)!r}]),
                   ftkit.cli.main.main(['inspect', {str(toy_job)!r}, '--json']),
                   ftkit.cli.main.main(['verify', {str(toy_job)!r}])]
        assert rcs == [0, 0, 0], rcs
        heavy = [m for m in ('mpi4py', 'torch') if m in sys.modules]
        assert not heavy, heavy
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr


# ----------------------------------------------------------------------------- inspect

def test_inspect_json_matches_the_files(toy_job: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    for step in (None, 3):
        argv = ["inspect", str(toy_job), "--json"] + ([] if step is None else
                                                      ["--step", str(step)])
        rc, doc = _json(capsys, *argv)
        assert rc == 0
        chosen = step if step is not None else max(STEPS)
        assert doc["job_dir"] == str(toy_job) and doc["selected_step"] == chosen
        assert [s["step"] for s in doc["steps"]] == STEPS
        for s in doc["steps"]:
            step_dir = toy_job / f"step-{s['step']}"
            with h5py.File(step_dir / "ftkit.h5", "r") as h5:
                attrs = {k: h5.attrs[k] for k in h5.attrs}
            assert s["committed"] is True and s["state"] == "committed" and s["reason"] is None
            for key in ("world", "dp", "tp", "pp", "nodes", "job", "format"):
                assert s[key] == attrs[key], key
            assert (s["world"], s["dp"], s["tp"], s["pp"]) == (WORLD, WORLD, 1, 1)
            assert s["files"] == ["node-0.h5", "node-1.h5"] + [
                f"rank-{r}.h5" for r in range(WORLD)] and s["problems"] == []
            if s["step"] != chosen:
                assert s["ranks"] is None
                continue
            truth = _h5_truth(step_dir)
            assert sorted(truth) == list(range(WORLD))
            assert sorted(s["ranks"]) == [str(r) for r in range(WORLD)]
            for rank, expected in truth.items():
                listed = {t["key"] or t["path"]: {k: t[k] for k in ("dtype", "shape", "nbytes",
                                                                   "checksum")}
                          for t in s["ranks"][str(rank)]}
                assert listed == expected, rank
                own = f"rank-{rank}.h5"                 # every rank wrote its own file
                assert {Path(t["file"]).name for t in s["ranks"][str(rank)]} == {own}
            assert s["ranks"]["0"][0]["path"] == "model/0.weight"   # tree order
            assert s["ranks"]["0"][0]["shape"] == [64, 16]


def test_inspect_text(toy_job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "inspect", str(toy_job))
    assert rc == 0
    lines = out.splitlines()
    for step in STEPS:
        assert any(ln.split()[:2] == [str(step), "committed"] for ln in lines), out
    assert "step 6 (committed)" in out
    row = next(ln for ln in lines if ln.split()[:1] == ["model/0.weight"])
    assert row.split() == ["model/0.weight", "float32", "[64,", "16]", "4096"]
    assert "rank(s) 1-3: same paths, dtypes and shapes as rank 0" in out


@pytest.mark.parametrize("which", ["dir", "index"])
def test_inspect_one_step(toy_job: Path, capsys: pytest.CaptureFixture[str],
                          which: str) -> None:
    path = toy_job / "step-3" / ("ftkit.h5" if which == "index" else "")
    rc, doc = _json(capsys, "inspect", str(path), "--json")
    assert rc == 0 and doc["selected_step"] == 3
    assert [s["step"] for s in doc["steps"]] == [3]
    assert len(doc["steps"][0]["ranks"]) == WORLD
    rc, _, err = _run(capsys, "inspect", str(path), "--step", "6")
    assert rc == 2 and "not step 6" in err


# ----------------------------------------------------------------------------- incomplete

@pytest.mark.parametrize("remove", ["COMMITTED", "ftkit.h5"])
def test_incomplete_step(toy_job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                         remove: str) -> None:
    """A step whose flush did not finish: shown as incomplete, verify fails, export refuses,
    the committed step before it is still fine."""
    job = _copy(toy_job, tmp_path)
    (job / "step-6" / remove).unlink()
    rc, doc = _json(capsys, "inspect", str(job), "--json")
    assert rc == 0
    steps = {s["step"]: s for s in doc["steps"]}
    assert steps[6]["committed"] is False and steps[6]["state"] == "incomplete"
    assert remove in steps[6]["reason"]
    assert steps[3]["committed"] is True
    assert doc["selected_step"] == 3                      # newest committed
    rc, out, _ = _run(capsys, "inspect", str(job))
    assert any(ln.split()[:2] == ["6", "incomplete"] for ln in out.splitlines()), out

    rc, out, _ = _run(capsys, "verify", str(job))
    assert rc == 1 and "step 6: INCOMPLETE" in out and "step 3: ok" in out, out
    rc, doc = _json(capsys, "verify", str(job), "--json")
    assert rc == 1 and doc["ok"] is False
    assert [(s["step"], s["ok"]) for s in doc["steps"]] == [(3, True), (6, False)]
    assert _run(capsys, "verify", str(job), "--step", "6")[0] == 1
    assert _run(capsys, "verify", str(job), "--step", "3")[0] == 0
    rc, _, err = _run(capsys, "export", str(job), "--step", "6", "--out",
                      str(tmp_path / "x.pt"))
    assert rc == 1 and "incomplete" in err and not (tmp_path / "x.pt").exists()


# ----------------------------------------------------------------------------- verify

def test_verify_intact(toy_job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "verify", str(toy_job))
    assert rc == 0, out
    assert "step 3: ok" in out and "step 6: ok" in out
    rc, doc = _json(capsys, "verify", str(toy_job), "--json")
    assert rc == 0 and doc["ok"] is True
    for s in doc["steps"]:
        truth = _h5_truth(toy_job / f"step-{s['step']}")
        assert s["datasets"] == sum(len(t) for t in truth.values())
        assert s["bytes"] == sum(d["nbytes"] for t in truth.values() for d in t.values())
        assert s["bad"] == []
    for path in (toy_job / "step-3", toy_job / "step-6" / "ftkit.h5",
                 toy_job / "step-6" / "node-1.h5"):
        assert _run(capsys, "verify", str(path))[0] == 0, path


@pytest.mark.parametrize("node,dataset", [
    ("rank-3.h5", "/rank/3/model/0.weight"),
    ("rank-0.h5", "/rank/0/rng/numpy/keys"),
])
def test_verify_finds_a_flipped_byte(toy_job: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str],
                                     node: str, dataset: str) -> None:
    job = _copy(toy_job, tmp_path)
    node_file = job / "step-6" / node
    _flip_byte(node_file, dataset)
    rc, out, _ = _run(capsys, "verify", str(job))
    assert rc == 1
    assert f"{node_file}:{dataset}: checksum mismatch" in out, out
    assert "step 3: ok" in out
    rc, doc = _json(capsys, "verify", str(job / "step-6"), "--json")
    assert rc == 1
    (bad,) = doc["steps"][0]["bad"]
    assert bad["where"] == f"{node_file}:{dataset}" and "checksum mismatch" in bad["why"]
    assert _run(capsys, "verify", str(job), "--step", "3")[0] == 0
    out_file = tmp_path / "x.pt"
    rc, _, err = _run(capsys, "export", str(job), "--step", "6", "--out", str(out_file))
    if "/rank/0/" in dataset:          # export reads rank 0 and checks it
        assert rc == 1 and f"{node_file}:{dataset}: checksum mismatch" in err, err
        assert not out_file.exists()
    else:
        assert rc == 0, err


def test_verify_missing_node_file_and_dataset(toy_job: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    job = _copy(toy_job, tmp_path)
    (job / "step-3" / "node-1.h5").unlink()
    with h5py.File(job / "step-6" / "node-0.h5", "r+") as h5:   # through the node file's link
        del h5["rank/1/model/0.bias"]
    rc, doc = _json(capsys, "verify", str(job), "--json")
    assert rc == 1
    bad = {s["step"]: s["bad"] for s in doc["steps"]}
    node1, rank1 = job / "step-3" / "node-1.h5", job / "step-6" / "rank-1.h5"
    assert [b["where"] for b in bad[3]] == [str(node1)]         # ranks 2 and 3: one problem
    assert "No such file or directory" in bad[3][0]["why"]
    assert [b["where"] for b in bad[6]] == [str(rank1)]         # caught before h5py opens it
    assert "COMMITTED recorded" in bad[6][0]["why"], bad[6]
    rc, out, _ = _run(capsys, "inspect", str(job), "--step", "3")
    assert rc == 0 and f"{node1}: cannot read: No such file or directory" in out, out


def test_usage_errors(toy_job: Path, tmp_path: Path,
                      capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["verify", str(tmp_path / "nope")], ["inspect", str(tmp_path / "nope")],
                 ["verify", str(toy_job), "--step", "4"], ["verify", str(tmp_path)],
                 ["verify"], ["inspect", str(toy_job), "--step", "-1"],
                 ["export", str(toy_job), "--step", "3", "--out",
                  str(tmp_path / "no-dir" / "x.pt")],
                 ["export", str(toy_job), "--step", "3", "--out", str(tmp_path / "x.pt"),
                  "--format", "npz"]):
        rc, _, err = _run(capsys, *argv)
        assert rc == 2, (argv, err)
    rc, _, err = _run(capsys, "verify", str(toy_job.parent))
    assert rc == 2 and "job directories e2e" in err
    rc, _, err = _run(capsys, "export", str(toy_job), "--only", "nope", "--out",
                      str(tmp_path / "x.pt"))
    assert rc == 1 and "no tensor under 'nope'" in err and "model, optim, rng" in err, err
    assert not (tmp_path / "x.pt").exists()
    proc = subprocess.run([sys.executable, "-m", "ftkit.cli.main", "verify",
                           str(tmp_path / "nope")], cwd=REPO, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 2 and "no such file" in proc.stderr


def test_h5dump_lists_the_layout(toy_job: Path) -> None:
    h5dump = shutil.which("h5dump")
    if h5dump is None:
        pytest.skip("h5dump not installed")
    out = subprocess.run([h5dump, "-H", str(toy_job / "step-6" / "ftkit.h5")],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    for rank in range(WORLD):
        assert f'EXTERNAL_LINK "{rank}"' in out
        assert f'TARGETPATH "/rank/{rank}"' in out
    assert 'TARGETFILE "node-0.h5"' in out and 'TARGETFILE "node-1.h5"' in out
    for attr in ("format", "step", "world", "dp", "tp", "pp", "checksum", "ftkit_dtype",
                 "global_shape", "shard_offset", "tree"):
        assert f'ATTRIBUTE "{attr}"' in out, attr
    total = sum(len(t) for t in _h5_truth(toy_job / "step-6").values())
    assert out.count("DATASET \"") == total


# ----------------------------------------------------------------------------- export

def _toy_model() -> Any:
    import torch
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                               torch.nn.Dropout(0.1), torch.nn.Linear(64, 1))


def test_export_pt_loads_into_the_toy_model(toy_job: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    import torch
    out = tmp_path / "toy.pt"
    rc, stdout, err = _run(capsys, "export", str(toy_job), "--step", "6", "--out", str(out))
    assert rc == 0, err
    assert "rank 0 (data-parallel replicas, world 4)" in stdout
    sd = torch.load(out, weights_only=True)
    truth = _h5_truth(toy_job / "step-6")[0]
    _, doc = _json(capsys, "inspect", str(toy_job), "--step", "6", "--json")
    # tree order; optimizer state named by its parameter
    assert list(sd) == [t["key"] or t["path"] for t in doc["steps"][1]["ranks"]["0"]]
    assert set(sd) == set(truth)
    assert sd["rng/python/state"].dtype == torch.uint64
    assert sd["rng/numpy/keys"].dtype == torch.uint32
    assert sd["optim/state/model/0.weight/step"].shape == ()

    model = _toy_model()
    model.load_state_dict({k.removeprefix("model/"): v for k, v in sd.items()
                           if k.startswith("model/")})
    reference = _toy_model()
    with h5py.File(toy_job / "step-6" / "node-0.h5", "r") as h5:
        grp = h5["rank/0/model"]
        reference.load_state_dict({name: torch.from_numpy(grp[name][()]) for name in grp})
    model.eval()
    reference.eval()
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    for key, value in sd.items():
        assert checksum(value.reshape(-1).view(torch.uint8).numpy()) == truth[key]["checksum"]


def test_export_only_the_model_newest_step_by_default(toy_job: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    """``export JOB --only model`` (no --step): the newest committed step's model, keyed
    as ``model.state_dict()`` is, so a strict ``load_state_dict`` takes it as it is."""
    import torch
    out = tmp_path / "model.pt"
    rc, stdout, err = _run(capsys, "export", str(toy_job), "--only", "model", "--out", str(out))
    assert rc == 0 and "step 6:" in stdout, err
    sd = torch.load(out, weights_only=True)
    model = _toy_model()
    assert sorted(sd) == sorted(model.state_dict())
    model.load_state_dict(sd, strict=True)
    truth = _h5_truth(toy_job / "step-6")[0]
    for key, value in sd.items():
        assert checksum(value.reshape(-1).view(torch.uint8).numpy()) == \
            truth[f"model/{key}"]["checksum"]


def test_export_safetensors(toy_job: Path, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    """Written by ftkit itself (no package needed); parsed here by the format's definition
    and, when the package is installed, loaded with it."""
    out = tmp_path / "toy.safetensors"
    rc, _, err = _run(capsys, "export", str(toy_job / "step-3"), "--out", str(out))
    assert rc == 0, err
    data = out.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__")
    assert meta["ftkit_step"] == "3" and meta["ftkit_job"] == "e2e"
    truth = _h5_truth(toy_job / "step-3")[0]
    assert set(header) == set(truth)
    body = data[8 + n:]
    for name, t in header.items():
        start, stop = t["data_offsets"]
        assert checksum(body[start:stop]) == truth[name]["checksum"], name
        assert t["shape"] == truth[name]["shape"], name
    try:
        from safetensors.torch import load_file
    except ImportError:
        return
    assert set(load_file(str(out))) == set(truth)


# ----------------------------------------------------------------------------- synthetic steps

def _write_step(step_dir: Path, states: list[dict[str, Any]], *, tp: int = 1, pp: int = 1,
                ranks_per_node: int = 2, step: int = 1) -> None:
    """A committed PFS step written with ftkit's own shard and HDF5 writers."""
    write_step(step_dir, states, tp=tp, pp=pp, ranks_per_node=ranks_per_node, step=step)


def test_export_exact_dtypes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """bfloat16 (stored as raw bytes), other torch dtypes, numpy leaves and scalars."""
    import torch
    g = torch.Generator().manual_seed(3)
    state: dict[str, Any] = {
        "w": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "h": torch.randn(4, generator=g).to(torch.float16),
        "i": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "np": {"a": np.arange(7, dtype=np.int16), "s": np.float32(1.25)},
        "meta": {"epoch": 3, "name": "x"}}
    _write_step(tmp_path / "job" / "step-1", [state], ranks_per_node=1)
    rc, _, _ = _run(capsys, "verify", str(tmp_path / "job"))
    assert rc == 0
    rc, doc = _json(capsys, "inspect", str(tmp_path / "job"), "--json")
    dtypes = {t["path"]: t["dtype"] for t in doc["steps"][0]["ranks"]["0"]}
    assert dtypes["w"] == "bfloat16" and dtypes["np/a"] == "<i2"
    out = tmp_path / "s.pt"
    rc, _, err = _run(capsys, "export", str(tmp_path / "job"), "--step", "1", "--out", str(out))
    assert rc == 0, err
    sd = torch.load(out, weights_only=True)
    assert set(sd) == {"w", "h", "i", "mask", "empty", "scalar", "np/a", "np/s"}
    for key in ("w", "h", "i", "mask", "empty", "scalar"):
        assert sd[key].dtype == state[key].dtype and torch.equal(sd[key], state[key]), key
    assert sd["np/a"].dtype == torch.int16 and sd["np/a"].tolist() == list(range(7))
    assert sd["np/s"].shape == () and sd["np/s"].item() == 1.25


def test_export_tp_without_shard_attributes_names_the_tensor(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch
    states = [{"model": {"w": torch.full((2, 3), float(r))}} for r in range(2)]
    _write_step(tmp_path / "job" / "step-1", states, tp=2)
    out = tmp_path / "tp.pt"
    rc, _, err = _run(capsys, "export", str(tmp_path / "job" / "step-1"), "--out", str(out))
    assert rc == 1 and "'model/w'" in err and "shard_dim" in err, err
    assert not out.exists()


def test_export_tp_merges_shards(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """tp=2 x dp=2: shards of the dp_idx 0 ranks are concatenated at their offsets along
    shard_dim (raw bfloat16 bytes included); the dp_idx 1 replicas are not used. The
    attributes are set by hand as an older writer set them (``shard_dim``/``shard_offset``,
    no ``shard_offsets``): tests/unit/test_export_shards.py has declared ones."""
    import torch
    g = torch.Generator().manual_seed(5)
    full_w = torch.randn(4, 6, generator=g)
    full_b = torch.randn(6, 2, generator=g).to(torch.bfloat16)
    states = []
    for rank in range(4):
        tp_idx, dp_idx = rank % 2, rank // 2
        junk = 100.0 * dp_idx                     # replicas of dp_idx 1 differ: must be unused
        states.append({"w": full_w[:, 3 * tp_idx:3 * tp_idx + 3].clone() + junk,
                       "b": full_b[3 * tp_idx:3 * tp_idx + 3].clone() + junk})
    step_dir = tmp_path / "job" / "step-1"
    _write_step(step_dir, states, tp=2)
    for rank in range(4):
        with h5py.File(step_dir / f"node-{rank // 2}.h5", "r+") as h5:
            for name, dim, gshape in (("w", 1, [4, 6]), ("b", 0, [6, 2])):
                h5[f"rank/{rank}/{name}"].attrs.update(
                    {"shard_dim": dim, "shard_offset": 3 * (rank % 2), "global_shape": gshape})
            hdf5.seal(h5[f"rank/{rank}"])       # a writer that knows the TP layout
    for node in ("node-0.h5", "node-1.h5"):
        recommit(step_dir / node)
    assert _run(capsys, "verify", str(step_dir))[0] == 0
    _, doc = _json(capsys, "inspect", str(step_dir), "--json")
    assert doc["steps"][0]["ranks"]["1"][0]["shard"] == {
        "dim": 1, "offset": 3, "global_shape": [4, 6], "chunks": [[[0, 3], [4, 3]]]}
    out = tmp_path / "tp.pt"
    rc, stdout, err = _run(capsys, "export", str(step_dir), "--out", str(out))
    assert rc == 0, err
    assert "merged from ranks 0-1" in stdout
    sd = torch.load(out, weights_only=True)
    assert torch.equal(sd["w"], full_w)
    assert sd["b"].dtype == torch.bfloat16 and torch.equal(sd["b"], full_b)


def test_dataset_checksum_in_blocks_equals_whole(tmp_path: Path) -> None:
    data = np.random.default_rng(0).standard_normal((257, 33)).astype(np.float32)
    with h5py.File(tmp_path / "x.h5", "w") as h5:
        h5["d"] = data
        h5["s"] = np.float64(3.0)
        h5["e"] = np.zeros((0, 3), dtype=np.int8)
        for block in (1, 100, 4096, 1 << 30):
            assert dataset_checksum(h5["d"], block) == checksum(data)
        assert dataset_checksum(h5["s"], 1) == checksum(np.float64(3.0).tobytes())
        assert dataset_checksum(h5["e"], 1) == checksum(b"")

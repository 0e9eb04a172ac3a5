"""The benchmarks run end to end at tiny sizes and write JSON with every ratio they promise.

Each launches itself under the venv's mpiexec (2 ranks); a hang is bounded by the timeout.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 300


def _run(script: str, out: Path, *args: str) -> dict[str, Any]:
    cmd = [sys.executable, str(ROOT / "bench" / script), *args, "--out", str(out)]
    res = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert res.returncode == 0, f"{cmd} exited {res.returncode}\n{res.stdout}\n{res.stderr}"
    name = script.replace(".py", ".json")
    report: dict[str, Any] = json.loads((out / name).read_text())
    report["_stdout"] = res.stdout
    return report


def _positive(values: dict[str, Any], keys: list[str]) -> None:
    for key in keys:
        assert key in values, f"{key} missing from {sorted(values)}"
        v = values[key]
        assert isinstance(v, (int, float)) and math.isfinite(v) and v > 0, (key, v)


@pytest.mark.timeout(TIMEOUT + 30)
def test_hdf5_vs_dcp_quick(tmp_path: Path) -> None:
    rep = _run("hdf5_vs_dcp.py", tmp_path, "--quick", "--ranks", "2")
    _positive(rep["ratios"], ["ftkit_hdf5_save/torch_dcp_save",
                              "ftkit_hdf5_load/torch_dcp_load",
                              "ftkit_save_total/torch_dcp_save",
                              "ftkit_hdf5_save/torch_save", "ftkit_hdf5_load/torch_load",
                              "ftkit_hdf5_save/fs_write", "ftkit_hdf5_load/fs_read",
                              "torch_dcp_save/fs_write", "torch_dcp_load/fs_read"])
    if "torch_dcp_async_save" not in rep["skipped"]:
        _positive(rep["ratios"], ["ftkit_hdf5_save/torch_dcp_async_save"])
    methods = ["ftkit_hdf5_save", "ftkit_hdf5_load", "ftkit_save_total", "torch_dcp_save",
               "torch_dcp_load", "torch_save", "torch_load", "fs_write", "fs_read"]
    _positive(rep["seconds"], methods)
    _positive(rep["gb_per_s"], methods)
    assert rep["goal"]["ratio"] == 1.5
    assert set(rep["goal"]["met"]) == {"ftkit_hdf5_save", "ftkit_hdf5_load"}
    machine = rep["machine"]
    assert machine["ranks"] == 2 and machine["cores"] >= 1
    assert isinstance(machine["oversubscribed"], bool) and machine["torch"]
    assert "--quick" in rep["command"]
    for name in ("ftkit_hdf5_save", "ftkit_hdf5_load"):
        line = next(ln for ln in rep["_stdout"].splitlines() if ln.startswith(name + ":"))
        assert "GB/s" in line and "goal >= 1.5" in line, line


@pytest.mark.timeout(TIMEOUT + 30)
def test_redundancy_tiny(tmp_path: Path) -> None:
    rep = _run("redundancy.py", tmp_path, "--ranks", "2", "--size-mib", "1", "--repeat", "1")
    for key in ("ratio_to_p2p", "ratio_to_min_p2p_tmpfs"):
        _positive(rep[key], ["partner", "xor", "rs"])
    _positive(rep["gb_per_s"], ["p2p", "tmpfs_write", "partner", "xor", "rs"])
    _positive(rep["level_costs_s"], ["partner", "xor", "rs"])


@pytest.mark.timeout(TIMEOUT + 30)
def test_hp_overlap_tiny(tmp_path: Path) -> None:
    rep = _run("hp_overlap.py", tmp_path, "--steps", "4", "--hidden", "32", "--seq", "16")
    results = rep["results"]
    assert set(results) == {"none", "local", "local+partner", "local+partner+pfs",
                            "local+partner sync"}
    assert not results["local+partner sync"]["async"] and results["local"]["async"]
    for name, r in results.items():
        _positive(r, ["iter_s", "ratio_to_none", "state_mib"])
        assert r["blocked_s_per_step"] >= 0 and r["blocked_fraction"] >= 0, (name, r)
    assert results["local"]["blocked_s_per_step"] > 0      # saves did run and were timed
    assert rep["cores_training"] == 2 and rep["cores_left"] >= 0
    assert "ratio to none" in rep["_stdout"] and "left to the background" in rep["_stdout"]

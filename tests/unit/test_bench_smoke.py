"""The benchmarks run end to end at tiny sizes and write JSON with every ratio they promise.

``bench/run.py --smoke`` runs every part once (module fixture); the tests check its parts,
its figures and its plots. Each part launches itself under the venv's mpiexec; a hang is
bounded by the timeout.
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
# bench/run.py --smoke runs every part, each under mpiexec (the recovery part under
# `ftkit run`): minutes, and real jobs, so scripts/test.sh --fast leaves it out
pytestmark = [pytest.mark.slow, pytest.mark.e2e]
RUN_TIMEOUT = 1200


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


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``bench/run.py --smoke``: its run.json plus stdout, and the output directory."""
    out = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, str(ROOT / "bench" / "run.py"), "--smoke", "--out", str(out)]
    res = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True,
                         timeout=RUN_TIMEOUT)
    assert res.returncode == 0, f"{cmd} exited {res.returncode}\n{res.stdout}\n{res.stderr}"
    report: dict[str, Any] = json.loads((out / "run.json").read_text())
    report["_stdout"], report["_out"] = res.stdout, out
    return report


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_run_has_every_named_ratio_and_plots(smoke: dict[str, Any]) -> None:
    figs = smoke["figures"]
    bounds = {"memcpy", "tmpfs_write", "disk_write_fsync", "p2p_same_node", "p2p_tcp"}
    assert {f"bound[{b}]" for b in bounds} <= set(figs), sorted(figs)
    want = {"save[local, 1 MiB]": "tmpfs_write", "save[partner, 1 MiB]": "p2p_same_node",
            "save[xor, 1 MiB]": "p2p_same_node",
            "peer[ftkit_hdf5_save]": "torch_dcp_save", "peer[ftkit_hdf5_load]": "torch_dcp_load",
            "restore speed-up[local vs pfs, 1 MiB]": "1",
            "restore speed-up[partner vs pfs, 1 MiB]": "1",
            "protocol[local, n=4]": "n=2", "recovery[pfs_only, total_s]": "local_partner",
            "hp blocked[local+partner]": "iteration"}
    for name, to in want.items():
        fig = figs[name]
        assert fig["to"] == to and math.isfinite(fig["ratio"]), (name, fig)
    goals = {n: f["goal"] for n, f in figs.items() if f["goal"] is not None}
    assert goals["save[local, 1 MiB]"] == 0.8 and goals["save[partner, 1 MiB]"] == 0.7
    assert goals["peer[ftkit_hdf5_save]"] == 1.5 and goals["hp blocked[local+partner]"] == 0.01
    assert all(isinstance(f["met"], bool) for n, f in figs.items() if n in goals)
    for phase in ("detection_s", "relaunch_s", "discovery_s", "rebuild_s", "load_s",
                  "first_step_s"):
        assert figs[f"recovery[local_partner, {phase}]"]["value"] >= 0
    assert figs["recovery[local_partner, rebuild_s]"]["value"] > 0     # a node was rebuilt
    for png in ("levels.png", "peers.png", "protocol.png", "recovery.png"):
        data = (smoke["_out"] / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png
    assert smoke["machine"]["cores"] >= 1 and smoke["mode"] == "smoke"
    assert "ratio to tmpfs_write" in smoke["_stdout"] and "goal >= 0.7" in smoke["_stdout"]


def test_hdf5_vs_dcp_part(smoke: dict[str, Any]) -> None:
    rep = dict(smoke["parts"]["hdf5_vs_dcp"])
    rep["_stdout"] = smoke["_stdout"]
    _positive(rep["ratios"], ["ftkit_hdf5_save/torch_dcp_save",
                              "ftkit_hdf5_load/torch_dcp_load",
                              "ftkit_save_total/torch_dcp_save",
                              "ftkit_hdf5_save/torch_save", "ftkit_hdf5_load/torch_load",
                              "ftkit_hdf5_save/fs_write", "ftkit_hdf5_load/fs_read",
                              "torch_dcp_save/fs_write", "torch_dcp_load/fs_read"])
    if "torch_dcp_async_save" not in rep["skipped"]:
        _positive(rep["ratios"], ["ftkit_hdf5_save/torch_dcp_async_save"])
    methods = ["ftkit_hdf5_save", "ftkit_hdf5_load", "ftkit_save_total", "torch_dcp_save",
               "torch_dcp_load", "torch_save", "torch_load", "fs_write", "fs_read",
               "fs_write_direct",
               "ftkit_local_load", "torch_dcp_save_threads"]
    _positive(rep["seconds"], methods)
    _positive(rep["gb_per_s"], methods)
    _positive(rep["seconds"], ["ftkit_pfs_stall", "iteration_plain",
                               "iteration_ftkit_pfs_save"])
    if "torch_dcp_async_save_blocking" not in rep["skipped"]:
        _positive(rep["seconds"], ["torch_dcp_async_save_blocking",
                                   "iteration_dcp_async_save"])
    assert rep["stall_state_bytes_per_rank"] > 0         # a trained MLP + Adam
    assert rep["statistic"].startswith("median")
    for name, (lo, hi) in rep["spread"].items():        # every figure: median of its rounds
        assert lo <= rep["seconds"][name] <= hi and len(rep["rounds"][name]) >= 1, name
    goals = rep["pfs_goals"]
    assert {"durable vs dcp save", "flush vs disk write+fsync", "cold restore vs dcp load",
            "node-local restore vs cold pfs restore",
            "leader memory in a flush (MiB)"} <= set(goals), goals
    bounds = {"node-local restore vs its bound", "node-local vs cold pfs ceiling"}
    assert bounds <= set(goals), goals
    for name, g in goals.items():          # a goal is met or not; a bound has neither
        assert g["ratio"] >= 0, (name, g)
        assert (g["goal"] is None and g["met"] is None) if name in bounds \
            else isinstance(g["met"], bool), (name, g)
    assert "posix_fadvise" in rep["machine"]["cold_reads"]
    large = smoke["parts"]["hdf5_vs_dcp_1g"]            # its own setting, same script
    assert large["machine"]["ranks"] == 2 and large["machine"]["ftkit_nodes"] == 2
    assert any(k.startswith("pfs[durable vs dcp save, ") for k in smoke["figures"])
    assert rep["goal"]["ratio"] == 1.5
    assert set(rep["goal"]["met"]) == {"ftkit_hdf5_save", "ftkit_hdf5_load"}
    machine = rep["machine"]
    assert machine["ranks"] == 2 and machine["cores"] >= 1
    assert isinstance(machine["oversubscribed"], bool) and machine["torch"]
    assert "--quick" in rep["command"]
    for name in ("ftkit_hdf5_save", "ftkit_hdf5_load"):
        line = next(ln for ln in rep["_stdout"].splitlines() if ln.startswith(name + ":"))
        assert "GB/s" in line and "goal >= 1.5" in line, line


def test_redundancy_part(smoke: dict[str, Any]) -> None:
    rep = smoke["parts"]["redundancy"]
    for key in ("ratio_to_p2p", "ratio_to_min_p2p_tmpfs"):
        _positive(rep[key], ["partner", "xor", "rs1", "rs"])
    _positive(rep["gb_per_s"], ["p2p", "tmpfs_write", "partner", "xor", "rs1", "rs"])
    _positive(rep["level_costs_s"], ["partner", "xor", "rs"])
    for key in ("rs_vs_xor_same_parity", "rs_vs_xor"):
        _positive(rep[key], ["median", "min", "max"])
    assert set(rep["rounds_s"]) == {"p2p", "tmpfs_write", "partner", "xor", "rs1", "rs"}
    assert smoke["figures"]["rs encode[1 parity, 1 MiB]"]["goal"] == 0.7


def test_levels_2ranks_part(smoke: dict[str, Any]) -> None:
    rep = smoke["parts"]["levels_2ranks"]
    assert rep["ranks"] == 2 and rep["settings"]["ranks_per_node"] == 1
    assert list(rep["levels"]) == ["local", "partner", "xor"]
    for level, goal in (("partner", 0.45), ("xor", 0.4)):
        fig = smoke["figures"][f"save vs min(p2p, memcpy)[{level}, 1 MiB, 2 ranks]"]
        assert fig["goal"] == goal and math.isfinite(fig["ratio"])
    fig = smoke["figures"]["restore[local, 1 MiB, 2 ranks]"]
    assert fig["goal"] == 0.4 and math.isfinite(fig["ratio"])
    fig = smoke["figures"]["save vs memcpy[local, 1 MiB, 2 ranks]"]
    assert fig["goal"] == 0.45 and math.isfinite(fig["ratio"])
    assert rep["warmup_saves"] == 2 and rep["save_vs_memcpy"]["local"]["1"]["median"] > 0


def test_hp_overlap_part(smoke: dict[str, Any]) -> None:
    rep = dict(smoke["parts"]["hp_overlap"])
    rep["_stdout"] = smoke["_stdout"]
    results = rep["results"]
    assert set(results) == {"none", "local", "local+partner", "local+partner every 5th",
                            "local+partner+pfs", "local+partner sync"}
    assert not results["local+partner sync"]["async"] and results["local"]["async"]
    for name, r in results.items():
        _positive(r, ["iter_s", "iter_p99_s", "ratio_to_none", "state_mib"])
        assert len(r["rounds"]) == 1 and r["overhead_p50"]["rounds"], (name, r)
        assert r["blocked_s_per_step"] >= 0 and r["blocked_fraction"] >= 0, (name, r)
    assert results["local"]["blocked_s_per_step"] > 0      # saves did run and were timed
    assert rep["cores_training"] == 2 and rep["cores_left"] >= 0
    assert "ratio to none" in rep["_stdout"] and "left to the background" in rep["_stdout"]
    assert smoke["figures"]["hp overhead p50[local+partner]"]["goal"] == 0.05
    assert smoke["figures"]["hp overhead p50[local+partner every 5th]"]["goal"] == 0.01


def test_memory_part(smoke: dict[str, Any]) -> None:
    rep = smoke["parts"]["memory"]
    assert rep["ranks"] == 2 and set(rep["per_rank_max"]) == {"sync", "async"}
    for figures in rep["per_rank_max"].values():
        # two node-local versions of the 1 MiB state at least (plus headers)
        assert figures["node_local_mib"] >= 2 * rep["state_mib"]
    assert smoke["figures"]["memory private[local:1 sync, 1 MiB]"]["goal"] == 0.1
    assert "save spread[local, 1 MiB, 2 ranks]" in smoke["figures"]

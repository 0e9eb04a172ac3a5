"""bench/_figures.py: the ratios and goal verdicts of bench/run.py, from synthetic parts."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import _figures

BOUNDS = {"gb_per_s": {"memcpy": 10.0, "tmpfs_write": 2.0, "disk_write_fsync": 0.5,
                       "p2p_same_node": 4.0, "p2p_tcp": 1.0}}
MIB64 = 64 * 2**20 / 1e9          # GB in 64 MiB
LEVELS = {
    "ranks": 4,
    "save_gb_per_s": {"local": {"1": 0.1, "64": 1.8}, "partner": {"64": 0.9},
                      "xor": {"64": 1.0}},
    "save_s": {"local": {"64": MIB64 / 1.8}},
    "increment_s": {"partner": {"64": MIB64 / 2.0}, "xor": {"64": MIB64 / 3.6}},
    "restore_s": {"local": {"64": 0.05}, "partner": {"64": 0.1}, "pfs": {"64": 1.0}},
    "restore_gb_per_s": {"local": {"64": 1.3}, "pfs": {"64": 0.07}},
}


def test_level_ratios_use_the_increment_over_local_and_the_matching_bound() -> None:
    figs = _figures.derive({"bounds": BOUNDS, "levels": LEVELS})
    local = figs["save[local, 64 MiB]"]
    assert local["to"] == "tmpfs_write" and local["ratio"] == pytest.approx(0.9)
    assert local["met"] is True                              # goal 0.8 of tmpfs
    partner = figs["save[partner, 64 MiB]"]
    assert partner["value"] == pytest.approx(2.0)            # from the increment, not 0.9
    assert partner["ratio"] == pytest.approx(0.5) and partner["met"] is False   # goal 0.7
    assert figs["save[xor, 64 MiB]"]["ratio"] == pytest.approx(0.9)
    restore = figs["restore[local, 64 MiB]"]          # a whole restore against memcpy
    assert restore["to"] == "memcpy" and restore["ratio"] == pytest.approx(0.13)
    assert restore["goal"] == 0.4 and restore["met"] is False
    assert figs["restore[pfs, 64 MiB]"]["ratio"] is None
    speed = figs["restore speed-up[local vs pfs, 64 MiB]"]
    assert speed["value"] == pytest.approx(20.0) and speed["met"] is True
    assert figs["restore speed-up[partner vs pfs, 64 MiB]"]["value"] == pytest.approx(10.0)


def test_peers_protocol_recovery_and_overlap() -> None:
    parts = {
        "hdf5_vs_dcp": {"gb_per_s": {"ftkit_hdf5_save": 0.3, "torch_dcp_save": 1.0},
                        "goal": {"pairs": {"ftkit_hdf5_save": "torch_dcp_save"}}},
        "protocol": {"save_s": {"local": {"2": 0.001, "8": 0.004}}},
        "recovery": {"scenarios": {"local_partner": {"total_s": 10.0},
                                   "pfs_only": {"total_s": 15.0}}},
        "hp_overlap": {"results": {"local+partner": {"iter_s": 0.2, "ratio_to_none": 1.1,
                                                     "blocked_s_per_step": 0.003}}},
    }
    figs = _figures.derive(parts)
    hdf5 = figs["peer[ftkit_hdf5_save]"]
    assert hdf5["ratio"] == pytest.approx(0.3) and hdf5["met"] is False
    assert figs["protocol[local, n=8]"]["ratio"] == pytest.approx(4.0)
    assert figs["recovery[pfs_only, total_s]"]["ratio"] == pytest.approx(1.5)
    blocked = figs["hp blocked[local+partner]"]
    assert blocked["ratio"] == pytest.approx(0.015) and blocked["met"] is False  # <= 1 %
    text = "\n".join(_figures.lines(figs))
    assert "peer[ftkit_hdf5_save]: 0.3 GB/s (ratio to torch_dcp_save = 0.3; goal >= 1.5: MISSED)" \
        in text


def test_rs_against_xor_and_the_two_rank_restore() -> None:
    """RS vs XOR from per-round medians (the goal on the same-parity figure only); the
    2-rank run of the levels part gets its own names."""
    red = {"gb_per_s": {"xor": 1.0, "rs1": 0.9, "rs": 0.4}, "shard_bytes_per_rank": 64 << 20,
           "parity_blocks": {"xor": 1, "rs1": 1, "rs": 2},
           "rs_vs_xor_same_parity": {"median": 0.8}, "rs_vs_xor": {"median": 0.35}}
    two = {**LEVELS, "ranks": 2, "restore_vs_memcpy": {"local": {"64": {"median": 0.5}}},
           "save_vs_memcpy": {"local": {"64": {"median": 0.4}}}}
    figs = _figures.derive({"bounds": BOUNDS, "redundancy": red, "levels_2ranks": two})
    same = figs["rs encode[1 parity, 64 MiB]"]
    assert same["ratio"] == pytest.approx(0.8) and same["goal"] == 0.7 and same["met"] is True
    two_parity = figs["rs encode[2 parity, 64 MiB]"]
    assert two_parity["ratio"] == pytest.approx(0.35) and two_parity["met"] is None
    restore = figs["restore[local, 64 MiB, 2 ranks]"]
    assert restore["ratio"] == pytest.approx(0.5) and restore["met"] is True
    assert "restore[local, 64 MiB]" not in figs
    save = figs["save vs memcpy[local, 64 MiB, 2 ranks]"]
    assert save["ratio"] == pytest.approx(0.4) and save["goal"] == 0.45 and save["met"] is False


def test_missing_parts_are_skipped() -> None:
    assert _figures.derive({}) == {}
    figs = _figures.derive({"levels": LEVELS})          # no bounds: values, no ratios
    assert figs["save[local, 64 MiB]"]["ratio"] is None


def test_performance_tables_match_the_committed_run() -> None:
    """docs/performance.md's tables are exactly those of bench/results/run.json."""
    import json
    root = Path(__file__).resolve().parents[2]
    run = json.loads((root / "bench" / "results" / "run.json").read_text())
    table = _figures.markdown(run["figures"])
    doc = (root / "docs" / "performance.md").read_text()
    assert table in doc, table
    costs = _figures.costs_markdown(run["parts"]["levels"])
    assert costs and costs in doc, costs
    assert run["mode"] in ("quick", "full") and run["machine"]["cores"] >= 1


def test_costs_table_shows_the_largest_size_of_each_operation() -> None:
    cost = {"passes": {"copy": 1.0, "hash": 1.0, "write": 1.0, "send": 0.0, "total": 3.0},
            "cpu_s": 0.0123, "peak_extra_mib": 2.5}
    part = {"save_costs": {"local": {"1": {**cost, "cpu_s": 9.0}, "64": cost}},
            "restore_costs": {"pfs": {"64": {**cost, "passes": {"read": 1.0, "total": 1.0}}}}}
    table = _figures.costs_markdown(part).splitlines()
    assert table[2] == "| save | local | 64 | 3 | copy 1, hash 1, write 1 | 0.0123 | 2.5 |"
    assert table[3] == "| restore | pfs | 64 | 1 | read 1 | 0.0123 | 2.5 |"
    assert len(table) == 4 and _figures.costs_markdown({}) == ""


def test_save_spread_and_memory_figures() -> None:
    """The spread of a level's save rounds around their median (goal <= 20 %), and the
    memory part's private / footprint / RSS figures as fractions of the state (the goal on
    a synchronous save's private memory only)."""
    two = {**LEVELS, "ranks": 2, "save_vs_memcpy": {"local": {"64": {"median": 0.5}}},
           "save_round_s": {"local": {"64": [0.10, 0.09, 0.13, 0.10, 0.11]}},
           "save_vs_bound": {"local": {"64": {"median": 0.4}},
                             "partner": {"64": {"median": 0.5}}}}
    mem = {"state_mib": 256, "per_rank_max": {
        "sync": {"peak_private_mib": 3.0, "node_local_mib": 512.0, "peak_rss_mib": 515.0},
        "async": {"peak_private_mib": 256.0, "node_local_mib": 512.0, "peak_rss_mib": 770.0}}}
    figs = _figures.derive({"levels_2ranks": two, "memory": mem})
    bound = figs["save vs min(p2p, memcpy)[partner, 64 MiB, 2 ranks]"]
    assert bound["ratio"] == pytest.approx(0.5) and bound["met"] is True    # goal 0.45
    assert "save vs min(p2p, memcpy)[local, 64 MiB, 2 ranks]" not in figs   # no goal there
    spread = figs["save spread[local, 64 MiB, 2 ranks]"]
    assert spread["value"] == pytest.approx(0.3) and spread["met"] is False
    private = figs["memory private[local:1 sync, 256 MiB]"]
    assert private["ratio"] == pytest.approx(3 / 256) and private["met"] is True
    assert figs["memory private[local:1 async, 256 MiB]"]["met"] is None
    assert figs["memory footprint[local:1 sync, 256 MiB]"]["ratio"] == pytest.approx(515 / 256)
    assert figs["memory rss[local:1 async, 256 MiB]"]["value"] == 770.0


def test_hp_overheads_from_alternating_rounds() -> None:
    """Each round's p50 / p99 against the same round's run without checkpoints; the
    figures are the medians over rounds, with goals on the p50 only."""
    import hp_overlap
    def run(p50: float, p99: float) -> dict[str, float]:
        return {"iter_s": p50, "iter_p99_s": p99, "blocked_s_per_step": 0.001,
                "state_mib": 4.0}
    rounds = {"none": [run(0.20, 0.30), run(0.25, 0.40), run(0.20, 0.30)],
              "local+partner": [run(0.22, 0.33), run(0.25, 0.50), run(0.21, 0.36)],
              "local+partner every 5th": [run(0.20, 0.30), run(0.26, 0.40), run(0.20, 0.3)]}
    results = hp_overlap.summarize(rounds)
    every = results["local+partner"]
    assert every["overhead_p50"]["median"] == pytest.approx(0.05)      # .10, .00, .05
    assert every["overhead_p99"]["median"] == pytest.approx(0.2)       # .10, .25, .20
    assert every["iter_s"] == pytest.approx(0.22)
    figs = _figures.overlap({"results": results})
    assert figs["hp overhead p50[local+partner]"]["met"] is True        # 0.05 <= 0.05
    assert figs["hp overhead p50[local+partner every 5th]"]["goal"] == 0.01
    assert figs["hp overhead p99[local+partner]"]["goal"] is None
    assert "hp overhead p50[none]" not in figs


def test_pfs_goal_figures_carry_their_goal_and_direction() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import hdf5_vs_dcp
    t = {"torch_dcp_save": 2.0, "ftkit_save_total": 4.0, "fs_write": 1.0,
         "ftkit_hdf5_save": 1.0, "torch_dcp_load": 3.0, "ftkit_hdf5_load": 2.0,
         "ftkit_pfs_stall": 0.05, "torch_dcp_async_save_blocking": 1.0,
         "ftkit_local_load": 0.25}
    part = {"gb_per_s": {}, "pfs_goals": hdf5_vs_dcp.pfs_goals(t, 40.0)}
    figs = _figures.derive({"hdf5_vs_dcp": part})
    durable = figs["pfs[durable vs dcp save]"]
    assert durable["ratio"] == pytest.approx(0.5) and durable["met"] is False   # >= 1.0
    assert figs["pfs[flush vs disk write+fsync]"]["met"] is True                # 1.0 >= 0.9
    assert figs["pfs[cold restore vs dcp load]"]["ratio"] == pytest.approx(1.5)
    stall = figs["pfs[stall vs dcp async_save stall]"]
    assert stall["ratio"] == pytest.approx(0.05) and stall["op"] == "<=" and stall["met"]
    assert figs["pfs[node-local restore vs cold pfs restore]"]["ratio"] == pytest.approx(8.0)
    assert "pfs[node-local vs cold pfs ceiling]" not in figs                  # not measured
    bounds = hdf5_vs_dcp.pfs_goals({**t, "local_read_verified": 0.2}, 0.0)
    ceiling = bounds["node-local vs cold pfs ceiling"]
    assert ceiling["ratio"] == pytest.approx(10.0) and ceiling["goal"] is None
    assert bounds["node-local restore vs its bound"]["ratio"] == pytest.approx(0.8)
    assert ceiling["met"] is None
    memory = figs["pfs[leader memory in a flush (MiB)]"]
    assert memory["value"] == 40.0 and memory["met"] is False                  # <= 16 MiB
    flush = hdf5_vs_dcp.pfs_goals({**t, "fs_write_direct": 0.5}, 0.0)["flush vs disk write+fsync"]
    assert flush["ratio"] == pytest.approx(0.5) and flush["met"] is False     # the faster bound
    part["pfs_goals"] = hdf5_vs_dcp.pfs_goals({"fs_write": 1.0}, 0.0)          # not measured
    assert [k for k in _figures.derive({"hdf5_vs_dcp": part}) if k.startswith("pfs[")] == \
        ["pfs[leader memory in a flush (MiB)]"]

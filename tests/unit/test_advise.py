"""ftkit advise: exact survival figures checked by Monte Carlo over the real placement."""
from __future__ import annotations

import json
import math
import random

import pytest

from ftkit.advise import advise, daly, schemes, survival_probability, young
from ftkit.cli.main import main
from ftkit.comm.placement import erasure_sets, partner_map
from ftkit.comm.topology import virtual_nodes


def _rank_level_fatal(name: str, failed: set[int], rank_node: list[int], xor_set: int,
                      rs_set: int, rs_parity: int) -> bool:
    """Independent check at rank level: is some rank's data gone everywhere?"""
    lost = {r for r, n in enumerate(rank_node) if n in failed}
    if name == "local":
        return bool(lost)
    if name == "pfs":
        return False
    if name == "partner":
        partners = partner_map(rank_node)
        return any(partners[r] in lost for r in lost)
    size, p = (xor_set, 1) if name == "xor" else (rs_set, rs_parity)
    sets = erasure_sets(rank_node, size, minimum=p + 1)
    return any(sum(r in lost for r in s) > p for s in sets)


@pytest.mark.parametrize("nodes,rpn", [(4, 2), (8, 2), (9, 3), (30, 1), (40, 2)])
def test_exact_survival_matches_monte_carlo(nodes: int, rpn: int) -> None:
    rng = random.Random(nodes * 100 + rpn)
    rank_node = virtual_nodes(nodes * rpn, rpn)
    trials = 4000
    for scheme in schemes(nodes, rpn, 4, 4, 2):
        for k in (1, 2, 3):
            exact = survival_probability(scheme, k)
            ok = sum(not _rank_level_fatal(scheme.name, set(rng.sample(range(nodes), k)),
                                           rank_node, 4, 4, 2) for _ in range(trials))
            sigma = math.sqrt(max(exact * (1 - exact), 1e-4) / trials)
            assert abs(ok / trials - exact) < 5 * sigma + 1e-9, (scheme.name, k, exact, ok)


def test_closed_forms() -> None:
    """A 40-node partner ring is a cycle: n/(n-k) C(n-k, k) safe k-sets."""
    partner = next(s for s in schemes(40, 1, 4, 4, 2) if s.name == "partner")
    for k in (1, 2, 3, 5):
        want = 40 * math.comb(40 - k, k) / (40 - k) / math.comb(40, k)
        assert survival_probability(partner, k) == pytest.approx(want)
    xor = next(s for s in schemes(8, 1, 4, 4, 2) if s.name == "xor")
    assert survival_probability(xor, 2) == pytest.approx(1 - 2 * math.comb(4, 2) / 28)
    rs = next(s for s in schemes(8, 1, 4, 4, 2) if s.name == "rs")
    assert survival_probability(rs, 2) == 1.0 and survival_probability(rs, 3) < 1.0


def test_intervals() -> None:
    assert young(2.0, 3600.0) == pytest.approx(math.sqrt(2 * 2 * 3600))
    assert daly(2.0, 3600.0) < young(2.0, 3600.0)
    rep = advise(16, 1000, ranks_per_node=2, costs={"partner": 1.5})
    partner = next(r for r in rep["schemes"] if r["scheme"] == "partner")  # type: ignore[union-attr]
    assert partner["young_s"] == pytest.approx(young(1.5, 1000 * 3600 / 16))
    assert "young_s" not in next(r for r in rep["schemes"]  # type: ignore[union-attr]
                                 if r["scheme"] == "xor")


def test_cli_table_json_and_measured(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"level_costs_s": {"xor": 2.5}}))
    assert main(["advise", "--nodes", "8", "--mtbf-hours", "100", "--ranks-per-node", "2",
                 "--measured", str(bench), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    xor = next(r for r in rep["schemes"] if r["scheme"] == "xor")
    assert xor["cost_s"] == 2.5 and xor["survive"]["2"] == pytest.approx(1 - 2 * 6 / 28)
    assert main(["advise", "--nodes", "8", "--mtbf-hours", "100"]) == 0
    out = capsys.readouterr().out
    assert "P(survive 2)" in out and "partner" in out
    assert main(["advise", "--nodes", "8", "--mtbf-hours", "100", "--measured",
                 str(tmp_path / "missing.json")]) == 2


def test_cli_says_what_is_not_possible_and_which_costs_it_used(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"level_costs_s": {"partner": 0.25, "pfs": 9.0}}))
    assert main(["advise", "--nodes", "3", "--mtbf-hours", "100", "--measured", str(bench),
                 "--cost", "pfs=4"]) == 0
    out = capsys.readouterr().out
    assert "xor      not possible here: a set of 4 members on distinct nodes needs >= 4 " \
           "nodes" in out and "rs       not possible here" in out, out
    assert f"checkpoint costs used: partner 0.25 s (measured: {bench}), pfs 4 s (--cost)" in out
    assert main(["advise", "--nodes", "1", "--mtbf-hours", "100", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [r["scheme"] for r in rep["not_possible"]] == ["partner", "xor", "rs"]
    assert rep["costs"] == {}
    assert main(["advise", "--nodes", "8", "--mtbf-hours", "100"]) == 0
    out = capsys.readouterr().out
    assert "not possible" not in out and "no checkpoint costs given" in out

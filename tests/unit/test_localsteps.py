"""``ftkit inspect`` / ``verify`` of node-local steps (the real entry point on real shards)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from ftkit.capture.flatten import flatten
from ftkit.capture.staging import Stager
from ftkit.cli.main import main
from ftkit.storage.shard import Shard, write_shard


def _shard(path: Path, rank: int, step: int, world: int = 4) -> None:
    tree, leaves = flatten({"model": {"w": torch.arange(12.0).reshape(3, 4) + rank,
                                      "b": torch.zeros(4, dtype=torch.bfloat16)}})
    path.parent.mkdir(parents=True, exist_ok=True)
    write_shard(path, {"job": "j", "step": step, "rank": rank, "world": world}, tree, leaves,
                Stager().capture(leaves))


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """``j/node-{0,1}/step-{4,5,6}``: 4 and 5 committed, 6 tentative (no COMMITTED)."""
    job = tmp_path / "local" / "j"
    for node, ranks in ((0, (0, 1)), (1, (2, 3))):
        for step in (4, 5, 6):
            d = job / f"node-{node}" / f"step-{step}"
            for rank in ranks:
                _shard(d / f"rank-{rank}.ftk", rank, step)
            _shard(d / f"partner-{(ranks[0] + 2) % 4}.ftk", (ranks[0] + 2) % 4, step)
            if step < 6:
                (d / "COMMITTED").write_text("{}")
    return job


def test_inspect_lists_steps_per_node_and_the_newest_tensors(
        tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tree)]) == 0
    out = capsys.readouterr().out
    assert "node-1  step 6  tentative  partner-0.ftk" in out, out
    assert "node-0 step 5 rank-1.ftk (rank 1 of 4):" in out and "model/b  bfloat16  (4,)" in out
    assert "step 4 rank-" not in out                    # only the newest committed step
    assert main(["inspect", str(tree / "node-1"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(s["node"], s["step"], s["state"]) for s in doc["steps"]] == [
        ("node-1", 4, "committed"), ("node-1", 5, "committed"), ("node-1", 6, "tentative")]
    assert [f["file"] for f in doc["steps"][0]["files"]] == ["partner-0.ftk", "rank-2.ftk",
                                                            "rank-3.ftk"]


def test_verify_finds_a_flipped_byte_and_a_planted_link(tree: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    assert main(["verify", str(tree)]) == 0
    out = capsys.readouterr().out
    assert out.count(": intact") == 4 and "step 6" not in out, out   # committed steps only
    victim = tree / "node-1" / "step-5" / "rank-3.ftk"
    with Shard.open(victim) as shard:
        offset = shard.tensors[0]["offset"]
    data = bytearray(victim.read_bytes())
    data[offset] ^= 0x40
    victim.write_bytes(bytes(data))
    elsewhere = tmp_path / "elsewhere.ftk"
    _shard(elsewhere, 0, 4)
    planted = tree / "node-0" / "step-4" / "rank-0.ftk"
    planted.unlink()
    os.symlink(elsewhere, planted)
    assert main(["verify", str(tree)]) == 1
    out = capsys.readouterr().out
    assert "node-1 step 5 (committed): 3 file(s)" in out and "1 bad file(s)" in out, out
    assert "rank-3.ftk: checksum mismatch in 1 tensor(s): model/w" in out, out
    assert "rank-0.ftk:" in out and "symbolic link" in out, out
    assert main(["verify", str(tree / "node-0" / "step-6")]) == 0     # a step dir, tentative
    assert "node-0 step 6 (tentative)" in capsys.readouterr().out
    assert main(["verify", str(tree), "--step", "9"]) == 2
    assert main(["export", str(tree), "--out", str(tmp_path / "x.pt")]) == 2

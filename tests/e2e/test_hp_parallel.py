"""Hybrid-parallel GPT example (examples/hp_gpt.py) under ``ftkit run``.

* Layouts agree: DP x TP x PP runs start from the same model and see the same global batches,
  so their per-step losses match the single-rank run up to float summation order.
* Their checkpoints agree: the example declares its TP slices (``ftkit.declare_shard``), so
  ``ftkit export`` of the last step (on the PFS) gives the same global tensors, parameters and
  Adam state, named by parameter, whatever the layout.
* A checkpoint moves between layouts: dp2 tp2 pp2's PFS step 15, restored on 1, 4 and 8 ranks
  of other layouts, continues with the losses and Adam state of that layout's own run.
(Bit-exact resume within one layout after faults: test_hp_faults.py.)

Each run starts 1 or 8 Python ranks; on a 2-core box a 1-rank run of 20 steps takes ~5 s, an
8-rank one ~25 s (most of it 8 processes importing torch).
"""
from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.jobs import FTKIT, Result, run_example

STEPS = 20
SEED = 3
LEVELS = "local:1,partner:1,pfs:5"      # the PFS keeps steps 15 and 20 (20 is exported)
# Layouts differ only in float summation order (TP all-reduces, DP all-reduce, micro-batch
# grouping). Measured max relative loss difference against dp1 tp1 pp1 over 20 steps (seed 3,
# CPU/gloo): 1.19e-7 for dp2 tp2 pp2 (4.2e-7 absolute), 8.1e-8 for dp4 tp1 pp2; 5 steps of
# dp1 tp4 pp2, dp2 tp1 pp4, dp1 tp2 pp4, dp8 and 4 micro-batches all stay below 1.1e-7.
# The tolerance is ~100x above that.
REL_TOL = 1e-5
# The exported parameters and Adam moments of dp2 tp2 pp2 after 20 steps against dp1 tp1 pp1,
# largest difference relative to each tensor's largest magnitude: measured 8.8e-4, for the
# zero-initialised QKV bias (20 Adam steps normalise its tiny gradients, summation-order noise
# included); weights stay far closer. A misplaced chunk differs by O(1) (other rows of a random
# init), so this tolerance still catches any wrong assembly.
EXPORT_TOL = 1e-2

Layout = tuple[int, int, int]
RunLayout = Callable[..., Result]


def launch(tmp: Path, layout: Layout, *extra: str, steps: int = STEPS) -> Result:
    dp, tp, pp = layout
    n = dp * tp * pp
    env = {"FTKIT_LEVELS": LEVELS if n > 1 else "local:1,pfs:5"}
    args = ("--dp", str(dp), "--tp", str(tp), "--pp", str(pp), "--steps", str(steps),
            "--seed", str(SEED), "--global-batch", "16", "--micro-batches", "2", *extra)
    return run_example(tmp, "hp_gpt.py", n=n, args=args, ranks_per_node=2, env=env)


def losses(res: Result) -> list[tuple[int, float]]:
    """(step, loss) of every step line, in print order (a relaunch repeats some steps)."""
    return [(r["step"], r["loss"]) for r in res.json_lines() if r.get("event") == "step"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> RunLayout:
    """``reference(layout)``: the failure-free run of ``layout`` (cached per module)."""
    cache: dict[Layout, Result] = {}

    def get(layout: Layout) -> Result:
        if layout not in cache:
            tmp = tmp_path_factory.mktemp("hp-" + "-".join(map(str, layout)))
            res = launch(tmp, layout)
            assert res.rc == 0, res.tail()
            assert [s for s, _ in losses(res)] == list(range(1, STEPS + 1)), res.tail()
            cache[layout] = res
        return cache[layout]
    return get


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", [(2, 2, 2), (4, 1, 2)], ids=["dp2tp2pp2", "dp4tp1pp2"])
def test_layouts_agree(layout: Layout, reference: RunLayout) -> None:
    single = [loss for _, loss in losses(reference((1, 1, 1)))]
    res = reference(layout)
    assert res.starts[0]["layout"] == dict(zip(("dp", "tp", "pp"), layout)), res.starts
    hybrid = [loss for _, loss in losses(res)]
    assert single[-1] < single[0] - 1.0, single          # it learns (measured 4.87 -> 3.01)
    worst = max(abs(a - b) / abs(a) for a, b in zip(single, hybrid))
    assert worst <= REL_TOL, (worst, single, hybrid)



def export(res: Result, out: Path) -> dict[str, Any]:
    """``ftkit export`` of the job's newest PFS step, loaded."""
    import torch
    proc = subprocess.run([*FTKIT, "export", str(res.pfs / "e2e"), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "step 20:" in proc.stdout, proc.stdout
    return dict(torch.load(out, weights_only=True))


@pytest.mark.timeout(900)
def test_exports_agree(reference: RunLayout, tmp_path: Path) -> None:
    """dp2 tp2 pp2's last step, assembled by ``export`` from 4 ranks' declared TP slices
    (fused QKV included) and 2 pipeline stages, is the single rank's model and Adam state:
    the same names, shapes and dtypes, values equal up to the layouts' float summation
    order. RNG state is per rank and the loader position a step count: not compared."""
    single = export(reference((1, 1, 1)), tmp_path / "single.pt")
    hybrid = export(reference((2, 2, 2)), tmp_path / "hybrid.pt")
    keys = sorted(k for k in single if k.startswith(("model/", "optim/")))
    assert keys == sorted(k for k in hybrid if k.startswith(("model/", "optim/")))
    assert "model/blocks.3.qkv_w" in keys and "optim/state/model/head.w/exp_avg" in keys
    worst = {}
    for key in keys:
        a, b = single[key], hybrid[key]
        assert (a.dtype, a.shape) == (b.dtype, b.shape), key
        scale = a.abs().max().item() or 1.0
        worst[key] = (a - b).abs().max().item() / scale
    print("export differences (largest 3):", sorted(worst.items(), key=lambda kv: -kv[1])[:3])
    assert max(worst.values()) <= EXPORT_TOL, sorted(worst.items(), key=lambda kv: -kv[1])[:5]


RESHARD_TARGETS = [(1, 1, 1), (2, 1, 2), (1, 2, 2), (4, 2, 1)]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("target", RESHARD_TARGETS,
                         ids=["dp1tp1pp1", "dp2tp1pp2", "dp1tp2pp2", "dp4tp2pp1"])
def test_reshard_on_restore(target: Layout, reference: RunLayout, tmp_path: Path) -> None:
    """dp2 tp2 pp2's PFS step 15 (8 ranks) restored on ``target``: every target rank reads
    the saved pieces of its own slices (other TP cuts, other pipeline stages, fused QKV),
    and the run continues with the losses of ``target``'s own uninterrupted run within
    REL_TOL; its Adam moments at step 20 equal that run's (an Adam state reset at the
    restore would leave exp_avg at 1 - 0.9^5 = 41 % of its value). dp4 tp2 pp1 has the
    saved world size: it also finds the saved layout's node-local steps 19 and 20, which it
    must not load (their shards hold dp2 tp2 pp2's slices)."""
    saved = reference((2, 2, 2))
    moved = tmp_path / "moved"
    same_world = target[0] * target[1] * target[2] == 8     # the saved local steps apply too
    if same_world:
        (moved / "local").mkdir(mode=0o700, parents=True)     # node-local dirs are private
        shutil.copytree(saved.local, moved / "local" / "e2e")
    shutil.copytree(saved.pfs, moved / "pfs")
    shutil.rmtree(moved / "pfs" / "e2e" / "step-20")
    res = launch(moved, target)
    assert res.rc == 0, res.tail()
    assert res.starts[0]["step"] == 15, res.tail()
    assert res.starts[0]["layout"] == dict(zip(("dp", "tp", "pp"), target)), res.starts
    assert "restored step 15 from the PFS level" in res.stderr, res.tail()
    dp, tp, pp = target
    said = (f"resharded from the saved shards: 8 ranks (dp2 tp2 pp2) -> {dp * tp * pp} ranks "
            f"(dp{dp} tp{tp} pp{pp})")
    assert said in res.stderr, res.tail()
    if same_world:                         # the old layout's newer local step, kept aside
        assert "parked as parked-step-20" in res.stderr, res.tail()
    own = dict(losses(reference(target)))
    resumed = losses(res)
    assert [s for s, _ in resumed] == list(range(16, STEPS + 1)), res.tail()
    worst = max(abs(loss - own[s]) / abs(own[s]) for s, loss in resumed)
    assert worst <= REL_TOL, (worst, resumed, own)
    mine = export(res, tmp_path / "resumed.pt")
    theirs = export(reference(target), tmp_path / "own.pt")
    moments = [k for k in theirs if k.startswith("optim/state/") and k.endswith("exp_avg")]
    assert "optim/state/model/blocks.3.qkv_w/exp_avg" in moments, sorted(theirs)
    for key in moments + [k.replace("exp_avg", "exp_avg_sq") for k in moments]:
        a, b = theirs[key], mine[key]
        scale = a.abs().max().item() or 1.0
        assert (a - b).abs().max().item() / scale <= EXPORT_TOL, key



@pytest.mark.timeout(900)
def test_seed_from_a_torch_dcp_checkpoint(reference: RunLayout, tmp_path: Path) -> None:
    """dp1 tp1 pp1's model at step 20 saved by torch's own ``dcp.save`` on 2 ranks (rows
    sharded as DTensors: tests/e2e/dcp_writer.py) seeds two new jobs with ``--init-from``:
    one rank, and dp1 tp2 pp2 on 4 ranks (each rank cuts its TP slices and pipeline stage
    from the 2 saved shards). Both start at step 0 from that model (a ``seed`` event, no
    tensor missing) and their first losses agree within REL_TOL, far below a fresh job's
    first loss (the untrained model: measured 4.87)."""
    import os
    import sys

    from ftkit.jobdir.events import read_events
    from ftkit.launch.mpiexec import MpiexecLauncher
    model = tmp_path / "model.pt"
    proc = subprocess.run([*FTKIT, "export", str(reference((1, 1, 1)).pfs / "e2e"), "--only",
                           "model", "--out", str(model)], capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    saved = tmp_path / "torch-dcp"
    mpi = MpiexecLauncher.detect(None, os.environ, ())
    writer = subprocess.run(
        mpi.command(2, [sys.executable, str(Path(__file__).with_name("dcp_writer.py")),
                        str(model), str(saved)]),
        env=mpi.environ(dict(os.environ)), capture_output=True, text=True, timeout=300,
        check=False)
    assert writer.returncode == 0, writer.stderr[-3000:]
    first = {}
    for layout in ((1, 1, 1), (1, 2, 2)):
        tmp = tmp_path / "-".join(map(str, layout))
        tmp.mkdir()
        res = launch(tmp, layout, "--init-from", str(saved), steps=1)
        assert res.rc == 0, res.tail()
        assert res.starts[0]["step"] == 0, res.tail()
        [seeded] = [e for e in read_events(tmp / "pfs" / "e2e" / "events.jsonl")
                    if e["event"] == "seed"]
        assert seeded["tensors"] > 0 and seeded["missing"] == [], seeded
        first[layout] = losses(res)[0][1]
    fresh = losses(reference((1, 1, 1)))[0][1]
    a, b = first[(1, 1, 1)], first[(1, 2, 2)]
    assert abs(a - b) / abs(a) <= REL_TOL, first
    assert a < fresh - 1.0, (first, fresh)          # the trained model, not a fresh one

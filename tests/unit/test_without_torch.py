"""A code that is MPI and NumPy only: ftkit saves and restores its state without importing
torch (a checkpoint of NumPy arrays once failed with ``KeyError: 'torch'`` when torch had
never been imported). Runs in a fresh interpreter: this one has torch loaded."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import json, random, sys
import numpy as np
from mpi4py import MPI
import ftkit

def state(fill):
    return {"model": {"w": np.full((3, 4), fill), "b": np.full(4, fill, dtype=np.float32)},
            "optim": {"t": np.full(1, int(fill), dtype=np.int64)}, "rng": ftkit.RNGState()}

np.random.seed(5)
random.seed(5)
ckpt = ftkit.Checkpointer(ftkit.Topology.create(MPI.COMM_WORLD))
first = ckpt.restore(state(0.0))
live = state(0.0)
for step in (1, 2):
    for a in (live["model"]["w"], live["model"]["b"], live["optim"]["t"]):
        a += 1
    ckpt.save(step, live)
draw = np.random.random()             # what the generator gives right after step 2's save
ckpt.close()

np.random.seed(99)
back = state(-1.0)
ckpt = ftkit.Checkpointer(ftkit.Topology.create(MPI.COMM_WORLD))
resumed = ckpt.restore(back)
ckpt.close()
print(json.dumps({"first": first, "resumed": resumed,
                  "w": back["model"]["w"].tolist(), "b": back["model"]["b"].tolist(),
                  "t": back["optim"]["t"].tolist(), "same_draw": np.random.random() == draw,
                  "torch": "torch" in sys.modules}))
"""


def test_numpy_state_saved_and_restored_without_torch(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTKIT_")}
    env.update(FTKIT_JOB="np", FTKIT_LOCAL_DIR=str(tmp_path / "local"),
               FTKIT_PFS_DIR=str(tmp_path / "pfs"), FTKIT_LEVELS="local:1,pfs:2",
               FTKIT_TIMEOUT="30", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["first"] == 0 and out["resumed"] == 2, out
    assert out["w"] == [[2.0] * 4] * 3 and out["b"] == [2.0] * 4 and out["t"] == [2], out
    assert out["same_draw"], "NumPy's generator was not restored"
    assert not out["torch"], "ftkit imported torch for a NumPy-only state"
    assert (tmp_path / "pfs" / "np" / "step-2" / "COMMITTED").is_file()

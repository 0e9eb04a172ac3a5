"""The toy example, with a PFS that is freed mid-run: rank 0 deletes ``$FREE_BALLAST`` right
before the save of step ``$FREE_AT`` (as an operator cleaning up a full file system would).

    ftkit run -n 4 -- python tests/e2e/free_pfs_at.py --steps 16
"""
from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path
from typing import Any

import ftkit

TOY = Path(__file__).resolve().parents[2] / "examples" / "toy_dp.py"
_save = ftkit.Checkpointer.save


def save(self: ftkit.Checkpointer, step: int, state: Any) -> Any:
    if step == int(os.environ["FREE_AT"]) and self.topo.rank == 0:
        Path(os.environ["FREE_BALLAST"]).unlink(missing_ok=True)
    return _save(self, step, state)


ftkit.Checkpointer.save = save  # type: ignore[method-assign]
sys.argv = [str(TOY), *sys.argv[1:]]
runpy.run_path(str(TOY), run_name="__main__")

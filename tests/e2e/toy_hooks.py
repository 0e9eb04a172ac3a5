"""The toy example with hooks an end-to-end test drives, run by rank 0 right before the save of
a given step (environment variables; each hook is off when its variables are unset):

* ``FREE_AT`` / ``FREE_BALLAST``: delete the file ``FREE_BALLAST`` (a PFS freed mid-run, as an
  operator cleaning up a full file system would);
* ``FILL_AT`` / ``FILL_BALLAST``: write zeros into the file ``FILL_BALLAST`` until its file
  system is full (a PFS that fills up mid-run);
* ``HOLD_AT`` / ``HOLD_UNTIL``: wait until the previous step is committed, create
  ``HOLD_UNTIL.held``, then wait until the file ``HOLD_UNTIL`` exists (the job holds still,
  mid-run, while the test acts; the other ranks wait in the next collective).

    ftkit run -n 4 -- python tests/e2e/toy_hooks.py --steps 16
"""
from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

import ftkit

TOY = Path(__file__).resolve().parents[2] / "examples" / "toy_dp.py"
_save = ftkit.Checkpointer.save


def _at(name: str, step: int) -> bool:
    return os.environ.get(name, "") == str(step)


def save(self: ftkit.Checkpointer, step: int, state: Any) -> Any:
    if self.topo.rank == 0 and _at("FREE_AT", step):
        Path(os.environ["FREE_BALLAST"]).unlink(missing_ok=True)
    if self.topo.rank == 0 and _at("FILL_AT", step):
        self.wait()                   # the flush before it is durable first
        _fill(Path(os.environ["FILL_BALLAST"]))
    if self.topo.rank == 0 and _at("HOLD_AT", step):
        until = Path(os.environ["HOLD_UNTIL"])
        self.wait()                   # local: the previous step's commit (no PFS level)
        until.with_name(until.name + ".held").touch()
        while not until.exists():
            time.sleep(0.05)
    return _save(self, step, state)


def _fill(ballast: Path) -> None:
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for chunk in (b"\0" * (1 << 20), b"\0" * 4096):
            try:
                while os.write(fd, chunk) == len(chunk):
                    pass
            except OSError:
                pass
    finally:
        os.close(fd)


ftkit.Checkpointer.save = save  # type: ignore[method-assign]
sys.argv = [str(TOY), *sys.argv[1:]]
runpy.run_path(str(TOY), run_name="__main__")

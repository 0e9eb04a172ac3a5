"""Shared plumbing of the MPI benchmarks: relaunch under the venv's mpiexec, common options."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path


def parser(doc: str) -> argparse.ArgumentParser:
    """Options every MPI benchmark takes (``--child`` marks the relaunched ranks)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--size-mib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return ap


def run(script: str, args: argparse.Namespace, child: Callable[[argparse.Namespace], None]
        ) -> None:
    """In a rank: run ``child``. Otherwise relaunch ``script`` on ``args.ranks`` ranks with
    the venv's mpiexec (root and oversubscription flags set) and exit with its status."""
    if args.child:
        child(args)
        return
    mpiexec = Path(sys.executable).with_name("mpiexec")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("FTKIT_RANKS_PER_NODE", None)       # each benchmark sets its own topology
    cmd = [str(mpiexec), "--oversubscribe", "--bind-to", "none", "-n", str(args.ranks),
           sys.executable, "-m", "mpi4py", script, *sys.argv[1:], "--child"]
    sys.exit(subprocess.call(cmd, env=env, timeout=1800))

"""Suite-wide test tiers.

Every test under ``tests/e2e`` launches real jobs (``ftkit run``, ``sbatch``), so it gets the
``e2e`` marker here, without a decorator in each file. ``scripts/test.sh --fast`` deselects
``e2e`` and ``slow``: what is left is the unit tests and the MPI tier
(``tests/test_mpi_tier.py`` running ``tests/mpi`` under ``mpiexec -n 4``).

This file is also loaded by the ranks of the MPI tier: it must stay import-light (no mpi4py,
no torch).
"""
from __future__ import annotations

from pathlib import Path

import pytest

E2E_DIR = Path(__file__).resolve().parent / "e2e"


def _under(path: Path, directory: Path) -> bool:
    return directory in path.resolve().parents


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test collected from ``tests/e2e`` with ``e2e``."""
    for item in items:
        if _under(Path(str(item.path)), E2E_DIR):
            item.add_marker(pytest.mark.e2e)

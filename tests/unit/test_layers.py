"""ftkit's layers import downward only and no module imports itself through others:
import-linter's two contracts in pyproject.toml hold (``lint-imports``), and ``import ftkit`` loads none of the launcher, Slurm or CLI modules."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_layer_contract_holds() -> None:
    pytest.importorskip("importlinter", reason="import-linter is not installed")
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe is not None
    res = subprocess.run([exe], check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken." in res.stdout, res.stdout[-2000:]
    assert "no import cycles" in res.stdout and "KEPT" in res.stdout, res.stdout[-2000:]


def test_import_ftkit_loads_no_launcher_slurm_or_cli_module() -> None:
    code = ("import sys, ftkit; print(' '.join(sorted(m for m in sys.modules "
            "if m == 'ftkit' or m.startswith('ftkit.'))))")
    res = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    loaded = res.stdout.split()
    upper = [m for m in loaded if m.startswith(("ftkit.launch.", "ftkit.slurm", "ftkit.cli"))]
    assert upper == [], upper
    stated = re.search(r"loads (\d+) of ftkit's modules",
                       (ROOT / "docs" / "architecture.md").read_text())
    assert stated is not None and int(stated.group(1)) == len(loaded), (
        f"docs/architecture.md states {stated and stated.group(1)} modules, "
        f"import ftkit loads {len(loaded)}: {loaded}")

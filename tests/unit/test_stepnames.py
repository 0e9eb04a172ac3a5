"""Step directory names (ftkit.storage.stepnames): only canonical names count, so a name
never stands for a step whose directory has another name, and no name raises."""
from __future__ import annotations

from pathlib import Path

import pytest

from ftkit.storage.stepnames import PARKED, step_dirs, step_name, step_number


@pytest.mark.parametrize("name,step", [
    ("step-0", 0), ("step-7", 7), ("step-123456789012345678", 123456789012345678)])
def test_canonical_names_round_trip(name: str, step: int) -> None:
    assert step_number(name) == step and step_name(step) == name


@pytest.mark.parametrize("name", [
    "step-", "step-03", "step-+3", "step--3", "step-3 ", " step-3", "step-3a", "step-²",
    "step-\u0663", "step-1234567890123456789", "Step-3", "steps-3", "parked-step-3", "step-3.tmp"])
def test_other_names_are_foreign(name: str) -> None:
    assert step_number(name) is None


def test_parked_names() -> None:
    assert step_number("parked-step-9", PARKED) == 9 and step_name(9, PARKED) == "parked-step-9"
    assert step_number("step-9", PARKED) is None


def test_step_dirs_lists_real_directories_only(tmp_path: Path) -> None:
    for name in ("step-10", "step-2", "step-02", "step-\u0663", "parked-step-4"):
        (tmp_path / name).mkdir()
    (tmp_path / "step-5").write_bytes(b"a file")
    (tmp_path / "step-6").symlink_to(tmp_path / "step-10")
    assert step_dirs(tmp_path) == [(2, tmp_path / "step-2"), (10, tmp_path / "step-10")]
    assert step_dirs(tmp_path, PARKED) == [(4, tmp_path / "parked-step-4")]
    assert step_dirs(tmp_path / "missing") == []

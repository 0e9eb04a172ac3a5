"""Step directory names, ``step-<s>`` and ``parked-step-<s>``: one parser for every reader
(the levels, ``ftkit inspect/verify/status``).

A name counts only in its canonical form (ASCII digits, no sign, no leading zero, at most 18
digits), so that ``step_name(step_number(name)) == name``: ``step-03``, ``step-٣`` (a
non-ASCII digit, which ``int`` would accept) or ``step-²`` (``isdigit`` but not a number) are
foreign entries, never another name of step 3 and never an exception. This module imports
nothing of ftkit.
"""
from __future__ import annotations

import os
from pathlib import Path

STEP = "step-"
PARKED = "parked-step-"
MAX_DIGITS = 18


def step_name(step: int, prefix: str = STEP) -> str:
    """``step-<step>`` (or ``<prefix><step>``)."""
    return f"{prefix}{step}"


def step_number(name: str, prefix: str = STEP) -> int | None:
    """The step a canonical ``<prefix><s>`` name stands for; None for any other name."""
    if not name.startswith(prefix):
        return None
    digits = name[len(prefix):]
    if not (0 < len(digits) <= MAX_DIGITS and digits.isascii() and digits.isdigit()):
        return None
    if len(digits) > 1 and digits[0] == "0":
        return None
    return int(digits)


def step_dirs(root: Path, prefix: str = STEP) -> list[tuple[int, Path]]:
    """``(step, path)`` of every real directory (not a link) directly under ``root`` with a
    canonical ``<prefix><s>`` name, ascending; [] when ``root`` cannot be listed."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    found = []
    for entry in entries:
        step = step_number(entry.name, prefix)
        if step is not None and entry.is_dir(follow_symlinks=False):
            found.append((step, Path(entry.path)))
    return sorted(found)

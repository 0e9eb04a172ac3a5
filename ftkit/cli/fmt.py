"""Small helpers the commands share to say sizes (no imports beyond the standard library)."""
from __future__ import annotations

import os
from pathlib import Path


def human(n: float) -> str:
    """``512 B``, ``1.5 KiB``, ``3.2 GiB`` (pure)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - the loop always returns


def tree_size(root: Path) -> int:
    """Bytes of the files under ``root`` (symbolic links not followed; vanished files
    count 0)."""
    total = 0
    for folder, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total

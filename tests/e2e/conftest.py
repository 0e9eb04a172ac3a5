"""Fixtures for end-to-end tests: failure-free reference digests, computed once per session."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.jobs import TOY, run_toy

_cache: dict[tuple[int, int, int, Path], str] = {}


@pytest.fixture(scope="session")
def reference_digest(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """``reference_digest(n, steps, ranks_per_node=2, script=TOY)``: digest of a failure-free
    run of the toy ``script`` (cached)."""
    def get(n: int = 4, steps: int = 8, ranks_per_node: int = 2, script: Path = TOY) -> str:
        key = (n, steps, ranks_per_node, script)
        if key not in _cache:
            tmp: Path = tmp_path_factory.mktemp(f"ref-{script.stem}-{n}-{steps}-{ranks_per_node}")
            res = run_toy(tmp, n=n, steps=steps, ranks_per_node=ranks_per_node, max_restarts=0,
                          script=script)
            assert res.rc == 0, res.tail()
            _cache[key] = res.done["digest"]
        return _cache[key]
    return get

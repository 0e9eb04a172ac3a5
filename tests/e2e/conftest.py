"""Fixtures for end-to-end tests: failure-free reference digests, computed once per session."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.jobs import run_toy

_cache: dict[tuple[int, int, int], str] = {}


@pytest.fixture(scope="session")
def reference_digest(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """``reference_digest(n, steps, ranks_per_node=2)``: digest of a failure-free toy run
    (cached)."""
    def get(n: int = 4, steps: int = 8, ranks_per_node: int = 2) -> str:
        key = (n, steps, ranks_per_node)
        if key not in _cache:
            tmp: Path = tmp_path_factory.mktemp(f"ref-{n}-{steps}-{ranks_per_node}")
            res = run_toy(tmp, n=n, steps=steps, ranks_per_node=ranks_per_node, max_restarts=0)
            assert res.rc == 0, res.tail()
            _cache[key] = res.done["digest"]
        return _cache[key]
    return get

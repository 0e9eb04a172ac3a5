"""A run's claim on its job (ftkit.recovery.claim): locks taken and given back; a successful
end that ``ftkit run`` asked to tidy removes each node's local directory, the held lock file
last, and its empty parents up to ``FTKIT_LOCAL_DIR``. A fake communicator (one rank)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ftkit.config import Config
from ftkit.jobdir.lock import LOCK_FILE, held_by
from ftkit.recovery.claim import JobClaim


class _OneRank:
    def agree(self, failure: str | None, phase: str, step: int) -> dict[int, str]:
        return {} if failure is None else {0: failure}

    def bcast(self, obj: Any, phase: str) -> Any:
        return obj or {"run": "rank 0's run id"}          # what rank 0 would have sent


def _claim(cfg: Config, node: int, *, leader: bool = True) -> JobClaim:
    topo = SimpleNamespace(rank=0 if node == 0 and leader else 1, node=node,
                           is_node_leader=leader)
    root = cfg.node_dir(node)
    (root / "step-5").mkdir(parents=True, exist_ok=True)
    (root / "step-5" / "rank-0.ftk").write_bytes(b"shard")
    claim = JobClaim(cfg, topo, _OneRank(), root)            # type: ignore[arg-type]
    claim.take()
    return claim


@pytest.fixture()
def cfg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Config:
    monkeypatch.delenv("FTKIT_LAUNCH_ID", raising=False)
    return Config(local_dir=str(tmp_path / "local"), pfs_dir=str(tmp_path / "pfs"), job="j")


def test_release_keeps_everything_and_gives_the_lock_back(cfg: Config) -> None:
    claim = _claim(cfg, 0)
    lock = cfg.node_dir(0) / LOCK_FILE
    assert held_by(lock) is not None and claim.run_id
    claim.release()
    assert held_by(lock) is None
    assert (cfg.node_dir(0) / "step-5" / "rank-0.ftk").read_bytes() == b"shard"


def test_tidy_removes_each_node_dir_then_the_empty_job_dir(cfg: Config) -> None:
    first, second = _claim(cfg, 0), _claim(cfg, 1)
    first.release(tidy=True)
    assert not cfg.node_dir(0).exists()
    assert cfg.node_dir(1).is_dir()                 # another node's copies: not this leader's
    second.release(tidy=True)
    assert not cfg.job_local_dir.exists()
    assert Path(cfg.local_dir).is_dir()             # shared by every job: stays
    assert held_by(cfg.job_pfs_dir / LOCK_FILE) is None


def test_only_node_leaders_tidy(cfg: Config) -> None:
    leader = _claim(cfg, 0)
    other = JobClaim(cfg, SimpleNamespace(rank=1, node=0, is_node_leader=False),  # type: ignore[arg-type]
                     _OneRank(), cfg.node_dir(0))                            # type: ignore[arg-type]
    other.release(tidy=True)
    assert (cfg.node_dir(0) / "step-5" / "rank-0.ftk").exists()
    leader.release(tidy=True)
    assert not cfg.job_local_dir.exists()


def test_a_planted_link_as_node_dir_is_not_followed(cfg: Config, tmp_path: Path) -> None:
    claim = _claim(cfg, 0)
    claim.release()
    victim = tmp_path / "elsewhere"
    (victim / "keep").mkdir(parents=True)
    node = cfg.node_dir(0)
    node.rename(tmp_path / "moved")
    node.symlink_to(victim)
    JobClaim(cfg, SimpleNamespace(rank=0, node=0, is_node_leader=True),  # type: ignore[arg-type]
             _OneRank(), node).release(tidy=True)                         # type: ignore[arg-type]
    assert (victim / "keep").is_dir()

"""ftkit.jobdir.fatal: the per-rank record of an error that a relaunch would hit again.

The ranks write it (``Config.load``, ``Topology.create``, the Checkpointer) into
``$FTKIT_FATAL_DIR``; ``ftkit run`` reads it after a failed attempt and stops relaunching.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ftkit.config import Config
from ftkit.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    StateMismatchError,
    UnrecoverableError,
)
from ftkit.jobdir.fatal import FATAL_DIR_ENV, env_rank, read_fatal, record_fatal, recorded

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fatal_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "attempt-0.fatal"
    d.mkdir()
    monkeypatch.setenv(FATAL_DIR_ENV, str(d))
    return d


def test_record_then_read(fatal_dir: Path) -> None:
    record_fatal(ConfigError("FTKIT_LEVELS: unknown level 'bogus'"), 3)
    assert sorted(p.name for p in fatal_dir.iterdir()) == ["rank-3.json"]
    rec = read_fatal(fatal_dir)
    assert rec is not None
    assert (rec["kind"], rec["message"], rec["rank"]) == (
        "ConfigError", "FTKIT_LEVELS: unknown level 'bogus'", 3)
    assert isinstance(rec["time"], float)
    assert json.loads((fatal_dir / "rank-3.json").read_text()) == rec


def test_recorded_guards_an_entry_point(fatal_dir: Path) -> None:
    """What an entry point raises is recorded (when it recurs) and propagates; the rank is
    asked only then; other types pass through unrecorded."""
    asked: list[int] = []
    with pytest.raises(ValueError), recorded(lambda: asked.append(1) or 5, ConfigError):
        raise ValueError("not a ConfigError")
    assert asked == [] and read_fatal(fatal_dir) is None
    with pytest.raises(ConfigError), recorded(lambda: asked.append(1) or 5, ConfigError):
        raise ConfigError("tp and pp must be >= 1")
    with pytest.raises(CheckpointError), recorded(2):     # default: any FtkitError
        raise CheckpointError(3, {2: "does not recur"})
    rec = read_fatal(fatal_dir)
    assert asked == [1] and rec is not None and (rec["rank"], rec["kind"]) == (5, "ConfigError")
    assert sorted(p.name for p in fatal_dir.iterdir()) == ["rank-5.json"]


@pytest.mark.parametrize("exc", [
    UnrecoverableError("no copy of rank 2's shard of step 7 survives"),
    StateMismatchError(4, {1: "model.w: shape (3,) != (4,)"}),
    ConfigError("tp and pp must be >= 1"),
])
def test_every_recurring_error_is_recorded(fatal_dir: Path, exc: Exception) -> None:
    record_fatal(exc, 0)
    rec = read_fatal(fatal_dir)
    assert rec is not None and rec["kind"] == type(exc).__name__ and rec["message"] == str(exc)


@pytest.mark.parametrize("exc", [
    CheckpointError(4, {1: "disk full"}),          # an FtkitError that may not recur
    CorruptCheckpointError("/x/rank-1.ftk", "checksum mismatch"),
    RuntimeError("boom"),                          # not an ftkit error at all
    KeyboardInterrupt(),
])
def test_errors_that_may_not_recur_are_not_recorded(fatal_dir: Path,
                                                    exc: BaseException) -> None:
    record_fatal(exc, 0)
    assert list(fatal_dir.iterdir()) == [] and read_fatal(fatal_dir) is None


def test_without_fatal_dir_nothing_is_written(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FATAL_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    record_fatal(ConfigError("bad"), 0)
    assert list(tmp_path.iterdir()) == []


def test_lowest_rank_wins_and_first_record_of_a_rank_is_kept(fatal_dir: Path) -> None:
    record_fatal(ConfigError("from rank 5"), 5)
    record_fatal(UnrecoverableError("from rank 2"), 2)
    record_fatal(ConfigError("later error of rank 2"), 2)
    rec = read_fatal(fatal_dir)
    assert rec is not None and (rec["rank"], rec["kind"], rec["message"]) == (
        2, "UnrecoverableError", "from rank 2")
    assert sorted(p.name for p in fatal_dir.iterdir()) == ["rank-2.json", "rank-5.json"]


def test_long_message_is_cut(fatal_dir: Path) -> None:
    record_fatal(ConfigError("x" * 10_000), 0)
    rec = read_fatal(fatal_dir)
    assert rec is not None and 2000 <= len(rec["message"]) < 2100
    assert rec["message"].startswith("x" * 2000)


def test_unwritable_dir_only_warns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(FATAL_DIR_ENV, str(blocker / "fatal"))
    with caplog.at_level(logging.WARNING, logger="ftkit.jobdir.fatal"):
        record_fatal(ConfigError("bad"), 1)          # must not raise
    assert any(str(blocker / "fatal") in r.getMessage() and "rank 1" in r.getMessage()
               for r in caplog.records), caplog.text


def test_read_ignores_missing_dir_torn_and_foreign_files(tmp_path: Path) -> None:
    assert read_fatal(tmp_path / "nope") is None
    d = tmp_path / "fatal"
    d.mkdir()
    (d / "rank-0.json").write_text('{"kind": "Conf')              # torn
    (d / ".rank-1.json.tmp-99").write_text("{}")                # a temp file
    (d / "notes.txt").write_text("x")
    (d / "rank-x.json").write_text("{}")
    assert read_fatal(d) is None
    (d / "rank-12.json").write_text(json.dumps({"kind": "ConfigError", "message": "m",
                                                "rank": 12, "time": 1.0}))
    (d / "rank-3.json").write_text(json.dumps({"kind": "ConfigError", "message": "n",
                                               "rank": 3, "time": 1.0}))
    rec = read_fatal(d)
    assert rec is not None and rec["rank"] == 3       # numeric order, not "12" < "3"


@pytest.mark.parametrize("env, rank", [
    ({"OMPI_COMM_WORLD_RANK": "3", "PMI_RANK": "5"}, 3),
    ({"PMI_RANK": "5", "SLURM_PROCID": "7"}, 5),
    ({"SLURM_PROCID": "7"}, 7),
    ({}, 0),
    ({"OMPI_COMM_WORLD_RANK": "x"}, 0),
])
def test_env_rank(env: dict[str, str], rank: int) -> None:
    assert env_rank(env) == rank


# ------------------------------------------------------------------ callers in the ranks
def test_config_load_records_its_config_error(fatal_dir: Path) -> None:
    env = {FATAL_DIR_ENV: str(fatal_dir), "FTKIT_LEVELS": "bogus:1", "PMI_RANK": "2"}
    with pytest.raises(ConfigError, match="FTKIT_LEVELS"):
        Config.load(env=env)
    rec = read_fatal(fatal_dir)
    assert rec is not None and (rec["kind"], rec["rank"]) == ("ConfigError", 2)
    assert "unknown level 'bogus'" in rec["message"]


def test_config_load_records_errors_of_validation_too(fatal_dir: Path) -> None:
    with pytest.raises(ConfigError, match="FTKIT_RS_PARITY"):
        Config.load(env={FATAL_DIR_ENV: str(fatal_dir), "FTKIT_RS_PARITY": "9"})
    rec = read_fatal(fatal_dir)
    assert rec is not None and "FTKIT_RS_PARITY" in rec["message"] and rec["rank"] == 0


def test_config_load_that_succeeds_records_nothing(fatal_dir: Path) -> None:
    Config.load(env={FATAL_DIR_ENV: str(fatal_dir), "FTKIT_LEVELS": "local:1"})
    assert read_fatal(fatal_dir) is None


def test_module_imports_neither_mpi4py_nor_torch() -> None:
    code = ("import sys, ftkit.jobdir.fatal; "
            "bad = {'mpi4py', 'torch'} & set(sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                   env=dict(os.environ, PYTHONPATH=str(REPO)))


_TOPOLOGY = """
import sys
from mpi4py import MPI
from ftkit.comm.topology import Topology
from ftkit.errors import ConfigError
try:
    Topology.create(MPI.COMM_WORLD, tp=int(sys.argv[1]))
except ConfigError as exc:
    print("raised:", exc)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp, fails", [(2, True), (1, False)])
def test_topology_create_records_its_config_error(fatal_dir: Path, tp: int,
                                                  fails: bool) -> None:
    """A one-rank world (MPI singleton, no mpiexec) cannot be split into tp=2."""
    pytest.importorskip("mpi4py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTKIT_")}
    env.update({FATAL_DIR_ENV: str(fatal_dir), "PYTHONPATH": str(REPO)})
    proc = subprocess.run([sys.executable, "-c", _TOPOLOGY, str(tp)], env=env, timeout=100,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("raised:" in proc.stdout) is fails
    rec = read_fatal(fatal_dir)
    if not fails:
        assert rec is None
        return
    assert rec is not None and (rec["kind"], rec["rank"]) == ("ConfigError", 0)
    assert "not divisible by tp*pp" in rec["message"]

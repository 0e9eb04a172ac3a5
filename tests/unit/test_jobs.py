"""Which job an ``ftkit run`` runs (ftkit.launch.jobs) and the defaults that adapt to the
machine (Config.defaulted, Config.fit_to_nodes)."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from ftkit.config import DEFAULT_JOB, DEFAULT_LEVELS, Config
from ftkit.errors import ConfigError
from ftkit.launch.jobs import (
    NEWEST,
    TIDY_ENV,
    choose_job,
    end_line,
    jobs_in,
    new_job_id,
    tidy_requested,
)


def _job(pfs: Path, name: str, mtime: float) -> None:
    (pfs / name).mkdir(parents=True)
    events = pfs / name / "events.jsonl"
    events.write_text(json.dumps({"event": "launch"}) + "\n")
    os.utime(events, (mtime, mtime))


def test_defaulted_names_what_nobody_gave() -> None:
    assert Config().defaulted == {"job", "levels"}
    assert (Config().job, Config().levels) == (DEFAULT_JOB, DEFAULT_LEVELS)
    assert Config.load(env={"FTKIT_JOB": "a"}).defaulted == {"levels"}
    assert Config.load(env={"SLURM_JOB_ID": "7"}).defaulted == {"levels"}
    assert Config.load(env={"FTKIT_LEVELS": "local:1"}).defaulted == {"job"}
    assert Config(levels=DEFAULT_LEVELS).defaulted == {"job"}       # given, even if equal


def test_default_levels_fit_one_node_but_asked_ones_are_kept() -> None:
    cfg, why = Config().fit_to_nodes(1)
    assert cfg.levels == (("local", 1), ("pfs", 50))
    assert why is not None and "'partner'" in why and "local:1,pfs:50" in why
    assert Config().fit_to_nodes(2) == (Config(), None)
    asked = Config(levels=DEFAULT_LEVELS)
    assert asked.fit_to_nodes(1) == (asked, None)     # refused later, with a clear error


def test_new_job_ids_differ_and_sort_by_time() -> None:
    ids = {new_job_id(1_800_000_000.0) for _ in range(50)}
    assert len(ids) > 40
    assert all(re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{4}", i) for i in ids)
    assert new_job_id(1_800_000_000.0) < new_job_id(1_800_000_060.0)


def test_each_run_is_a_new_job_unless_one_is_named(tmp_path: Path) -> None:
    cfg = Config(pfs_dir=str(tmp_path))
    a, b = choose_job(cfg, None), choose_job(cfg, None)
    assert a.new and b.new and a.cfg.job != b.cfg.job
    assert f"ftkit run --resume {a.cfg.job}" in a.line
    named = choose_job(Config(pfs_dir=str(tmp_path), job="mine"), None)
    assert (named.cfg.job, named.new) == ("mine", False)


def test_resume_finds_the_job_or_says_which_exist(tmp_path: Path) -> None:
    _job(tmp_path, "old", 1000.0)
    _job(tmp_path, "new", 2000.0)
    (tmp_path / "not-a-job").mkdir()
    assert jobs_in(tmp_path) == ["old", "new"]
    cfg = Config(pfs_dir=str(tmp_path))
    assert choose_job(cfg, NEWEST).cfg.job == "new"
    got = choose_job(cfg, "old")
    assert (got.cfg.job, got.new) == ("old", False) and "continuing" in got.line
    with pytest.raises(ConfigError, match=r"--resume nope: no such job under .*old, new"):
        choose_job(cfg, "nope")
    with pytest.raises(ConfigError, match="contradicts FTKIT_JOB=new"):
        choose_job(Config(pfs_dir=str(tmp_path), job="new"), "old")
    with pytest.raises(ConfigError, match="no job to continue"):
        choose_job(Config(pfs_dir=str(tmp_path / "empty")), NEWEST)


def test_end_line_says_what_the_ranks_did_with_the_node_local_copies() -> None:
    cfg = Config(local_dir="/dev/shm/x", job="j")
    removed = end_line(cfg, {"last_committed": 6, "local_removed": True}, tidy=True)
    assert removed.startswith("removed the node-local copies of job j on every node (step 6 ")
    kept = end_line(cfg, {"last_committed": 7, "local_removed": False}, tidy=True)
    assert "kept under /dev/shm/x: step 7 is not on the PFS" in kept
    assert "ftkit run --resume j" in kept and "ftkit clean j" in kept
    assert end_line(cfg, {"last_committed": 7, "local_removed": False}, tidy=False) == ""
    assert end_line(cfg, {"last_committed": None}, tidy=True) == ""   # nothing committed


def test_end_line_says_which_step_is_only_node_local_when_the_pfs_failed() -> None:
    cfg = Config(local_dir="/dev/shm/x", pfs_dir="/pfs", job="j")
    record = {"last_committed": 8, "local_removed": False,
              "unflushed": {"step": 8, "why": "No space left on device", "last_flushed": 4}}
    for tidy in (True, False):                  # said with --keep-local too
        line = end_line(cfg, record, tidy=tidy)
        assert line.startswith("step 8 of job j is only in the node-local copies under "
                               "/dev/shm/x (the PFS flush of step 8 failed: No space left on "
                               "device; step 4 is the newest on the PFS)"), line
        assert "ftkit run --resume j" in line
    empty = end_line(cfg, {}, tidy=False)       # a marker without details
    assert "completion record is empty" in empty and "/dev/shm/x" in empty


def test_tidy_is_asked_for_by_ftkit_run_only() -> None:
    assert tidy_requested({TIDY_ENV: "1"}) and not tidy_requested({})
    assert not tidy_requested({TIDY_ENV: "0"})
    Config.load(env={TIDY_ENV: "1"})                  # reserved: not an unknown FTKIT_ key


@pytest.mark.parametrize("env,who", [
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}, "torchrun"),
    ({"SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "5"}, "srun"),
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3"}, "Open MPI's mpiexec"),
    ({"PMI_SIZE": "4", "PMI_RANK": "2"}, "a PMI launcher")])
def test_a_launcher_world_that_mpi_does_not_see_is_refused(env: dict[str, str], who: str
                                                          ) -> None:
    from ftkit.comm.topology import check_launcher
    with pytest.raises(ConfigError, match=f"started by {re.escape(who)}"):
        check_launcher(env, 1)
    check_launcher(env, int(next(iter(env.values()))))      # MPI agrees: fine
    check_launcher(env, 3)                                   # MPI's world is trusted
    check_launcher({"WORLD_SIZE": "1", "SLURM_NTASKS": "8"}, 1)   # one process; a batch step


def test_status_lists_jobs_and_tells_one_in_detail(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``ftkit status`` on a job tree as ftkit writes it: PFS and node-local committed steps
    (an uncommitted one is not counted), the run id, the last events, the lock holder."""
    from ftkit.cli.main import main
    from ftkit.jobdir.events import append_event
    from ftkit.jobdir.lock import LOCK_FILE, JobLock, holder_record
    pfs, local = tmp_path / "pfs", tmp_path / "local"
    monkeypatch.setenv("FTKIT_PFS_DIR", str(pfs))
    monkeypatch.setenv("FTKIT_LOCAL_DIR", str(local))
    monkeypatch.delenv("SLURMD_NODENAME", raising=False)
    for step, committed in ((3, True), (6, True), (9, False)):
        d = pfs / "j" / f"step-{step}"
        d.mkdir(parents=True)
        (d / "node-0.h5").write_bytes(b"x" * 2048)
        if committed:
            (d / "COMMITTED").write_text("{}")
    node = local / "j" / "node-1" / "step-8"
    node.mkdir(parents=True)
    (node / "rank-2.ftk").write_bytes(b"y" * 100)
    (node / "COMMITTED").write_text("{}")
    (pfs / "j" / "RUN").write_text(json.dumps({"run": "j-run-1", "job": "j"}))
    events = pfs / "j" / "events.jsonl"
    for step in range(1, 9):
        append_event(events, "commit", step=step)
    append_event(events, "gave-up", status=3, reason="not retried: ConfigError: bad")
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("j: not running; newest PFS step 6; gave up: not retried"), out
    assert main(["status", "j", "--events", "2"]) == 0
    out = capsys.readouterr().out
    assert "run id: j-run-1" in out and "committed steps 3 (2.0 KiB), 6 (2.0 KiB)\n" in out
    assert f"{local / 'j'}/node-1 (this host): committed steps 8 (102 B)" in out, out
    assert out.count('  commit  {') == 1 and "gave-up" in out, out
    lock = JobLock(pfs / "j" / LOCK_FILE, "j")
    lock.acquire(holder_record("ftkit run"), what="test")
    try:
        assert main(["status", "j", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
    finally:
        lock.release()
    assert doc["running"].startswith("ftkit run pid ") and doc["run"] == "j-run-1"
    assert [s["step"] for s in doc["pfs"]] == [3, 6] and len(doc["events"]) == 5
    assert main(["status", "nope"]) == 1
    assert "no job nope" in capsys.readouterr().out
    leader = JobLock(local / "j" / "node-1" / LOCK_FILE, "j")    # ranks of a killed run
    leader.acquire(holder_record("node leader of node 1"), what="test")
    try:
        assert main(["status", "j"]) == 0
        out = capsys.readouterr().out
        assert main(["status"]) == 0
        listed = capsys.readouterr().out
    finally:
        leader.release()
    assert out.startswith("job j: no ftkit run holds it, but its ranks still run on this host "
                          "(node leader of node 1 pid "), out
    assert f"holds {local / 'j' / 'node-1' / LOCK_FILE})" in out.splitlines()[0]
    assert listed.startswith("j: ranks still running;"), listed

"""Tests of ``ftkit run``: command building (pure), the relaunch loop (fake launcher), a smoke run.

The loop tests use ``tests/unit/fakes/fake_mpiexec.py``, which acts out a plan per attempt
(``FAKE_MPIEXEC_PLAN``) and logs what it saw; only the last tests start a real ``mpiexec``.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from ftkit.cli.main import main
from ftkit.config import Config
from ftkit.errors import LaunchError
from ftkit.jobdir.events import read_events
from ftkit.launch import registry
from ftkit.launch.base import Launcher, Request
from ftkit.launch.mpiexec import (
    MPICH,
    OPENMPI,
    UNKNOWN,
    MpiexecLauncher,
    build_command,
    detect_flavor,
    find_mpiexec,
    launch_env,
    openmpi_major,
    places_ranks,
    query_flavor,
    rewrite_python,
)
from ftkit.launch.outcome import (
    NO_MARKER_REASON,
    NOT_RETRIED_STATUS,
    attempt_line,
    judge,
    restart_delay,
)
from ftkit.launch.relaunch import done_file_path, run_job
from ftkit.launch.spec import RunSpec
from ftkit.testing.procs import process_gone

FAKE = Path(__file__).parent / "fakes" / "fake_mpiexec.py"
REPO = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^ftkit run: attempt \d+: ")
OPENMPI_VERSION = "mpiexec (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/\n"
HYDRA_VERSION = "HYDRA build details:\n    Version:                                 4.0.2\n"


# --------------------------------------------------------------------------- fixtures
@pytest.fixture
def job(launch_env: Path) -> Path:
    """A clean ftkit environment with PFS and local dirs under tmp_path; returns the job dir."""
    return launch_env


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """Path of an executable fake mpiexec (a wrapper running the fake under this Python)."""
    wrapper = tmp_path / "bin" / "mpiexec"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("FAKE_MPIEXEC_LOG", str(tmp_path / "fake.log"))
    return str(wrapper)


def fake_log(tmp_path: Path) -> list[dict]:
    path = tmp_path / "fake.log"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def invocations(tmp_path: Path) -> list[dict]:
    return [r for r in fake_log(tmp_path) if "argv" in r]


def attempt_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if LINE.match(line)]


def run_fake(fake: str, plan: str, *opts: str, cmd: tuple[str, ...] = ("python", "train.py"),
             monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setenv("FAKE_MPIEXEC_PLAN", plan)
    delay = () if "--restart-delay" in opts else ("--restart-delay", "0")
    return main(["run", "-n", "4", "--mpiexec", fake, *delay, *opts, "--", *cmd])


# ------------------------------------------------------------------- flavour detection
@pytest.mark.parametrize("text, flavor", [
    (OPENMPI_VERSION, OPENMPI),
    ("prterun (Open MPI) 5.0.3\n", OPENMPI),
    ("mpirun (OpenRTE) 4.1.4\n", OPENMPI),
    ("prterun (PRRTE) 3.0.0\n", OPENMPI),
    (HYDRA_VERSION, MPICH),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.10\n", MPICH),
    ("", UNKNOWN),
    ("srun: slurm 22.05.8\n", UNKNOWN),
])
def test_detect_flavor(text: str, flavor: str) -> None:
    assert detect_flavor(text) == flavor


def test_query_flavor_runs_version(fake: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert query_flavor(fake) == MPICH
    monkeypatch.setenv("FAKE_MPIEXEC_VERSION", OPENMPI_VERSION)
    assert query_flavor(fake) == OPENMPI


def test_in_job_refuses_an_open_mpi_without_ulfm(fake: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_MPIEXEC_VERSION", "mpirun (OpenRTE) 4.1.4\n")
    old = MpiexecLauncher.detect(fake)
    assert (old.flavor, old.major) == (OPENMPI, 4)
    with pytest.raises(LaunchError, match="is Open MPI 4: run without --in-job"):
        old.in_job(2)
    monkeypatch.setenv("FAKE_MPIEXEC_VERSION", "mpiexec (Open MPI) 5.0.11\n")
    assert MpiexecLauncher.detect(fake).in_job(2).spare_ranks == 2
    assert openmpi_major("prterun (PRRTE) 3.0.0\n") is None     # PRRTE's own number


def test_query_flavor_missing_executable(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="--version"):
        query_flavor(str(tmp_path / "nope"))


# ------------------------------------------------------------------ python rewriting
@pytest.mark.parametrize("cmd, expected", [
    (["python", "train.py", "--lr", "1"], ["python", "-m", "mpi4py", "train.py", "--lr", "1"]),
    (["/venv/bin/python3.11", "-u", "t.py"], ["/venv/bin/python3.11", "-u", "-m", "mpi4py", "t.py"]),
    (["python3", "-m", "pkg.train", "-x"], ["python3", "-m", "mpi4py", "-m", "pkg.train", "-x"]),
    (["python", "-c", "print(1)"], ["python", "-m", "mpi4py", "-c", "print(1)"]),
    (["python", "-W", "error", "-X", "dev", "-O", "t.py"],
     ["python", "-W", "error", "-X", "dev", "-O", "-m", "mpi4py", "t.py"]),
    (["python", "-Werror", "-Xdev", "t.py"], ["python", "-Werror", "-Xdev", "-m", "mpi4py", "t.py"]),
    (["python", "-uc", "print(1)"], ["python", "-u", "-m", "mpi4py", "-c", "print(1)"]),
    (["python", "-mpkg"], ["python", "-m", "mpi4py", "-mpkg"]),
    (["python", "--check-hash-based-pycs", "never", "t.py"],
     ["python", "--check-hash-based-pycs", "never", "-m", "mpi4py", "t.py"]),
    (["python", "-", "a"], ["python", "-m", "mpi4py", "-", "a"]),
    (["python", "t.py", "-m", "mpi4py"], ["python", "-m", "mpi4py", "t.py", "-m", "mpi4py"]),
])
def test_rewrite_python_inserts_mpi4py(cmd: list[str], expected: list[str]) -> None:
    assert rewrite_python(cmd) == expected


@pytest.mark.parametrize("cmd", [
    ["python", "-m", "mpi4py", "train.py"],
    ["python", "-u", "-m", "mpi4py", "train.py"],
    ["python", "-mmpi4py", "train.py"],
    ["python", "-m", "mpi4py.run", "train.py"],
    ["python"],                         # interactive: nothing to run under mpi4py
    ["python", "-u"],
    ["./train.sh", "python"],
    ["python-config", "--libs"],
    ["pythonista", "x"],
    [],
])
def test_rewrite_python_leaves_alone(cmd: list[str]) -> None:
    assert rewrite_python(cmd) == cmd


def test_rewrite_python_does_not_mutate() -> None:
    cmd = ["python", "t.py"]
    rewrite_python(cmd)
    assert cmd == ["python", "t.py"]


# ------------------------------------------------------------------ command and env
def test_build_command_openmpi_oversubscribes() -> None:
    got = build_command(4, ["python", "t.py"], OPENMPI, "/v/bin/mpiexec")
    assert got == ["/v/bin/mpiexec", "--oversubscribe", "--bind-to", "none", "-n", "4",
                   "python", "-m", "mpi4py", "t.py"]


@pytest.mark.parametrize("flavor", [MPICH, UNKNOWN])
def test_build_command_mpich_adds_nothing(flavor: str) -> None:
    assert build_command(2, ["./a.out", "-x"], flavor) == ["mpiexec", "-n", "2", "./a.out", "-x"]


def test_build_command_extra_args_before_n() -> None:
    got = build_command(2, ["./a"], OPENMPI, extra=("--with-ft", "ulfm"))
    assert got[4:] == ["--with-ft", "ulfm", "-n", "2", "./a"]


def test_launcher_args_that_place_ranks_replace_ftkits_own() -> None:
    site = ["--hostfile", "hosts", "--map-by", "ppr:4:node", "--bind-to", "core"]
    assert build_command(8, ["./a"], OPENMPI, user=site) == ["mpiexec", *site, "-n", "8", "./a"]
    other = ["--mca", "btl", "tcp,self"]
    assert build_command(2, ["./a"], OPENMPI, user=other) == [
        "mpiexec", "--oversubscribe", "--bind-to", "none", *other, "-n", "2", "./a"]
    assert places_ranks(["--map-by=slot"]) and not places_ranks(["-x", "FOO"])


@pytest.mark.timeout(60)
def test_launcher_args_reach_mpiexec(job: Path, fake: str, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``ftkit run --launcher-args`` (the real entry point, a fake mpiexec): split like a
    shell, before ``-n``; a quote that does not close is a usage error."""
    rc = run_fake(fake, "ok", "--launcher-args", "-x 'A B' --mca btl tcp,self",
                  monkeypatch=monkeypatch)
    assert rc == 0
    [seen] = invocations(tmp_path)
    assert seen["argv"][:6] == ["-x", "A B", "--mca", "btl", "tcp,self", "-n"], seen["argv"]
    assert run_fake(fake, "ok", "--launcher-args", "-x 'A", monkeypatch=monkeypatch) == 2


@pytest.mark.parametrize("n, cmd, flavor", [(0, ["a"], MPICH), (2, [], MPICH), (2, ["a"], "lam")])
def test_build_command_rejects(n: int, cmd: list[str], flavor: str) -> None:
    with pytest.raises(LaunchError):
        build_command(n, cmd, flavor)


def test_launch_env_root_openmpi() -> None:
    base = {"PATH": "/bin"}
    env = launch_env(base, OPENMPI, as_root=True)
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert env["PATH"] == "/bin" and base == {"PATH": "/bin"}
    assert "PMIX_MCA_gds" not in env


@pytest.mark.parametrize("flavor, root", [(OPENMPI, False), (MPICH, True), (MPICH, False)])
def test_launch_env_no_root_vars(flavor: str, root: bool) -> None:
    assert launch_env({"A": "1"}, flavor, as_root=root) == {"A": "1"}


def test_launch_env_keeps_user_values_and_gds() -> None:
    env = launch_env({"OMPI_ALLOW_RUN_AS_ROOT": "0"}, OPENMPI, as_root=True, pmix_gds_hash=True)
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == "0"
    assert env["PMIX_MCA_gds"] == "hash"


def _exe(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_find_mpiexec_prefers_interpreter_dir(tmp_path: Path) -> None:
    beside = _exe(tmp_path / "venv" / "bin" / "mpiexec")
    _exe(tmp_path / "usr" / "mpiexec")
    got = find_mpiexec(str(tmp_path / "venv" / "bin" / "python"), path=str(tmp_path / "usr"))
    assert got == str(beside)


def test_find_mpiexec_falls_back_to_path(tmp_path: Path) -> None:
    on_path = _exe(tmp_path / "usr" / "mpiexec")
    got = find_mpiexec(str(tmp_path / "venv" / "bin" / "python"), path=str(tmp_path / "usr"))
    assert got == str(on_path)


def test_find_mpiexec_none(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="no mpiexec found"):
        find_mpiexec(str(tmp_path / "python"), path=str(tmp_path))


def test_resolve_launcher(fake: str) -> None:
    launcher = registry.resolve("auto", Request({}, mpiexec=fake))
    assert isinstance(launcher, MpiexecLauncher)
    assert (launcher.path, launcher.flavor, launcher.name) == (fake, MPICH, "mpiexec")
    for choice, env in (("srun", {}), ("auto", {"SLURM_JOB_ID": "7"}), ("lam", {})):
        with pytest.raises(LaunchError):
            registry.resolve(choice, Request(env))
    with pytest.raises(LaunchError, match="no such executable"):
        registry.resolve("mpiexec", Request({}, mpiexec="/nonexistent/mpiexec"))



_TOY_RANKS = """
import os, pathlib, sys
pathlib.Path(os.environ["FTKIT_DONE_FILE"]).write_text("{}")
print("toy ranks:", sys.argv[1])
"""


class _ToyLauncher(Launcher):
    """A launcher defined outside ftkit: its "ranks" are one Python child that completes."""

    name = "toy"

    def __init__(self, request: Request) -> None:
        self.request = request

    def command(self, n: int, cmd: Sequence[str]) -> list[str]:
        return [sys.executable, "-c", _TOY_RANKS, str(n)]

    def environ(self, base: Mapping[str, str]) -> dict[str, str]:
        return dict(base)


def test_a_registered_launcher_runs_the_job(launch_env: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A new launcher is one class plus one registry entry: ``ftkit run --launcher toy``
    builds it from the run's request and the relaunch loop drives it (default hooks)."""
    monkeypatch.setattr(registry, "_ENTRIES", dict(registry._ENTRIES))
    assert main(["run", "--launcher", "toy", "-n", "3", "--", "x"]) == 2   # not a choice yet
    registry.register("toy", _ToyLauncher)
    assert registry.names() == ("auto", "mpiexec", "srun", "toy")
    assert main(["run", "--launcher", "toy", "-n", "3", "--", "x"]) == 0
    [launch] = [e for e in read_events(launch_env / "events.jsonl") if e["event"] == "launch"]
    assert launch["launcher"] == "toy" and launch["argv"][-1] == "3", launch
    with pytest.raises(ValueError, match="registered already"):
        registry.register("toy", _ToyLauncher)


# ------------------------------------------------------------ judging and attempt lines
def test_attempt_lines_match_the_contract() -> None:
    failed = judge(0, 137, False, 12.34, 600)
    assert attempt_line(failed, 3) == ("ftkit run: attempt 0: failed (exit 137) after 12.3 s; "
                                       "relaunching (restart 1 of 3)")
    ok = judge(1, 0, True, 20.06, 600)
    assert attempt_line(ok, 3) == "ftkit run: attempt 1: succeeded after 20.1 s"
    timeout = judge(3, None, False, 600.2, 600)
    assert attempt_line(timeout, 3) == ("ftkit run: attempt 3: failed (timeout after 600 s); "
                                        "no restarts left")
    assert (ok.status, failed.status, timeout.status) == (0, 137, 124)
    resumed = dataclasses.replace(ok, resumed=49)
    assert attempt_line(resumed, 3) == ("ftkit run: attempt 1: succeeded after 20.1 s "
                                        "(resumed at step 49)")


def test_resumed_step_is_this_runs_attempts(tmp_path: Path) -> None:
    """The step an attempt restored comes from its own ``restore`` event: one after the
    ``launch`` event of that attempt (an earlier run of the job had attempts too)."""
    from ftkit.jobdir.events import append_event, restored_step
    log = tmp_path / "events.jsonl"
    for event, attempt, step in (("launch", 0, None), ("restore", 0, 7), ("launch", 0, None),
                                 ("restore", 0, 0), ("launch", 1, None), ("restore", 1, 12),
                                 ("launch", 2, None)):
        append_event(log, event, attempt=attempt, **({} if step is None else {"step": step}))
    assert [restored_step(log, a) for a in (0, 1, 2)] == [0, 12, None]
    assert restored_step(tmp_path / "missing.jsonl", 0) is None


def test_judge_distrusts_exit_zero_and_maps_signals() -> None:
    no_marker = judge(0, 0, False, 1.0, 60)
    assert (no_marker.ok, no_marker.status, no_marker.reason) == (False, 1, NO_MARKER_REASON)
    with_marker_but_rc = judge(0, 3, True, 1.0, 60)
    assert (with_marker_but_rc.ok, with_marker_but_rc.status) == (False, 3)
    killed = judge(0, -9, False, 1.0, 60)
    assert (killed.rc, killed.status, killed.reason) == (137, 137, "launcher killed by SIGKILL")
    stopped = judge(0, 143, False, 1.0, 60, interrupted=signal.SIGTERM)
    assert stopped.status == 143 and "interrupted by SIGTERM" in attempt_line(stopped, 5)
    assert attempt_line(stopped, 5).endswith("; not relaunching")


def test_judge_takes_a_released_in_job_marker_as_success_whatever_the_status() -> None:
    """After an in-job recovery the processes end without MPI_Finalize (it hangs in Open
    MPI 5 after failures), so mpiexec's status may be 1: the marker's ``in_job.released``
    decides. Without the marker, released means nothing."""
    ok = judge(0, 1, True, 1.0, 60, released=True)
    assert (ok.ok, ok.status) == (True, 0) and "after in-job recovery" in ok.reason
    assert "launcher's exit 1" in ok.reason
    assert not judge(0, 1, False, 1.0, 60, released=True).ok
    assert not judge(0, 1, True, 1.0, 60).ok
    assert not judge(0, None, True, 1.0, 60, released=True).ok      # timed out: not done


def test_done_file_is_absolute_per_attempt(job: Path) -> None:
    cfg = Config.load()
    assert done_file_path(cfg, 2) == job / ".done-attempt-2"
    assert done_file_path(Config.load(pfs_dir="rel"), 0).is_absolute()


def test_run_spec_validates() -> None:
    with pytest.raises(LaunchError, match="--max-restarts"):
        RunSpec(n=2, cmd=("x",), max_restarts=-1)
    with pytest.raises(LaunchError, match="no command"):
        RunSpec(n=2, cmd=())


# --------------------------------------------------------------- the loop (fake launcher)
@pytest.mark.timeout(60)
def test_fail_then_succeed(job: Path, fake: str, tmp_path: Path,
                           monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    rc = run_fake(fake, "exit:3,ok", "--max-restarts", "3", "--ranks-per-node", "2",
                  "--spares", "1", monkeypatch=monkeypatch)
    lines = attempt_lines(capsys.readouterr().out)
    assert rc == 0
    assert len(lines) == 2
    assert lines[0].startswith("ftkit run: attempt 0: failed (exit 3) after ")
    assert lines[0].endswith("; relaunching (restart 1 of 3)")
    assert re.fullmatch(r"ftkit run: attempt 1: succeeded after \d+\.\d s", lines[1])
    seen = invocations(tmp_path)
    assert [r["env"]["FTKIT_ATTEMPT"] for r in seen] == ["0", "1"]
    assert [r["env"]["FTKIT_DONE_FILE"] for r in seen] == [
        str(job / ".done-attempt-0"), str(job / ".done-attempt-1")]
    assert all(r["env"]["FTKIT_RANKS_PER_NODE"] == "2" for r in seen)
    assert seen[0]["argv"] == ["-n", "4", "python", "-m", "mpi4py", "train.py"]
    events = list(read_events(job / "events.jsonl"))
    assert [e["event"] for e in events] == ["launch", "attempt-end", "relaunch", "launch",
                                            "attempt-end", "done"]
    launch = events[0]
    assert (launch["n"], launch["cmd"], launch["attempt"], launch["launcher"], launch["spares"]) \
        == (4, ["python", "train.py"], 0, "mpiexec", 1)
    assert {k: events[1][k] for k in ("attempt", "rc", "ok", "reason")} == \
        {"attempt": 0, "rc": 3, "ok": False, "reason": "exit 3"}
    assert events[4]["ok"] is True and events[2]["attempt"] == 1
    assert isinstance(events[4]["seconds"], float)


@pytest.mark.timeout(60)
def test_exit_zero_without_marker_is_a_failure(job: Path, fake: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture) -> None:
    job.mkdir(parents=True)
    (job / ".done-attempt-0").write_text("{}")          # stale marker of an earlier run
    rc = run_fake(fake, "nomarker", "--max-restarts", "1", monkeypatch=monkeypatch)
    lines = attempt_lines(capsys.readouterr().out)
    assert rc == 1
    assert len(lines) == 2
    assert f"failed ({NO_MARKER_REASON}) after" in lines[0]
    assert lines[1].endswith("; no restarts left")
    events = list(read_events(job / "events.jsonl"))
    ends = [e for e in events if e["event"] == "attempt-end"]
    assert [(e["rc"], e["ok"]) for e in ends] == [(0, False), (0, False)]
    assert events[-1]["event"] == "gave-up" and events[-1]["status"] == 1


@pytest.mark.timeout(60)
def test_restarts_exhausted_returns_last_rc(job: Path, fake: str, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture) -> None:
    rc = run_fake(fake, "exit:3,marker-exit:9,exit:7", "--max-restarts", "2",
                  monkeypatch=monkeypatch)
    lines = attempt_lines(capsys.readouterr().out)
    assert rc == 7
    assert [line.split(": ")[2].split(" after")[0] for line in lines] == [
        "failed (exit 3)", "failed (exit 9)", "failed (exit 7)"]
    assert lines[1].endswith("relaunching (restart 2 of 2)")
    assert lines[2].endswith("no restarts left")
    assert len(invocations(tmp_path)) == 3


@pytest.mark.timeout(60)
def test_relaunches_back_off(job: Path, fake: str, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture) -> None:
    """Each relaunch waits twice as long as the one before (the line says how long)."""
    rc = run_fake(fake, "exit:3,exit:4,exit:5", "--max-restarts", "2", "--restart-delay",
                  "0.05", monkeypatch=monkeypatch)
    lines = attempt_lines(capsys.readouterr().out)
    assert rc == 5
    assert lines[0].endswith("relaunching in 0.05 s (restart 1 of 2)"), lines
    assert lines[1].endswith("relaunching in 0.1 s (restart 2 of 2)"), lines
    assert [restart_delay(k, 2.0) for k in (0, 1, 2, 3, 6, 7, 60)] == [
        0.0, 2.0, 4.0, 8.0, 60.0, 60.0, 60.0]
    assert restart_delay(3, 0.0) == 0.0
    assert main(["run", "-n", "2", "--restart-delay", "nan", "--", "true"]) == 2


@pytest.mark.timeout(60)
def test_launcher_killed_by_signal(job: Path, fake: str, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture) -> None:
    rc = run_fake(fake, "selfkill", "--max-restarts", "0", monkeypatch=monkeypatch)
    assert rc == 137
    assert "failed (launcher killed by SIGKILL)" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_timeout_kills_and_relaunches(job: Path, fake: str, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture) -> None:
    start = time.monotonic()
    rc = run_fake(fake, "hang,ok", "--attempt-timeout", "1", "--max-restarts", "1",
                  monkeypatch=monkeypatch)
    elapsed = time.monotonic() - start
    lines = attempt_lines(capsys.readouterr().out)
    assert rc == 0
    assert lines[0] == ("ftkit run: attempt 0: failed (timeout after 1 s); "
                        "relaunching (restart 1 of 1)")
    assert lines[1].startswith("ftkit run: attempt 1: succeeded")
    assert {"signal": signal.SIGTERM} in fake_log(tmp_path)
    assert elapsed < 1 + 5                               # SIGTERM was enough, no grace wait
    end = next(e for e in read_events(job / "events.jsonl") if e["event"] == "attempt-end")
    assert (end["rc"], end["status"], end["reason"]) == (None, 124, "timeout after 1 s")


@pytest.mark.timeout(60)
def test_timeout_exhausted_exits_124(job: Path, fake: str, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture) -> None:
    rc = run_fake(fake, "hang", "--attempt-timeout", "0.5", "--max-restarts", "0", monkeypatch=monkeypatch)
    assert rc == 124
    assert attempt_lines(capsys.readouterr().out) == [
        "ftkit run: attempt 0: failed (timeout after 0.5 s); no restarts left"]


@pytest.mark.timeout(60)
def test_timeout_escalates_to_sigkill(job: Path, fake: str, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_MPIEXEC_PLAN", "hang-stubborn")
    spec = RunSpec(n=2, cmd=("./a.out",), attempt_timeout=1.0, kill_grace=0.5)
    out = io.StringIO()
    start = time.monotonic()
    rc = run_job(spec, Config.load(), MpiexecLauncher(fake, MPICH), out=out)
    assert rc == 124
    assert time.monotonic() - start < 1.0 + 0.5 + 3      # generous slack for a slow CI
    assert "failed (timeout after 1 s)" in out.getvalue()
    assert not any("signal" in r for r in fake_log(tmp_path))   # it ignored SIGTERM


@pytest.mark.timeout(60)
def test_processes_left_behind_are_killed(job: Path, fake: str, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    rc = run_fake(fake, "straggler", "--max-restarts", "0", monkeypatch=monkeypatch)
    assert rc == 1
    pid = next(r["straggler"] for r in fake_log(tmp_path) if "straggler" in r)
    deadline = time.monotonic() + 10
    while not process_gone(pid) and time.monotonic() < deadline:   # SIGKILL delivery is asynchronous
        time.sleep(0.01)
    assert process_gone(pid)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_is_forwarded_and_stops_relaunching(job: Path, fake: str, tmp_path: Path,
                                                   signum: int) -> None:
    env = dict(os.environ, FAKE_MPIEXEC_PLAN="hang", PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftkit.cli.main", "run", "-n", "2", "--max-restarts", "3",
         "--mpiexec", fake, "--", "./a.out"],
        env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "FAKE READY"   # the attempt is running
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=30)
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum
    lines = attempt_lines(out)
    assert len(lines) == 1
    assert lines[0].startswith(f"ftkit run: attempt 0: interrupted by {name} after ")
    assert lines[0].endswith("; not relaunching")
    assert {"signal": signum} in fake_log(tmp_path)
    assert len(invocations(tmp_path)) == 1
    last = list(read_events(job / "events.jsonl"))[-1]
    assert (last["event"], last["status"]) == ("gave-up", 128 + signum)


# ------------------------------------------------------- errors that recur are not retried
_RECORD = """
import os, sys
from ftkit.errors import ConfigError
from ftkit.jobdir.fatal import record_fatal
if os.environ["FTKIT_ATTEMPT"] in sys.argv[1].split(","):
    record_fatal(ConfigError("FTKIT_LEVELS: unknown level 'bogus' in 'bogus:1'\\nsecond line"), 1)
"""


@pytest.fixture
def fatal_fake(fake: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The fake mpiexec, preceded (like a rank would) by the real ``record_fatal`` of a
    ConfigError on rank 1 in the attempts listed in ``$FAKE_FATAL_ATTEMPTS``."""
    record = tmp_path / "record.py"
    record.write_text(_RECORD)
    wrapper = tmp_path / "bin" / "mpiexec-fatal"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" != --version ]; then PYTHONPATH="{REPO}" "{sys.executable}" "{record}" '
        '"$FAKE_FATAL_ATTEMPTS" || exit 99; fi\n'
        f'exec "{fake}" "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("FAKE_FATAL_ATTEMPTS", "0")
    return str(wrapper)


@pytest.mark.timeout(60)
def test_recurring_error_is_not_retried(job: Path, fatal_fake: str, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture) -> None:
    rc = run_fake(fatal_fake, "exit:1,ok", "--max-restarts", "3", monkeypatch=monkeypatch)
    lines = attempt_lines(capsys.readouterr().out)
    assert rc == NOT_RETRIED_STATUS == 3
    assert len(invocations(tmp_path)) == 1
    assert len(lines) == 1, lines
    assert lines[0].startswith("ftkit run: attempt 0: failed: not retried: ConfigError: "
                               "FTKIT_LEVELS: unknown level 'bogus' in 'bogus:1' (rank 1)")
    assert "second line" not in lines[0] and "relaunching" not in lines[0]
    seen = invocations(tmp_path)[0]["env"]
    assert seen["FTKIT_FATAL_DIR"] == str(job / "attempt-0.fatal")
    assert not (job / "attempt-0.fatal").exists()             # cleaned after the attempt
    events = list(read_events(job / "events.jsonl"))
    assert [e["event"] for e in events] == ["launch", "attempt-end", "gave-up"]
    for e in events[1:]:
        assert (e["kind"], e["rank"], e["retry"], e["status"]) == ("ConfigError", 1, False, 3)
        assert e["rank_host"] == e["host"] == socket.gethostname()
        assert e["reason"].startswith("not retried: ConfigError: FTKIT_LEVELS: unknown level")
    assert events[1]["rc"] == 1 and events[-1]["attempts"] == 1


@pytest.mark.timeout(60)
def test_fatal_dir_is_fresh_per_attempt(job: Path, fatal_fake: str, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture) -> None:
    """A record left by an earlier run does not stop this one; attempt 0 fails for a reason
    that may not recur (relaunched), attempt 1 records a recurring error (stops there)."""
    stale = job / "attempt-0.fatal"
    stale.mkdir(parents=True)
    (stale / "rank-0.json").write_text(json.dumps({"kind": "ConfigError", "message": "old",
                                                   "rank": 0, "time": 0.0}))
    monkeypatch.setenv("FAKE_FATAL_ATTEMPTS", "1")
    rc = run_fake(fatal_fake, "exit:1,exit:1,ok", "--max-restarts", "3", monkeypatch=monkeypatch)
    lines = attempt_lines(capsys.readouterr().out)
    assert rc == 3
    assert [r["env"]["FTKIT_FATAL_DIR"] for r in invocations(tmp_path)] == [
        str(job / "attempt-0.fatal"), str(job / "attempt-1.fatal")]
    assert lines[0].endswith("relaunching (restart 1 of 3)")
    assert "failed: not retried: ConfigError" in lines[1] and "(rank 1)" in lines[1]
    assert not list(job.glob("attempt-*.fatal"))


@pytest.mark.timeout(60)
def test_recurring_error_of_a_hung_attempt_is_not_retried(
        job: Path, fatal_fake: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """One rank raised ConfigError, the others hung (no abort): the timeout ends the
    attempt, and the record still says a relaunch would fail the same way."""
    rc = run_fake(fatal_fake, "hang,ok", "--attempt-timeout", "1", "--max-restarts", "2",
                  monkeypatch=monkeypatch)
    lines = attempt_lines(capsys.readouterr().out)
    assert rc == 3 and len(invocations(tmp_path)) == 1
    assert "not retried: ConfigError" in lines[0]


@pytest.mark.timeout(60)
def test_record_of_a_successful_attempt_is_ignored(job: Path, fatal_fake: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that caught the error and carried on: the job succeeded, that is what counts."""
    assert run_fake(fatal_fake, "ok", monkeypatch=monkeypatch) == 0
    assert list(read_events(job / "events.jsonl"))[-1]["event"] == "done"


def test_not_retried_attempt_line_is_pure() -> None:
    fatal = {"kind": "UnrecoverableError", "message": "no copy of step 7\nmore", "rank": 2}
    res = judge(0, 1, False, 3.04, 60, fatal=fatal)
    assert (res.ok, res.status) == (False, NOT_RETRIED_STATUS)
    assert attempt_line(res, 5) == ("ftkit run: attempt 0: failed: not retried: "
                                    "UnrecoverableError: no copy of step 7 (rank 2) after 3.0 s")
    assert judge(0, 0, True, 1.0, 60, fatal=fatal).ok               # success wins
    stopped = judge(0, 143, False, 1.0, 60, interrupted=signal.SIGTERM, fatal=fatal)
    assert stopped.status == 143 and "interrupted" in attempt_line(stopped, 5)


# ------------------------------------------------------------ starting over (--fresh)
def _starts(tmp_path: Path) -> list[str | None]:
    return [r["env"].get("FTKIT_START") for r in invocations(tmp_path)]


@pytest.mark.timeout(60)
def test_fresh_is_for_attempt_zero_only(job: Path, fake: str, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    rc = run_fake(fake, "exit:1,exit:1,ok", "--fresh", "--max-restarts", "2",
                  monkeypatch=monkeypatch)
    assert rc == 0
    assert _starts(tmp_path) == ["fresh", "resume", "resume"]
    launches = [e for e in read_events(job / "events.jsonl") if e["event"] == "launch"]
    assert [e["start"] for e in launches] == ["fresh", "resume", "resume"]


@pytest.mark.timeout(60)
def test_resume_is_the_default(job: Path, fake: str, tmp_path: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_fake(fake, "exit:1,ok", "--max-restarts", "1", monkeypatch=monkeypatch) == 0
    assert _starts(tmp_path) == ["resume", "resume"]


@pytest.mark.timeout(60)
def test_fresh_from_the_environment_is_not_repeated_by_relaunches(
        job: Path, fake: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FTKIT_START=fresh exported by the user starts over once, not on every relaunch."""
    monkeypatch.setenv("FTKIT_START", "fresh")
    assert run_fake(fake, "exit:1,ok", "--max-restarts", "1", monkeypatch=monkeypatch) == 0
    assert _starts(tmp_path) == ["fresh", "resume"]


@pytest.mark.timeout(60)
def test_fresh_is_not_repeated_after_a_slurm_requeue(job: Path, fake: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture) -> None:
    """A requeued batch script runs the same ``ftkit run --fresh`` again: it must resume."""
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert run_fake(fake, "ok", "--fresh", monkeypatch=monkeypatch) == 0
    assert _starts(tmp_path) == ["resume"]
    assert "requeued" in capsys.readouterr().err


# ------------------------------------------------------------------------ the CLI itself
def test_cli_separator_and_options_after_it(job: Path, fake: str, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_MPIEXEC_PLAN", "ok")
    assert main(["run", "-n", "2", "--mpiexec", fake, "--", "python", "-u", "t.py", "-n", "5"]) == 0
    assert main(["run", "-n", "3", "--mpiexec", fake, "./a.out", "--flag"]) == 0
    first, second = (r["argv"] for r in invocations(tmp_path))
    assert first == ["-n", "2", "python", "-u", "-m", "mpi4py", "t.py", "-n", "5"]
    assert second == ["-n", "3", "./a.out", "--flag"]


def test_cli_bad_config_exits_2(job: Path, fake: str, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("FTKIT_ATTEMPT_TIMEOUT", "5")
    assert main(["run", "-n", "2", "--mpiexec", fake, "--", "./a.out"]) == 2
    err = capsys.readouterr().err
    assert "ftkit run: error:" in err and "FTKIT_ATTEMPT_TIMEOUT" in err
    assert not (job / "events.jsonl").exists()


@pytest.mark.parametrize("argv", [
    [], ["run"], ["run", "-n", "2"], ["run", "-n", "2", "--"], ["run", "-n", "0", "--", "x"],
    ["run", "-n", "2", "--max-restarts", "-1", "--", "x"],
    ["run", "-n", "2", "--attempt-timeout", "-1", "--", "x"],
    ["run", "-n", "2", "--launcher", "lam", "--", "x"],
    ["run", "-n", "2", "--launcher", "srun", "--", "x"],
    ["nosuchcommand"],
])
def test_cli_usage_errors_exit_2(job: Path, argv: list[str]) -> None:
    assert main(argv) == 2


def test_cli_help(capsys: pytest.CaptureFixture) -> None:
    assert main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--max-restarts" in out
    assert "--fresh" in out
    assert re.search(r"\b3\b:? [^.]*not retried", " ".join(out.split())), out


def test_cli_imports_neither_mpi4py_nor_torch() -> None:
    code = ("import sys, ftkit.cli.main, ftkit.launch; "
            "bad = {'mpi4py', 'torch'} & set(sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                   env=dict(os.environ, PYTHONPATH=str(REPO)))


# ---------------------------------------------------------------- real mpiexec smoke runs
def _real_env(job: Path) -> dict[str, str]:
    pytest.importorskip("mpi4py")
    try:
        find_mpiexec()
    except LaunchError:
        pytest.skip("no mpiexec beside this Python or on PATH")
    bindir = os.path.dirname(sys.executable)          # `python` must be this venv's
    return dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""),
                PYTHONPATH=str(REPO))


_DONE_SCRIPT = """
import json, os
from mpi4py import MPI
comm = MPI.COMM_WORLD
comm.Barrier()
if comm.Get_rank() == 0:
    with open(os.environ["FTKIT_DONE_FILE"], "w") as f:
        json.dump({"attempt": int(os.environ["FTKIT_ATTEMPT"]), "world": comm.Get_size()}, f)
"""


@pytest.mark.timeout(120)
def test_smoke_real_mpiexec(job: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ftkit.cli.main", "run", "-n", "2", "--attempt-timeout", "100",
         "--", "python", "-c", _DONE_SCRIPT],
        env=_real_env(job), capture_output=True, text=True, timeout=110, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = attempt_lines(proc.stdout)
    assert len(lines) == 1 and lines[0].startswith("ftkit run: attempt 0: succeeded after ")
    assert json.loads((job / ".done-attempt-0").read_text()) == {"attempt": 0, "world": 2}


_RAISE_SCRIPT = """
from mpi4py import MPI
comm = MPI.COMM_WORLD
if comm.Get_rank() == 1:
    raise RuntimeError("boom on rank 1")
comm.Barrier()
"""


@pytest.mark.timeout(120)
def test_smoke_uncaught_exception_aborts_instead_of_hanging(job: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ftkit.cli.main", "run", "-n", "2", "--max-restarts", "0", "--attempt-timeout", "60",
         "--", "python", "-c", _RAISE_SCRIPT],
        env=_real_env(job), capture_output=True, text=True, timeout=110, check=False)
    assert proc.returncode not in (0, 124), proc.stdout + proc.stderr
    lines = attempt_lines(proc.stdout)
    assert len(lines) == 1 and "failed (exit" in lines[0]
    assert "boom on rank 1" in proc.stderr



def test_a_multi_line_exception_text_keeps_the_attempt_line_one_line() -> None:
    """gloo's errors end with a newline: the reason of an attempt must not break its line
    (a test counting attempt lines found one missing)."""
    from ftkit.launch.failures import summary
    text = summary({0: "killed by SIGKILL on node vm",
                    3: "raised RuntimeError: [pair.cc:537] Read error\nGLHF!\n"})
    assert "\n" not in text and "Read error GLHF!" in text
    line = attempt_line(judge(0, 137, False, 1.0, 60, failed={3: "raised X:\nY\n"}), 3)
    assert "\n" not in line and "raised X: Y" in line


_FLAKY_RANKS = """
import os, pathlib, sys
runs = pathlib.Path(sys.argv[1])
seen = runs.read_text().split() if runs.exists() else []
runs.write_text(" ".join(seen + [os.environ["FTKIT_ATTEMPT"]]))
if len(seen) < int(sys.argv[2]):
    sys.stderr.write("The PMIx server's listener thread failed to start. We cannot\\n"
                     "continue.\\n")
    sys.exit(213)
pathlib.Path(os.environ["FTKIT_DONE_FILE"]).write_text("{}")
"""


def _flaky_launcher(runs: Path, failures: int) -> type[Launcher]:
    class Flaky(_ToyLauncher):
        """Its runtime fails to come up ``failures`` times before the ranks run."""

        name = "flaky"

        def command(self, n: int, cmd: Sequence[str]) -> list[str]:
            return [sys.executable, "-c", _FLAKY_RANKS, str(runs), str(failures)]
    return Flaky


@pytest.mark.parametrize("failures,launches,rc", [(1, 2, 0), (5, 3, 213)])
def test_a_launcher_that_fails_before_any_rank_ran_is_launched_again(
        launch_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str],
        failures: int, launches: int, rc: int) -> None:
    """The MPI runtime's own start-up failed (no rank ran): the same attempt is launched
    again, at most twice more, without spending a restart; faults and markers keyed by the
    attempt number stay aligned (every launch is attempt 0)."""
    monkeypatch.setattr(registry, "_ENTRIES", dict(registry._ENTRIES))
    runs = tmp_path / "runs"
    registry.register("flaky", _flaky_launcher(runs, failures))
    assert main(["run", "--launcher", "flaky", "--max-restarts", "0", "-n", "2", "--",
                 "x"]) == rc
    assert runs.read_text().split() == ["0"] * launches
    events = read_events(launch_env / "events.jsonl")
    retries = [e for e in events if e["event"] == "launch-retry"]
    assert [(e["attempt"], e["rc"]) for e in retries] == [(0, 213)] * (launches - 1)
    assert "listener thread failed to start" in retries[0]["reason"]
    out = capsys.readouterr().out
    assert out.count("launching attempt 0 again") == launches - 1
    assert out.count("ftkit run: attempt 0:") == 1, out

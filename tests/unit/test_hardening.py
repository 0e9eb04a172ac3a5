"""Hardening of inputs and of the attempt watchdog:

* sbatch scripts: environment keys and ``#SBATCH`` values cannot inject shell;
* ``FTKIT_TIMEOUT`` and the numeric keys: finite, in range, of the right type;
* hostlists: the expansion is capped (hosts and digits);
* ``ftkit run`` as root under Open MPI says once that it allows it;
* attempts: no wall-clock limit by default; one that shows no progress (its job's event log
  did not grow) for ``--stall-timeout`` seconds is killed with status 124 and relaunched.

The watchdog tests run attempts as tiny Python children (no mpiexec): a launcher whose
command is the child itself.
"""
from __future__ import annotations

import dataclasses
import io
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from ftkit.cli.main import build_parser, main
from ftkit.config import Config
from ftkit.errors import ConfigError, LaunchError
from ftkit.jobdir.events import append_event, read_events
from ftkit.launch import outcome, relaunch
from ftkit.launch import registry as launch_registry
from ftkit.launch import spec as spec_module
from ftkit.launch.base import Launcher
from ftkit.launch.relaunch import run_job
from ftkit.launch.spec import RunSpec
from ftkit.slurm.env import expand_hostlist
from ftkit.slurm.sbatch import SbatchSpec, render_sbatch

REPO = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).parent / "fakes" / "fake_mpiexec.py"
OPENMPI_VERSION = "mpiexec (Open MPI) 5.0.11\n"
SPEC = SbatchSpec(command=("python", "t.py"), nodes=2)


# ------------------------------------------------------------------------- sbatch scripts
@pytest.mark.parametrize("key", ["A=1; touch pwned; B", "1ABC", "A-B", "", "A B", "$(id)",
                                 "A\nB", "Ä"])
def test_sbatch_env_key_must_be_a_variable_name(key: str) -> None:
    with pytest.raises(LaunchError, match="sbatch") as info:
        dataclasses.replace(SPEC, env=((key, "1"),))
    assert repr(key) in str(info.value)
    assert "[A-Za-z_][A-Za-z0-9_]*" in str(info.value)


@pytest.mark.parametrize("field, value", [("job_name", "x\x00y"), ("partition", "gpu\x1b"),
                                          ("output", "o\x07.out"), ("time", "1:00\r")])
def test_sbatch_directive_values_are_printable(field: str, value: str) -> None:
    with pytest.raises(LaunchError, match=field):
        dataclasses.replace(SPEC, **{field: value})


def test_sbatch_values_and_argv_reach_bash_verbatim(tmp_path: Path) -> None:
    """Values, the command and how ftkit is called are quoted: nothing in them runs."""
    nasty = "$(touch pwned1)`touch pwned2`'\"; touch pwned3\nline2 $HOME"
    spec = dataclasses.replace(SPEC, env=(("_V1", nasty), ("v2", "")), job_name="a'b;c",
                               command=("printf", "%s|", nasty, "; touch pwned4"),
                               ftkit=("echo", "; touch pwned5"))
    body = render_sbatch(spec).replace("exec ", "", 1)
    script = tmp_path / "job.sh"
    script.write_text(body + 'printf "%s" "$_V1" > v1.txt\n')
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"], "SLURM_JOB_ID": "1"}, check=False)
    assert proc.returncode == 0, proc.stderr
    assert not list(tmp_path.glob("pwned*"))
    assert (tmp_path / "v1.txt").read_text() == nasty


# ------------------------------------------------------------------------ numeric config
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e-9", "0.5", "1e400", "604801"])
def test_timeout_is_finite_and_in_range(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config.load(env={"FTKIT_TIMEOUT": value})
    assert "FTKIT_TIMEOUT" in str(info.value) and "[1, 604800]" in str(info.value)


@pytest.mark.parametrize("value", ["1", "604800", "7.5"])
def test_timeout_bounds_are_inclusive(value: str) -> None:
    assert Config.load(env={"FTKIT_TIMEOUT": value}).timeout == float(value)


@pytest.mark.parametrize("body, key", [
    ("timeout = true", "timeout"), ("xor_set = 2.9", "xor_set"), ("rs_set = true", "rs_set"),
    ("rs_set = 300", "FTKIT_RS_SET"), ("timeout = inf", "timeout"), ("timeout = nan", "timeout"),
])
def test_toml_numbers_are_numbers_of_the_right_kind(tmp_path: Path, body: str, key: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ftkit.toml").write_text(f"[ftkit]\n{body}\n")
    with pytest.raises(ConfigError, match="(?i)" + key):
        Config.load(env={})


def test_rs_set_fits_gf256() -> None:
    assert Config.load(env={"FTKIT_RS_SET": "256", "FTKIT_RS_PARITY": "2"}).rs_set == 256
    with pytest.raises(ConfigError, match=r"FTKIT_RS_SET.*256"):
        Config.load(env={"FTKIT_RS_SET": "257"})


# ------------------------------------------------------------------------------ hostlists
@pytest.mark.timeout(20)
@pytest.mark.parametrize("expr", ["node[0-999999999]", "n[0-999999],m[0-1]",
                                  "r[0-9999]n[0-9999]", "n[1-1000000],x"])
def test_hostlist_expansion_is_capped(expr: str) -> None:
    with pytest.raises(LaunchError, match="more than 1000000 hosts") as info:
        expand_hostlist(expr)
    assert repr(expr) in str(info.value)


@pytest.mark.parametrize("expr", ["n[" + "0" * 19 + "1-2]", "n[1-" + "9" * 19 + "]",
                                  "n[" + "1" * 5000 + "]"])
def test_hostlist_numbers_are_capped(expr: str) -> None:
    with pytest.raises(LaunchError, match="more than 18 digits") as info:
        expand_hostlist(expr)
    assert repr(expr)[:40] in str(info.value)


def test_hostlist_at_the_caps() -> None:
    hosts = expand_hostlist("n[1-999999],x")
    assert len(hosts) == 1_000_000 and hosts[-1] == "x"
    assert expand_hostlist("n[" + "0" * 17 + "1-2]") == ["n" + "0" * 17 + "1",
                                                        "n" + "0" * 17 + "2"]


# --------------------------------------------------------------- Open MPI as root: once
@pytest.fixture
def job(launch_env: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """test_launch's clean ftkit environment, without the user's OMPI_ALLOW_* variables."""
    for key in list(os.environ):
        if key.startswith("OMPI_ALLOW"):
            monkeypatch.delenv(key)
    return launch_env


@pytest.fixture
def warnings_of() -> Iterator[list[logging.LogRecord]]:
    """WARNING records of ``ftkit.launch`` (the CLI stops ``ftkit`` propagating to root)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("ftkit.launch")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def _fake_mpiexec(tmp_path: Path) -> str:
    wrapper = tmp_path / "bin" / "mpiexec"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("root, user_set, warned", [(True, False, 1), (False, False, 0),
                                                    (True, True, 0)])
def test_run_as_root_is_said_once_per_run(job: Path, tmp_path: Path, root: bool, user_set: bool,
                                          warned: int, monkeypatch: pytest.MonkeyPatch,
                                          warnings_of: list[logging.LogRecord]) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0 if root else 1000)
    monkeypatch.setenv("FAKE_MPIEXEC_VERSION", OPENMPI_VERSION)
    monkeypatch.setenv("FAKE_MPIEXEC_PLAN", "exit:1,exit:1,ok")
    if user_set:
        monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT", "1")
        monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    fake = _fake_mpiexec(tmp_path)
    assert main(["run", "-n", "2", "--max-restarts", "2", "--mpiexec", fake, "--", "x"]) == 0
    said = [r.getMessage() for r in warnings_of if "OMPI_ALLOW_RUN_AS_ROOT" in r.getMessage()]
    assert len(said) == warned, said
    if warned:
        assert "root" in said[0] and "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM" in said[0]


# -------------------------------------------------------------------- the attempt watchdog
def test_no_wall_clock_limit_by_default() -> None:
    spec = RunSpec(n=1, cmd=("x",))
    assert spec.attempt_timeout == 0 and spec.stall_timeout == 3600
    args = build_parser().parse_args(["run", "-n", "1", "--", "x"])
    assert (args.attempt_timeout, args.stall_timeout) == (0, 3600)
    args = build_parser().parse_args(["run", "-n", "1", "--stall-timeout", "2",
                                      "--attempt-timeout", "9", "--", "x"])
    assert (args.attempt_timeout, args.stall_timeout) == (9, 2)


@pytest.mark.parametrize("field, value", [("attempt_timeout", -1.0), ("stall_timeout", -1.0),
                                          ("attempt_timeout", float("inf")),
                                          ("stall_timeout", float("nan"))])
def test_run_spec_rejects_bad_limits(field: str, value: float) -> None:
    name = "--" + field.replace("_", "-")
    with pytest.raises(LaunchError, match=name):
        RunSpec(n=1, cmd=("x",), **{field: value})


def test_cli_passes_the_stall_timeout(job: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[RunSpec] = []
    monkeypatch.setattr(launch_registry, "resolve", lambda *a, **k: None)
    monkeypatch.setattr(relaunch, "run_job", lambda spec, *a, **k: seen.append(spec) or 0)
    assert main(["run", "-n", "2", "--stall-timeout", "7", "--", "x"]) == 0
    assert (seen[0].stall_timeout, seen[0].attempt_timeout) == (7, 0)
    assert main(["run", "-n", "2", "--stall-timeout", "-1", "--", "x"]) == 2


def test_cli_shrink_options(job: Path, monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> None:
    """--shrink becomes RunSpec.shrink (the rank multiple, 0: off); without a PFS level to
    reshard from, or a multiple without --shrink, the run is refused before it starts."""
    seen: list[RunSpec] = []
    monkeypatch.setattr(launch_registry, "resolve", lambda *a, **k: None)
    monkeypatch.setattr(relaunch, "run_job", lambda spec, *a, **k: seen.append(spec) or 0)
    assert main(["run", "-n", "8", "--", "x"]) == 0
    assert main(["run", "-n", "8", "--shrink", "--", "x"]) == 0
    assert main(["run", "-n", "8", "--shrink", "--shrink-multiple", "4", "--", "x"]) == 0
    assert [s.shrink for s in seen] == [0, 1, 4]
    assert main(["run", "-n", "8", "--shrink-multiple", "4", "--", "x"]) == 2
    assert "--shrink-multiple only applies with --shrink" in capsys.readouterr().err
    monkeypatch.setenv("FTKIT_LEVELS", "local:1,partner:1")
    assert main(["run", "-n", "8", "--shrink", "--", "x"]) == 2
    err = capsys.readouterr().err
    assert "--shrink" in err and "FTKIT_LEVELS=local:1,partner:1 has none" in err, err
    assert len(seen) == 3


def test_watch_judges_progress_by_the_event_log(tmp_path: Path) -> None:
    """Fake clock: the attempt's start counts as progress; every change of the log too."""
    events = tmp_path / "events.jsonl"
    watch = relaunch.AttemptWatch(start=100.0, timeout=0.0, stall=10.0, events=events)
    assert not watch.expired(109.9)                      # just started, no log at all yet
    assert watch.expired(110.0) and watch.why == "stall"
    watch = relaunch.AttemptWatch(start=100.0, timeout=0.0, stall=10.0, events=events)
    append_event(events, "save", step=1)
    assert not watch.expired(105.0)                      # it grew: progress at 105
    assert not watch.expired(114.9)
    append_event(events, "commit", step=1)
    assert not watch.expired(114.95)
    assert not watch.expired(124.9)
    assert watch.expired(124.95) and watch.why == "stall"


def test_watch_wall_clock_and_off(tmp_path: Path) -> None:
    timed = relaunch.AttemptWatch(start=0.0, timeout=5.0, stall=0.0, events=None)
    assert not timed.expired(4.99) and timed.expired(5.0) and timed.why == "timeout"
    off = relaunch.AttemptWatch(start=0.0, timeout=0.0, stall=0.0, events=tmp_path / "e")
    assert not off.expired(1e9) and off.why is None


def test_watch_startup_ends_at_the_first_event(tmp_path: Path) -> None:
    """``--in-job``'s start-up deadline: only until the job's first event (every process
    passed MPI_Init); after it, only the stall watchdog (here: none) counts."""
    events = tmp_path / "events.jsonl"
    append_event(events, "launch", n=4)                 # ftkit run's own, before the start
    silent = relaunch.AttemptWatch(start=0.0, timeout=0.0, stall=0.0, events=events,
                                   startup=30.0)
    assert not silent.expired(29.9)
    assert silent.expired(30.0) and silent.why == "startup"
    started = relaunch.AttemptWatch(start=0.0, timeout=0.0, stall=0.0, events=events,
                                    startup=30.0)
    assert not started.expired(10.0)
    append_event(events, "in-job-start", processes=4)
    assert not started.expired(20.0) and started.started
    assert not started.expired(1e6) and started.why is None
    res = outcome.judge(0, None, False, 30.4, 0.0, startup=30.0)
    assert res.status == 124 and not res.ok
    assert res.reason == ("the job did not start within 30 s (no event: a process died or "
                          "hung during start-up, before MPI could report it)")


def test_the_startup_deadline_is_on_by_default_with_in_job_only() -> None:
    args = build_parser().parse_args(["run", "-n", "2", "--in-job", "--", "x"])
    assert args.startup_timeout == spec_module.DEFAULT_STARTUP_TIMEOUT <= 300
    with pytest.raises(LaunchError, match="--startup-timeout"):
        RunSpec(n=1, cmd=("x",), startup_timeout=-1)


def test_stall_reason_in_the_attempt_line() -> None:
    res = outcome.judge(0, None, False, 2.4, 0.0, stalled=2.0)
    assert (res.status, res.reason) == (124, "no progress for 2 s (no checkpoint event)")
    assert outcome.attempt_line(res, 1) == (
        "ftkit run: attempt 0: failed (no progress for 2 s (no checkpoint event)); "
        "relaunching (restart 1 of 1)")


_CHILD = """
import os, sys, time
from ftkit.config import Config
from ftkit.jobdir.events import append_event
plan = sys.argv[1].split(",")
what = plan[min(int(os.environ["FTKIT_ATTEMPT"]), len(plan) - 1)]
if what == "silent":
    time.sleep(600)                  # hung: alive, never writes an event
events, every = Config.load().events_path, float(sys.argv[2]) / 10
for i in range(int(what)):           # healthy: an event every tenth of the stall timeout
    append_event(events, "save", step=i)
    time.sleep(every)
with open(os.environ["FTKIT_DONE_FILE"], "w") as f:
    f.write("{}")
"""


@dataclasses.dataclass(frozen=True)
class _ChildLauncher(Launcher):
    """Runs each attempt as one Python child acting out ``plan`` (no mpiexec)."""

    plan: str
    stall: float
    name: str = "child"

    def command(self, n: int, cmd: Sequence[str]) -> list[str]:
        return [sys.executable, "-c", _CHILD, self.plan, str(self.stall)]

    def environ(self, base: Mapping[str, str]) -> dict[str, str]:
        return dict(base, PYTHONPATH=str(REPO))


def _run(job: Path, plan: str, stall: float, restarts: int) -> tuple[int, list[str], float]:
    spec = RunSpec(n=1, cmd=("child",), max_restarts=restarts, stall_timeout=stall,
                   kill_grace=2.0)
    out = io.StringIO()
    start = time.monotonic()
    rc = run_job(spec, Config.load(), _ChildLauncher(plan, stall), out=out)
    return rc, out.getvalue().splitlines(), time.monotonic() - start


@pytest.mark.timeout(60)
def test_silent_attempt_is_killed_after_the_stall_timeout(job: Path) -> None:
    rc, lines, took = _run(job, "silent", 1.0, 0)
    assert rc == 124
    line = ("ftkit run: attempt 0: failed (no progress for 1 s (no checkpoint event)); "
            "no restarts left")
    assert lines == [line]
    assert took < 30                                     # not the child's 600 s
    end = next(e for e in read_events(job / "events.jsonl") if e["event"] == "attempt-end")
    assert (end["rc"], end["status"], end["reason"]) == (
        None, 124, "no progress for 1 s (no checkpoint event)")


@pytest.mark.timeout(60)
def test_stalled_attempt_is_relaunched_and_progress_keeps_one_alive(job: Path) -> None:
    """Attempt 0 stalls (relaunched like a timeout); attempt 1 writes events for three stall
    timeouts and is not killed."""
    rc, lines, _ = _run(job, "silent,30", 1.0, 1)
    assert rc == 0, lines
    assert lines[0].endswith("(no progress for 1 s (no checkpoint event)); relaunching "
                             "(restart 1 of 1)")
    assert lines[1].startswith("ftkit run: attempt 1: succeeded after ")
    assert float(lines[1].split("after ")[1].split(" s")[0]) >= 3 * 1.0
    saves = [e for e in read_events(job / "events.jsonl") if e["event"] == "save"]
    assert len(saves) == 30


_UNLOADABLE = """
import os, sys
from ftkit.config import Config
from ftkit.jobdir.events import append_event
if sys.argv[1] == "after-start":
    append_event(Config.load().events_path, "restore", step=0)
print("Traceback (most recent call last):", file=sys.stderr)
print('  File "train.py", line 3, in <module>', file=sys.stderr)
print("ModuleNotFoundError: No module named 'nosuch'", file=sys.stderr, flush=True)
sys.exit(1)
"""


@dataclasses.dataclass(frozen=True)
class _UnloadableLauncher(Launcher):
    """Each attempt: one child that prints a rank's ImportError traceback and fails, before
    or after the job's first event."""

    when: str
    name: str = "child"

    def command(self, n: int, cmd: Sequence[str]) -> list[str]:
        return [sys.executable, "-c", _UNLOADABLE, self.when]

    def environ(self, base: Mapping[str, str]) -> dict[str, str]:
        return dict(base, PYTHONPATH=str(REPO))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["before-start", "after-start"])
def test_a_script_that_cannot_be_loaded_is_not_retried(job: Path, when: str) -> None:
    """An ImportError printed before the job wrote any event recurs at every launch: one
    attempt, status 3, the line says what could not be loaded. After the job started (an
    event was written) the same line is retried like any failure."""
    spec = RunSpec(n=1, cmd=("child",), max_restarts=2, kill_grace=2.0)
    out = io.StringIO()
    rc = run_job(spec, Config.load(), _UnloadableLauncher(when), out=out)
    lines = out.getvalue().splitlines()
    if when == "before-start":
        assert rc == 3 and len(lines) == 1, lines
        assert lines[0].startswith("ftkit run: attempt 0: failed: not retried: "
                                   "ModuleNotFoundError: No module named 'nosuch' (before the "
                                   "job started: the script or a module it imports cannot be "
                                   "loaded)"), lines
    else:
        assert rc == 1 and len(lines) == 3, lines
        assert all("not retried" not in ln for ln in lines), lines

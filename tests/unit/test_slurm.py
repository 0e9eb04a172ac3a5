"""Tests of ``ftkit.slurm`` and the relaunch loop's Slurm paths, without Slurm or MPI:
``scontrol``/``srun`` are fakes and each attempt of the loop is a tiny Python script."""
from __future__ import annotations

import dataclasses
import io
import json
import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftkit.config import Config
from ftkit.errors import LaunchError
from ftkit.jobdir.events import append_event, read_events
from ftkit.launch.base import Launcher, Recovery
from ftkit.launch.mpiexec import SPARES_ENV, MpiexecLauncher
from ftkit.launch.relaunch import _Interrupt, run_job, stop_file_path
from ftkit.launch.slurm import SlurmLauncher
from ftkit.launch.spec import RunSpec
from ftkit.slurm import health
from ftkit.slurm.env import SlurmEnv, compress_hostlist, expand_hostlist
from ftkit.slurm.health import SlurmTools
from ftkit.slurm.sbatch import TEMPLATES, SbatchSpec, render_sbatch

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------ hostlists
@pytest.mark.parametrize("expr, hosts", [
    ("n[1-3,7]", ["n1", "n2", "n3", "n7"]), ("gpu[08-11]", ["gpu08", "gpu09", "gpu10", "gpu11"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]), ("n[1-2],login", ["n1", "n2", "login"]),
    ("login,n[9-10]", ["login", "n9", "n10"]), ("n1", ["n1"]), ("n[ 1 , 3 ]", ["n1", "n3"]),
])
def test_expand_hostlist(expr: str, hosts: list[str]) -> None:
    assert expand_hostlist(expr) == hosts


@pytest.mark.parametrize("expr, why", [
    ("n[1-3", "unbalanced '\\['"), ("n1-3]", "unbalanced '\\]'"), ("n[3-1]", "backwards"),
    ("n[a]", "not N or N-M"), ("n[]", "not N or N-M"),
])
def test_expand_hostlist_rejects(expr: str, why: str) -> None:
    with pytest.raises(LaunchError, match=why) as info:
        expand_hostlist(expr)
    assert repr(expr) in str(info.value)


def test_compress_hostlist_examples() -> None:
    assert compress_hostlist(["n1", "n2", "n3", "n7"]) == "n[1-3,7]"
    assert compress_hostlist(["gpu08", "gpu09", "gpu10"]) == "gpu[08-10]"
    assert compress_hostlist(["n1", "n2", "login"]) == "n[1-2],login"
    assert compress_hostlist(["n3", "n1", "n2"]) == "n[3,1-2]"      # order is kept


_PREFIX = st.from_regex(r"[a-z]([a-z0-9-]{0,3}[a-z-])?", fullmatch=True)
# one block per prefix: (prefix, zero-padding width or 0, distinct numbers)
_BLOCKS = st.lists(st.tuples(_PREFIX, st.sampled_from([0, 2, 3]),
                             st.sets(st.integers(0, 1200), min_size=1, max_size=8)),
                   min_size=1, max_size=4, unique_by=lambda b: b[0])


@settings(max_examples=300, deadline=None)
@given(blocks=_BLOCKS)
def test_compress_roundtrip_sorted_per_prefix(blocks: list) -> None:
    """Names prefix+number, one padding style per prefix, sorted per prefix, prefixes in
    blocks: compressing and expanding gives back the exact list."""
    xs = [f"{p}{str(i).zfill(w)}" for p, w, nums in blocks for i in sorted(nums)]
    assert expand_hostlist(compress_hostlist(xs)) == xs


@pytest.mark.parametrize("xs", [["n1", "n02", "n3"], ["gpu100", "gpu05", "gpu101"]])
def test_compress_roundtrip_mixed_widths_keeps_order(xs: list[str]) -> None:
    assert expand_hostlist(compress_hostlist(xs)) == xs


# ------------------------------------------------------------------------------- SLURM_*
def test_slurm_env_from_environ() -> None:
    assert SlurmEnv.from_environ({"SLURM_JOB_NODELIST": "n[1-2]"}) is None   # no allocation
    env = SlurmEnv.from_environ({
        "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-3],gpu[08-09]",
        "SLURM_NODELIST": "x1", "SLURM_NTASKS_PER_NODE": "2(x4)", "SLURM_RESTART_COUNT": "3",
        "SLURMD_NODENAME": "n2", "SLURM_CLUSTER_NAME": "c"})
    assert env == SlurmEnv("42", ("n1", "n2", "n3", "gpu08", "gpu09"), 2, 3, "n2", "c")
    assert SlurmEnv.from_environ({"SLURM_JOBID": "7", "SLURM_NODELIST": "n[4-5]"}) == \
        SlurmEnv("7", ("n4", "n5"), None, 0, None, None)                  # fallbacks


@pytest.mark.parametrize("key", ["SLURM_NTASKS_PER_NODE", "SLURM_RESTART_COUNT"])
def test_slurm_env_malformed_number(key: str) -> None:
    with pytest.raises(LaunchError, match=key):
        SlurmEnv.from_environ({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1", key: "x2"})


# -------------------------------------------------------------------------------- health
NODE_LINES = (
    "NodeName=n1 Arch=x86_64 CoresPerSocket=1 CPUAlloc=2 CPUTot=2 NodeAddr=127.0.0.1 "
    "NodeHostName=vm Version=22.05.8 Sockets=2 Boards=1 State=ALLOCATED ThreadsPerCore=1 "
    "TmpDisk=0 Weight=1 Partitions=debug\n"
    "NodeName=n2 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUTot=2 NodeHostName=vm "
    "State=DOWN+NOT_RESPONDING ThreadsPerCore=1 Reason=ftkit-test [root@2026-11-29T18:50:01]\n"
    "NodeName=n3 Arch=x86_64 NodeHostName=vm State=IDLE+DRAIN ThreadsPerCore=1 "
    "Reason=maint [admin@2026-11-29T18:00:00]\n")
JOB_TEXT = (
    "JobId=12 JobName=ftkit UserId=root(0) GroupId=root(0) JobState=RUNNING Reason=None "
    "Requeue=1 Restarts=0 BatchFlag=1 ReqNodeList=(null) ExcNodeList=(null) "
    "NodeList=n[1,3-5] BatchHost=n1 NumNodes=4 NumCPUs=8 NumTasks=10 CPUs/Task=1")


def test_parse_node_states() -> None:
    assert health.parse_node_states(NODE_LINES) == {
        "n1": "ALLOCATED", "n2": "DOWN+NOT_RESPONDING", "n3": "IDLE+DRAIN"}


@pytest.mark.parametrize("state, bad", [
    *((s, False) for s in ("IDLE", "ALLOCATED", "MIXED", "ALLOCATED+COMPLETING")),
    *((s, True) for s in ("DOWN", "IDLE+DRAIN", "ALLOCATED*", "DOWN+NOT_RESPONDING", "FAIL",
                          "MIXED+DRAIN", "idle+drain")),
])
def test_state_is_bad(state: str, bad: bool) -> None:
    assert health.state_is_bad(state) is bad


@pytest.mark.parametrize("text", [
    JOB_TEXT,
    JOB_TEXT.replace("ReqNodeList=(null)", "ReqNodeList=n9").replace(
        "ExcNodeList=(null)", "ExcNodeList=n2"),
    # NodeList before the Req/Exc lists: still the real one
    "JobId=12 NodeList=n[1,3-5] ReqNodeList=n7 ExcNodeList=n8 BatchHost=n1",
])
def test_parse_job_nodes_picks_nodelist(text: str) -> None:
    assert health.parse_job_nodes(text) == ["n1", "n3", "n4", "n5"]


def test_parse_job_nodes_absent() -> None:
    assert health.parse_job_nodes("JobId=1 JobState=PENDING ReqNodeList=n1 NodeList=(null)") \
        is None
    assert health.parse_job_nodes("slurm_load_jobs error: Invalid job id specified") is None


def test_classify_precedence_and_reasons() -> None:
    used = ["n1", "n2", "n3", "n4", "n5"]
    states = {"n1": "ALLOCATED", "n2": "DOWN", "n3": "ALLOCATED", "n4": "MIXED"}
    failed = health.classify(used, states, ["n1", "n4"], {"n2": "x", "n3": "y", "n4": "rc 1"})
    assert failed == {"n2": "Slurm state DOWN",
                      "n3": "removed from the job's node list by Slurm",
                      "n4": "health probe failed: rc 1",
                      "n5": "removed from the job's node list by Slurm"}
    # no job node list known: only states and probes count
    assert health.classify(used, states, None, {}) == {"n2": "Slurm state DOWN"}
    assert health.classify(["n1"], {"n1": "IDLE"}, ["n1"], {}) == {}


class FakeRunner:
    """Stands in for subprocess: answers ``scontrol`` from canned text, records argv."""

    def __init__(self, job: tuple[int, str] = (0, JOB_TEXT), requeue: tuple[int, str] = (0, "")):
        self.calls: list[list[str]] = []
        self.answers = {"node": (0, NODE_LINES), "job": job, "requeue": requeue}

    def __call__(self, argv: Sequence[str], timeout: float) -> tuple[int, str]:
        self.calls.append(list(argv))
        return self.answers[argv[2] if argv[1] == "show" else argv[1]]


def test_slurm_tools_queries_through_runner() -> None:
    runner = FakeRunner(job=(1, "slurm_load_jobs error"),
                        requeue=(1, "scontrol: error: Requested operation is disabled\n"))
    tools = SlurmTools("12", runner=runner)
    assert tools.node_states(["n1", "n2"])["n2"] == "DOWN+NOT_RESPONDING"
    assert runner.calls[-1] == ["scontrol", "show", "node", "-o", "n1,n2"]
    assert tools.job_nodes() is None                                   # rc 1: unknown
    assert runner.calls[-1] == ["scontrol", "show", "job", "-o", "12"]
    assert tools.requeue() == (False, "scontrol: error: Requested operation is disabled")
    assert runner.calls[-1] == ["scontrol", "requeue", "12"]
    assert SlurmTools("12", runner=FakeRunner()).requeue() == (True, "")


def test_failed_nodes_probes_only_healthy(monkeypatch: pytest.MonkeyPatch) -> None:
    probed: list[list[str]] = []

    def probe(self: SlurmTools, nodes: Sequence[str]) -> dict[str, str]:
        probed.append(list(nodes))
        return {"n4": "no answer within 20 s"}

    monkeypatch.setattr(SlurmTools, "probe", probe)
    tools = SlurmTools("12", runner=FakeRunner())
    # n2 DOWN, n3 DRAIN (states); n6 not in NodeList=n[1,3-5]; n1, n4, n5 look healthy
    failed = tools.failed_nodes(["n1", "n2", "n3", "n4", "n5", "n6"])
    assert probed == [["n1", "n4", "n5"]]
    assert failed == {"n2": "Slurm state DOWN+NOT_RESPONDING", "n3": "Slurm state IDLE+DRAIN",
                      "n4": "health probe failed: no answer within 20 s",
                      "n6": "removed from the job's node list by Slurm"}


# ------------------------------------------------------------------------------ launcher
class FakeTools:
    def __init__(self, *failures: dict[str, str], requeue: tuple[bool, str] = (True, "")):
        self.failures, self.requeue_result = list(failures), requeue
        self.asked: list[list[str]] = []

    def failed_nodes(self, used: Sequence[str]) -> dict[str, str]:
        self.asked.append(list(used))
        return self.failures.pop(0)

    def requeue(self) -> tuple[bool, str]:
        return self.requeue_result


MPI = MpiexecLauncher(path="/x/mpiexec", flavor="openmpi")


def senv(nodes: str = "n[1-5]") -> SlurmEnv:
    return SlurmEnv("12", tuple(expand_hostlist(nodes)), 2, 0, "n1", None)


def launcher(tmp_path: Path, tools: FakeTools, n: int = 8, spares: int = 1,
             nodes: str = "n[1-5]", shrink: int = 0, in_job: bool = False) -> SlurmLauncher:
    return SlurmLauncher(MPI, senv(nodes), n, spares, tmp_path / "job" / "slurm-slots.json",
                         tools=tools, shrink=shrink, in_job=in_job)  # type: ignore[arg-type]


def test_launcher_command_and_env(tmp_path: Path) -> None:
    sl = launcher(tmp_path, FakeTools())
    assert sl.command(8, ["python", "train.py"]) == [
        "/x/mpiexec", "--oversubscribe", "--bind-to", "none", "--host", "n1:2,n2:2,n3:2,n4:2",
        "--map-by", "slot", "-n", "8", "python", "-m", "mpi4py", "train.py"]
    env = sl.environ({"A": "1"})
    assert (env["FTKIT_RANKS_PER_NODE"], env["PMIX_SECURITY_MODE"], env["A"]) == \
        ("2", "native", "1")
    assert sl.environ({"PMIX_SECURITY_MODE": "munge"})["PMIX_SECURITY_MODE"] == "munge"
    assert sl.describe()["slots"] == ["n1", "n2", "n3", "n4"] and sl.spares() == ["n5"]
    assert json.loads((tmp_path / "job" / "slurm-slots.json").read_text())["slots"] == \
        ["n1", "n2", "n3", "n4"]


def test_in_job_launch_puts_spare_ranks_on_the_spare_nodes(tmp_path: Path) -> None:
    sl = launcher(tmp_path, FakeTools(), nodes="n[1-6]", spares=2, in_job=True)
    argv = sl.command(8, ["python", "train.py"])
    assert argv[argv.index("--host") + 1] == "n1:2,n2:2,n3:2,n4:2,n5:2,n6:2"
    assert argv[argv.index("-n") + 1] == "12"                 # 8 working + 2 nodes x 2
    assert argv[argv.index("--with-ft") + 1] == "ulfm"
    assert sl.environ({})[SPARES_ENV] == "4"
    assert SPARES_ENV not in launcher(tmp_path, FakeTools()).environ({})
    with pytest.raises(LaunchError, match="ULFM"):
        SlurmLauncher(MpiexecLauncher(path="/x/mpiexec", flavor="mpich"), senv(), 8, 1,
                      tmp_path / "s.json", tools=FakeTools(), in_job=True)  # type: ignore[arg-type]


def test_slots_follow_a_node_that_moved_in_job(tmp_path: Path) -> None:
    """Rank 5 (slot 2, n3) failed in the job; its node moved to the spare node n5
    (processes 8 and 9); the job then fell back to a relaunch: slot 2 is n5 now and n3,
    healthy, is a spare again."""
    sl = launcher(tmp_path, FakeTools({}), in_job=True)
    sl.command(8, ["./a.out"])
    events = tmp_path / "job" / "events.jsonl"
    for event in ({"event": "in-job", "replaced": {"0": 9}},        # an earlier attempt's
                  {"event": "launch", "attempt": 1},
                  {"event": "in-job", "replaced": {"4": 8, "5": 9}, "moved": [4]}):
        append_event(events, **event)
    rec = sl.after_failure()
    assert rec.action == "relaunch" and sl.slots == ["n1", "n2", "n5", "n4"]
    assert sl.spares() == ["n3"]
    assert json.loads(sl.state_file.read_text())["slots"] == ["n1", "n2", "n5", "n4"]
    assert sl.follow_in_job() == {}                      # nothing moved again


def test_launcher_swaps_spare_then_requeues(tmp_path: Path) -> None:
    tools = FakeTools({}, {"n3": "Slurm state DOWN"}, {"n1": "health probe failed: rc 1"})
    sl = launcher(tmp_path, tools)
    rec = sl.after_failure()                        # software failure: same nodes again
    assert (rec.action, rec.failed, rec.replaced) == ("relaunch", {}, {})
    assert "same nodes" in rec.message and sl.slots == ["n1", "n2", "n3", "n4"]
    rec = sl.after_failure()
    assert (rec.action, rec.replaced, rec.failed) == \
        ("relaunch", {"n3": "n5"}, {"n3": "Slurm state DOWN"})
    assert "n3" in rec.message and "n3->n5" in rec.message
    assert sl.slots == ["n1", "n2", "n5", "n4"]
    assert " --host n1:2,n2:2,n5:2,n4:2 " in " ".join(sl.command(8, ["./a.out"]))
    state = json.loads(sl.state_file.read_text())
    assert state["slots"] == ["n1", "n2", "n5", "n4"] and "n3" in state["failed"]
    assert sl.spares() == []                            # n3 failed, n5 in use
    rec = sl.after_failure()
    assert tools.asked == [["n1", "n2", "n3", "n4"]] * 2 + [["n1", "n2", "n5", "n4"]]
    assert rec.action == "requeue" and rec.failed == {"n1": "health probe failed: rc 1"}
    assert "n1" in rec.message and "spare" in rec.message
    assert sl.requeue() == (True, "")


def test_launcher_shrinks_when_out_of_spares(tmp_path: Path) -> None:
    """--shrink-multiple 4 with 2 ranks per node: n3 takes the spare n5; then n1 fails with
    no spare left: 3 healthy nodes hold 6 ranks, not a multiple of 4, so the job goes on with
    4 ranks on the first 2 healthy slots and n4 becomes the spare, which the next failure
    takes like any spare."""
    tools = FakeTools({"n3": "Slurm state DOWN"}, {"n1": "Slurm state DOWN"},
                      {"n2": "removed from the job's node list by Slurm"})
    sl = launcher(tmp_path, tools, shrink=4)
    assert sl.after_failure().replaced == {"n3": "n5"}
    rec = sl.after_failure()
    assert (rec.action, rec.failed, rec.n) == ("shrink", {"n1": "Slurm state DOWN"}, 4)
    assert "out of spare nodes" in rec.message and "8 -> 4 ranks" in rec.message, rec.message
    assert "n4 kept as spare" in rec.message, rec.message
    assert sl.slots == ["n2", "n5"] and sl.spares() == ["n4"]
    argv = " ".join(sl.command(4, ["./a.out"]))
    assert " --host n2:2,n5:2 " in argv and " -n 4 " in argv, argv
    assert json.loads(sl.state_file.read_text())["slots"] == ["n2", "n5"]
    rec = sl.after_failure()
    assert (rec.action, rec.replaced, rec.n) == ("relaunch", {"n2": "n4"}, None)
    assert sl.slots == ["n4", "n5"]


@pytest.mark.parametrize("multiple", [0, 16])
def test_launcher_requeues_when_it_cannot_shrink(tmp_path: Path, multiple: int) -> None:
    """Without --shrink (0), or when no count of the healthy nodes holds a multiple of 16
    ranks, a failure with no spare left asks for a requeue and keeps the slots."""
    tools = FakeTools({"n2": "Slurm state DOWN"})
    sl = launcher(tmp_path, tools, spares=0, nodes="n[1-4]", shrink=multiple)
    rec = sl.after_failure()
    assert (rec.action, rec.n) == ("requeue", None) and "out of spare nodes" in rec.message
    assert sl.slots == ["n1", "n2", "n3", "n4"]


@pytest.mark.parametrize("n, spares, match", [(7, 1, "divide evenly"), (8, 5, "--spares 5"),
                                              (8, 9, "only 5 node")])
def test_launcher_rejects(tmp_path: Path, n: int, spares: int, match: str) -> None:
    with pytest.raises(LaunchError, match=match):
        launcher(tmp_path, FakeTools(), n=n, spares=spares)


def test_requeued_job_keeps_its_slots(tmp_path: Path) -> None:
    state = tmp_path / "job" / "slurm-slots.json"
    state.parent.mkdir()
    state.write_text(json.dumps({"slots": ["n1", "n5", "n3", "n4"]}))
    assert launcher(tmp_path, FakeTools()).slots == ["n1", "n5", "n3", "n4"]
    # the new allocation lacks n5: its slot is refilled, the others stay
    sl = launcher(tmp_path, FakeTools(), nodes="n[1-4,6]")
    assert sl.slots == ["n1", "n2", "n3", "n4"] and sl.spares() == ["n6"]
    # a slot map of another shape is not reused
    state.write_text(json.dumps({"slots": ["n5", "n4"]}))
    assert launcher(tmp_path, FakeTools()).slots == ["n1", "n2", "n3", "n4"]


# -------------------------------------------------------------------------------- sbatch
SPEC = SbatchSpec(command=("python", "t.py", "--msg", "it's a $test"), nodes=3, spares=2,
                  tasks_per_node=4, time="00:10:00", max_restarts=5,
                  env=(("MSG", "a b $HOME"), ("FTKIT_LEVELS", "local:1")),
                  setup=("module load x", "source .venv/bin/activate"))


def test_render_sbatch() -> None:
    lines = render_sbatch(SPEC).splitlines()
    directives = [line for line in lines if line.startswith("#SBATCH ")]
    for d in ("--nodes=5", "--ntasks-per-node=4", "--time=00:10:00", "--no-kill", "--requeue",
              "--signal=B:USR1@120"):
        assert f"#SBATCH {d}" in directives
    assert lines[0] == "#!/bin/bash"
    assert not any("--partition" in d or "--no-requeue" in d for d in directives)
    assert "export MSG='a b $HOME'" in lines
    assert lines.index("module load x") < lines.index("source .venv/bin/activate") \
        < len(lines) - 1
    assert lines[-1].startswith("exec ")
    assert shlex.split(lines[-1][len("exec "):]) == [
        "ftkit", "run", "--launcher", "auto", "-n", "12", "--spares", "2", "--max-restarts",
        "5", "--", "python", "t.py", "--msg", "it's a $test"]
    text = render_sbatch(dataclasses.replace(SPEC, signal_seconds=0, requeue=False,
                                             partition="gpu"))
    assert "#SBATCH --signal" not in text
    assert "#SBATCH --no-requeue\n" in text and "#SBATCH --requeue\n" not in text
    assert "#SBATCH --partition=gpu\n" in text


@pytest.mark.parametrize("field, value", [("command", ()), ("nodes", 0), ("spares", -1),
                                          ("tasks_per_node", 0), ("signal_seconds", -1),
                                          ("max_restarts", -1), ("gpus_per_node", 0),
                                          ("cpus_per_task", 0), ("account", "a b")])
def test_sbatch_spec_rejects(field: str, value: Any) -> None:
    with pytest.raises(LaunchError, match="sbatch"):
        dataclasses.replace(SPEC, **{field: value})


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_committed_sbatch_files_match_templates(name: str) -> None:
    assert (REPO / "slurm" / name).read_text() == render_sbatch(TEMPLATES[name])


def test_rendered_script_is_valid_bash(tmp_path: Path) -> None:
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(SPEC))
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True,
                           check=False)
    assert check.returncode == 0, check.stderr
    exports = "\n".join(line for line in render_sbatch(SPEC).splitlines()
                        if line.startswith("export MSG="))
    shown = subprocess.run(["bash", "-c", exports + '\nprintf %s "$MSG"'],
                           capture_output=True, text=True, check=True)
    assert shown.stdout == "a b $HOME"


# ------------------------------------------------------------ relaunch loop with Slurm fakes
ATTEMPT = """\
import json, os, pathlib, sys
plan, log = json.loads(sys.argv[1]), sys.argv[2]
step = plan[int(os.environ["FTKIT_ATTEMPT"])]
stop = os.environ.get("FTKIT_STOP_FILE")
with open(log, "a") as f:
    f.write(json.dumps({"stop": stop, "stop_exists": bool(stop) and os.path.exists(stop),
                        "argv": sys.argv[3:]}) + "\\n")
if "marker" in step:
    pathlib.Path(os.environ["FTKIT_DONE_FILE"]).write_text(json.dumps(step["marker"]))
if "fatal" in step:                      # a rank raising UnrecoverableError, as the ranks do
    sys.path.insert(0, step["fatal"]["repo"])
    from ftkit.errors import UnrecoverableError
    from ftkit.jobdir.fatal import record_fatal
    record_fatal(UnrecoverableError(step["fatal"]["message"]), step["fatal"]["rank"])
sys.exit(step["rc"])
"""
OK = {"rc": 0, "marker": {}}


def attempt_argv(tmp_path: Path, plan: list[dict]) -> list[str]:
    """argv of a fake attempt acting out ``plan[$FTKIT_ATTEMPT]`` (rc, completion marker)."""
    script = tmp_path / "attempt.py"
    script.write_text(ATTEMPT)
    return [sys.executable, str(script), json.dumps(plan), str(tmp_path / "attempts.log")]


def attempts(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "attempts.log").read_text().splitlines()]


class FakeSlurm(Launcher):
    """A launcher with the Slurm launcher's recovery API (after_failure, requeue)."""

    name = "srun"
    recovers = True

    def __init__(self, tmp_path: Path, plan: list[dict], recoveries: Sequence[Recovery] = (),
                 requeue: tuple[bool, str] = (True, "")) -> None:
        self.argv = attempt_argv(tmp_path, plan)
        self.recoveries, self.requeue_result = list(recoveries), requeue
        self.calls: list[str] = []

    def command(self, n: int, cmd: Sequence[str]) -> list[str]:
        return self.argv

    def environ(self, base: dict[str, str]) -> dict[str, str]:
        return dict(base)

    def describe(self) -> dict[str, object]:
        return {"slots": ["n1", "n2"]}

    def after_failure(self) -> Recovery:
        self.calls.append("after_failure")
        return self.recoveries.pop(0)

    def requeue(self) -> tuple[bool, str]:
        self.calls.append("requeue")
        return self.requeue_result


@pytest.fixture
def cfg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Config:
    monkeypatch.chdir(tmp_path)
    return Config.load(env={"FTKIT_PFS_DIR": str(tmp_path / "pfs"), "FTKIT_JOB": "t",
                            "FTKIT_LOCAL_DIR": str(tmp_path / "local")})


def go(cfg: Config, launcher: object) -> tuple[int, str, list[dict]]:
    out = io.StringIO()
    rc = run_job(RunSpec(n=2, cmd=("python", "t.py"), spares=1, max_restarts=2), cfg,
                 launcher, base_env={}, out=out)  # type: ignore[arg-type]
    return rc, out.getvalue(), list(read_events(cfg.events_path))


@pytest.mark.timeout(60)
def test_relaunch_after_node_replacement(cfg: Config, tmp_path: Path) -> None:
    rec = Recovery("relaunch", {"n2": "Slurm state DOWN"}, {"n2": "n3"}, "excluding n2")
    fake = FakeSlurm(tmp_path, [{"rc": 1}, OK], [rec])
    rc, out, events = go(cfg, fake)
    assert rc == 0 and fake.calls == ["after_failure"] and len(attempts(tmp_path)) == 2
    assert "ftkit run: excluding n2" in out
    nodes = [e for e in events if e["event"] == "nodes"]
    assert len(nodes) == 1
    assert (nodes[0]["action"], nodes[0]["failed"], nodes[0]["replaced"], nodes[0]["slots"]) == \
        ("relaunch", {"n2": "Slurm state DOWN"}, {"n2": "n3"}, ["n1", "n2"])
    assert events[-1]["event"] == "done"


@pytest.mark.timeout(60)
def test_shrink_relaunches_on_fewer_ranks(cfg: Config, tmp_path: Path) -> None:
    """A ``shrink`` recovery: the next attempt is launched on its ``n`` ranks; the launch
    and nodes events say so."""
    rec = Recovery("shrink", {"n2": "Slurm state DOWN"}, {}, "out of spare nodes; --shrink",
                   n=1)
    fake = FakeSlurm(tmp_path, [{"rc": 1}, OK], [rec])
    asked: list[int] = []
    command = fake.command
    fake.command = lambda n, cmd: asked.append(n) or command(n, cmd)  # type: ignore[method-assign]
    rc, out, events = go(cfg, fake)
    assert rc == 0 and "--shrink" in out
    assert [e["n"] for e in events if e["event"] == "launch"] == [2, 1]
    assert asked[-1] == 1 and 2 in asked
    [nodes] = [e for e in events if e["event"] == "nodes"]
    assert (nodes["action"], nodes["n_before"], nodes["n"]) == ("shrink", 2, 1)


@pytest.mark.timeout(60)
def test_real_slurm_launcher_in_the_loop(cfg: Config, tmp_path: Path) -> None:
    """SlurmLauncher + run_job: n2 fails, the spare n3 takes its slot, attempt 1 succeeds."""
    wrapper = tmp_path / "mpiexec"
    wrapper.write_text("#!/bin/sh\nexec " + shlex.join(attempt_argv(tmp_path, [{"rc": 1}, OK]))
                       + ' "$@"\n')
    wrapper.chmod(0o755)
    tools = FakeTools({"n2": "Slurm state DOWN"})
    sl = SlurmLauncher(MpiexecLauncher(str(wrapper), "mpich"), senv("n[1-3]"), 2, 1,
                       cfg.job_pfs_dir / "slurm-slots.json", tools=tools)  # type: ignore[arg-type]
    rc, _, events = go(cfg, sl)
    assert rc == 0 and tools.asked == [["n1", "n2"]]
    hosts = [a["argv"][a["argv"].index("--host") + 1] for a in attempts(tmp_path)]
    assert hosts == ["n1:1,n2:1", "n1:1,n3:1"]
    nodes = next(e for e in events if e["event"] == "nodes")
    assert (nodes["replaced"], nodes["slots"]) == ({"n2": "n3"}, ["n1", "n3"])
    assert [e["slots"] for e in events if e["event"] == "launch"] == [["n1", "n2"], ["n1", "n3"]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ok, detail, status, said", [
    (True, "", 0, "requeued the job"),
    (False, "Requested operation is disabled", 75,
     "cannot requeue (Requested operation is disabled)")])
def test_requeue_when_out_of_spares(cfg: Config, tmp_path: Path, ok: bool, detail: str,
                                    status: int, said: str) -> None:
    rec = Recovery("requeue", {"n2": "x"}, {}, "out of spare nodes: n2 failed")
    fake = FakeSlurm(tmp_path, [{"rc": 1}, OK], [rec], requeue=(ok, detail))
    rc, out, events = go(cfg, fake)
    assert rc == status and said in out
    assert fake.calls == ["after_failure", "requeue"]
    assert len(attempts(tmp_path)) == 1                    # no relaunch after a requeue
    requeue = [e for e in events if e["event"] == "requeue"]
    assert len(requeue) == 1 and requeue[0]["ok"] is ok
    if not ok:
        assert events[-1]["event"] == "gave-up" and events[-1]["status"] == 75


@pytest.mark.timeout(60)
def test_stopped_marker_requeues(cfg: Config, tmp_path: Path) -> None:
    fake = FakeSlurm(tmp_path, [{"rc": 0, "marker": {"stopped": True, "last_committed": 7}}])
    rc, out, events = go(cfg, fake)
    assert rc == 0 and fake.calls == ["requeue"]
    stopped = [e for e in events if e["event"] == "stopped"]
    assert len(stopped) == 1 and stopped[0]["step"] == 7
    assert "step 7" in out
    assert "stopped at step 7" in next(e for e in events if e["event"] == "requeue")["reason"]


@pytest.mark.timeout(60)
def test_recurring_error_takes_no_spare_and_no_requeue(cfg: Config, tmp_path: Path) -> None:
    """A rank's UnrecoverableError would recur on any nodes: no node classification, no
    spare taken, no requeue; ftkit run stops with status 3."""
    fatal = {"repo": str(REPO), "rank": 3, "message": "no copy of rank 3's shard of step 8"}
    rec = Recovery("relaunch", {"n2": "Slurm state DOWN"}, {"n2": "n3"}, "excluding n2")
    fake = FakeSlurm(tmp_path, [{"rc": 1, "fatal": fatal}, OK], [rec])
    rc, out, events = go(cfg, fake)
    assert rc == 3 and fake.calls == [] and len(attempts(tmp_path)) == 1
    assert "failed: not retried: UnrecoverableError: no copy of rank 3's shard of step 8 " \
           "(rank 3)" in out
    assert not [e for e in events if e["event"] in ("nodes", "requeue", "relaunch")]
    assert (events[-1]["event"], events[-1]["retry"], events[-1]["status"]) == \
        ("gave-up", False, 3)


def test_sigusr1_creates_stop_file(tmp_path: Path) -> None:
    stop = tmp_path / "pfs" / "t" / ".stop-request"
    interrupt = _Interrupt(stop)
    interrupt.stop(signal.SIGUSR1, None)
    assert stop.exists() and interrupt.stop_asked and interrupt.signum is None


@pytest.mark.timeout(60)
def test_stale_stop_file_removed_and_passed_on(cfg: Config, tmp_path: Path) -> None:
    stop = stop_file_path(cfg)
    stop.parent.mkdir(parents=True)
    stop.touch()                                            # left over from an earlier run
    rc, _, _ = go(cfg, FakeSlurm(tmp_path, [OK]))
    assert rc == 0 and stop.is_absolute()
    assert [(a["stop"], a["stop_exists"]) for a in attempts(tmp_path)] == [(str(stop), False)]


def test_ftkit_sbatch_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``ftkit sbatch`` (the real entry point): GPU nodes, an account, whole nodes, a
    node-local NVMe directory; printed, or written executable and valid for bash."""
    from ftkit.cli.main import main
    argv = ["sbatch", "--nodes", "2", "--tasks-per-node", "4", "--gpus-per-node", "4",
            "--cpus-per-task", "8", "--account", "proj1", "--exclusive", "--local-dir",
            "/local/nvme/ftkit $x", "--pfs-dir", "/lustre/ckpt", "--setup", "module load cuda",
            "--", "python", "train.py", "--lr", "3e-4"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    for d in ("--nodes=3", "--ntasks-per-node=4", "--gpus-per-node=4", "--cpus-per-task=8",
              "--account=proj1", "--exclusive"):
        assert f"#SBATCH {d}" in lines, lines
    assert "export FTKIT_LOCAL_DIR='/local/nvme/ftkit $x'" in lines
    assert "export FTKIT_PFS_DIR=/lustre/ckpt" in lines and "module load cuda" in lines
    assert shlex.split(lines[-1])[-4:] == ["python", "train.py", "--lr", "3e-4"]
    out = tmp_path / "job.sbatch"
    assert main([*argv[:1], "--out", str(out), *argv[1:]]) == 0
    assert out.stat().st_mode & 0o111 and "sbatch " + str(out) in capsys.readouterr().out
    check = subprocess.run(["bash", "-n", str(out)], capture_output=True, text=True,
                           check=False)
    assert check.returncode == 0, check.stderr
    assert main(["sbatch", "--nodes", "2", "--job-name", "a b", "--", "x"]) == 2
    assert "job_name 'a b'" in capsys.readouterr().err
    for shrink, said in ((["--shrink"], ["--shrink"]),
                         (["--shrink", "--shrink-multiple", "4"],
                          ["--shrink", "--shrink-multiple", "4"]), ([], [])):
        assert main(["sbatch", "--nodes", "2", *shrink, "--", "x"]) == 0
        run = shlex.split(capsys.readouterr().out.splitlines()[-1])
        assert run[run.index("--max-restarts") + 2:] == [*said, "--", "x"], run

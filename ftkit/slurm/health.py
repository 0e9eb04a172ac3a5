"""Which Slurm nodes failed after an attempt died: the failure classifier.

Evidence, strongest first: the node's state in ``scontrol show node`` (DOWN, DRAIN, FAIL,
NOT_RESPONDING — Slurm's own verdict, which an admin or the health checker also sets); the
node vanished from the job's ``NodeList`` in ``scontrol show job`` (Slurm removed it from a
``--no-kill`` allocation); a short ``srun`` health probe on the node failed or timed out.
Parsing is pure (unit-tested with recorded outputs); :class:`SlurmTools` runs the commands.
"""
from __future__ import annotations

import dataclasses
import re
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence

from ftkit.slurm.env import expand_hostlist

#: State flags (``scontrol show node``'s ``State=BASE+FLAG+...``) that make a node unusable.
BAD_STATES = frozenset({"DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING",
                        "NOT_RESPONDING", "POWERED_DOWN", "POWERING_DOWN", "REBOOT_REQUESTED",
                        "INVALID_REG"})

Runner = Callable[[Sequence[str], float], tuple[int, str]]


def parse_node_states(text: str) -> dict[str, str]:
    """``scontrol show node -o`` output -> ``{node: State value}``."""
    out = {}
    for line in text.splitlines():
        name = re.search(r"\bNodeName=(\S+)", line)
        state = re.search(r"\bState=(\S+)", line)
        if name and state:
            out[name.group(1)] = state.group(1)
    return out


def state_is_bad(state: str) -> bool:
    """True for ``DOWN``, ``IDLE+DRAIN``, ``ALLOCATED*`` (``*``: not responding), ..."""
    if state.endswith("*"):
        return True
    return any(flag in BAD_STATES for flag in state.upper().split("+"))


def parse_job_nodes(text: str) -> list[str] | None:
    """The ``NodeList=`` of ``scontrol show job -o`` output (``None`` if absent)."""
    m = re.search(r"(?<![A-Za-z])NodeList=(\S+)", text)
    if not m or m.group(1) in ("(null)", ""):
        return None
    return expand_hostlist(m.group(1))


def classify(used: Sequence[str], states: Mapping[str, str], job_nodes: Iterable[str] | None,
             probe_failed: Mapping[str, str]) -> dict[str, str]:
    """``{failed node: why}`` among ``used`` (pure)."""
    failed: dict[str, str] = {}
    in_job = set(job_nodes) if job_nodes is not None else None
    for node in used:
        state = states.get(node)
        if state is not None and state_is_bad(state):
            failed[node] = f"Slurm state {state}"
        elif in_job is not None and node not in in_job:
            failed[node] = "removed from the job's node list by Slurm"
        elif node in probe_failed:
            failed[node] = f"health probe failed: {probe_failed[node]}"
    return failed


def _run(argv: Sequence[str], timeout: float) -> tuple[int, str]:
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:g} s"
    except OSError as exc:
        return 127, str(exc)
    return proc.returncode, proc.stdout + proc.stderr


@dataclasses.dataclass
class SlurmTools:
    """The Slurm commands ftkit runs (``runner`` is replaced by a fake in unit tests)."""

    job_id: str
    runner: Runner = _run
    probe_timeout: float = 20.0

    def node_states(self, nodes: Sequence[str]) -> dict[str, str]:
        _, out = self.runner(["scontrol", "show", "node", "-o", ",".join(nodes)], 30.0)
        return parse_node_states(out)

    def job_nodes(self) -> list[str] | None:
        rc, out = self.runner(["scontrol", "show", "job", "-o", self.job_id], 30.0)
        return parse_job_nodes(out) if rc == 0 else None

    def probe(self, nodes: Sequence[str]) -> dict[str, str]:
        """Run ``true`` on each node as a one-task step, all at once; ``{node: error}``."""
        procs = {node: subprocess.Popen(
            ["srun", "--jobid", self.job_id, "-N1", "-n1", "-w", node, "-K1", "--overlap",
             "--quiet", "--time=1", "true"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, text=True) for node in nodes}
        failed = {}
        for node, proc in procs.items():
            try:
                out, _ = proc.communicate(timeout=self.probe_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                failed[node] = f"no answer within {self.probe_timeout:g} s"
                continue
            if proc.returncode:
                failed[node] = (out.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return failed

    def requeue(self) -> tuple[bool, str]:
        rc, out = self.runner(["scontrol", "requeue", self.job_id], 30.0)
        return rc == 0, out.strip()

    def failed_nodes(self, used: Sequence[str]) -> dict[str, str]:
        """Classify ``used`` after an attempt died (probes only what Slurm calls healthy)."""
        states, job = self.node_states(used), self.job_nodes()
        suspects = [n for n in used if not classify([n], states, job, {})]
        return classify(used, states, job, self.probe(suspects) if suspects else {})

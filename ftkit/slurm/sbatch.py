"""sbatch scripts for ftkit jobs, rendered by a pure function (submitit style).

The script asks for N nodes for the ranks plus S spares, ``--no-kill`` (a failed node must
not end the allocation: ``ftkit run`` replaces it with a spare), ``--signal=B:USR1@T`` (the
batch shell — ``ftkit run`` after ``exec`` — gets SIGUSR1 T seconds before the time limit and
has the job take a final checkpoint on every level, PFS included) and ``--requeue`` (when no
spare is left, or after that final checkpoint, ``ftkit run`` requeues the job, which then
resumes from the newest committed step) — or, with ``shrink``, ``ftkit run --shrink`` goes
on with fewer ranks on the healthy nodes instead of requeueing.

``slurm/*.sbatch`` are rendered from :data:`TEMPLATES` (``python -m ftkit.slurm.sbatch
slurm/`` rewrites them; a unit test keeps them in sync).
"""
from __future__ import annotations

import dataclasses
import re
import shlex
import sys
from pathlib import Path

from ftkit.errors import LaunchError

#: What ``env`` keys may be: exported as ``export KEY=<quoted value>``, so a key is never quoted.
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)


@dataclasses.dataclass(frozen=True)
class SbatchSpec:
    """One ftkit job under Slurm."""

    command: tuple[str, ...]
    nodes: int
    spares: int = 1
    tasks_per_node: int = 1
    time: str = "01:00:00"
    job_name: str = "ftkit"
    signal_seconds: int = 120           # 0: no final checkpoint before the time limit
    requeue: bool = True
    max_restarts: int = 3
    shrink: int = 0                     # ftkit run --shrink with this rank multiple (0: off)
    in_job: bool = False                # ftkit run --in-job: spare nodes hold spare ranks
    partition: str | None = None
    account: str | None = None
    gpus_per_node: int | None = None     # --gpus-per-node; GPU ranks: one task per GPU
    cpus_per_task: int | None = None
    exclusive: bool = False
    local_dir: str | None = None         # FTKIT_LOCAL_DIR, e.g. a node-local NVMe mount
    output: str = "ftkit-%x-%j.out"
    env: tuple[tuple[str, str], ...] = ()   # exported; keys are names, values are quoted
    setup: tuple[str, ...] = ()          # shell lines run first, verbatim (module load, ...)
    ftkit: tuple[str, ...] = ("ftkit",)  # how to call ftkit (e.g. python -m ftkit.cli.main)

    def __post_init__(self) -> None:
        for ok, message in ((bool(self.command), "no command"),
                            (self.nodes >= 1, f"nodes must be >= 1, got {self.nodes}"),
                            (self.spares >= 0, f"spares must be >= 0, got {self.spares}"),
                            (self.tasks_per_node >= 1,
                             f"tasks per node must be >= 1, got {self.tasks_per_node}"),
                            (self.signal_seconds >= 0, "signal seconds must be >= 0"),
                            (self.gpus_per_node is None or self.gpus_per_node >= 1,
                             f"gpus per node must be >= 1, got {self.gpus_per_node}"),
                            (self.cpus_per_task is None or self.cpus_per_task >= 1,
                             f"cpus per task must be >= 1, got {self.cpus_per_task}"),
                            (self.max_restarts >= 0, "max restarts must be >= 0"),
                            (self.shrink >= 0, "the shrink multiple must be >= 1 (0: off)")):
            if not ok:
                raise LaunchError(f"sbatch: {message}")
        for key in ("job_name", "time", "output", "partition", "account"):
            value = getattr(self, key)
            if value is not None and (not value or any(c.isspace() or not c.isprintable()
                                                       for c in value)):
                raise LaunchError(f"sbatch: {key} {value!r} must be non-empty, printable, "
                                  "without spaces")
        for name, _ in self.env:
            if not _ENV_NAME.fullmatch(name):
                raise LaunchError(f"sbatch: env key {name!r} is not a shell variable name "
                                  f"({_ENV_NAME.pattern})")


def render_sbatch(spec: SbatchSpec) -> str:
    """The batch script text (pure). Nothing of ``spec`` reaches the shell unquoted except
    the ``setup`` lines: ``#SBATCH`` values are single printable words (bash reads those lines
    as comments), environment keys are variable names, values and argv are shell-quoted."""
    ranks = spec.nodes * spec.tasks_per_node
    head = [f"--job-name={spec.job_name}", f"--nodes={spec.nodes + spec.spares}",
            f"--ntasks-per-node={spec.tasks_per_node}", f"--time={spec.time}",
            "--no-kill", "--requeue" if spec.requeue else "--no-requeue",
            "--open-mode=append", f"--output={spec.output}"]
    if spec.signal_seconds:
        head.append(f"--signal=B:USR1@{spec.signal_seconds}")
    for key, value in (("partition", spec.partition), ("account", spec.account),
                       ("gpus-per-node", spec.gpus_per_node),
                       ("cpus-per-task", spec.cpus_per_task)):
        if value is not None:
            head.append(f"--{key}={value}")
    if spec.exclusive:
        head.append("--exclusive")
    shrink = (["--shrink"] + (["--shrink-multiple", str(spec.shrink)] if spec.shrink > 1
                              else [])) if spec.shrink else []
    run = [*spec.ftkit, "run", "--launcher", "auto", "-n", str(ranks), "--spares",
           str(spec.spares), "--max-restarts", str(spec.max_restarts), *shrink,
           *(["--in-job"] if spec.in_job else []), "--", *spec.command]
    lines = ["#!/bin/bash",
             (f"# ftkit job: {ranks} ranks on {spec.nodes} nodes x {spec.tasks_per_node}, "
              f"{spec.spares} spare node(s)."),
             *(f"#SBATCH {h}" for h in head),
             "set -euo pipefail",
             'export FTKIT_JOB="${FTKIT_JOB:-$SLURM_JOB_ID}"   # same id across requeues',
             *(f"export {k}={shlex.quote(v)}" for k, v in spec.env),
             *([f"export FTKIT_LOCAL_DIR={shlex.quote(spec.local_dir)}"]
               if spec.local_dir else []),
             *spec.setup,
             "# exec: ftkit run itself receives the USR1 of --signal=B:...",
             "exec " + shlex.join(run)]
    return "\n".join(lines) + "\n"


_LEVELS = (("FTKIT_LEVELS", "local:1,partner:1,pfs:10"),)
TEMPLATES: dict[str, SbatchSpec] = {
    "ftkit.sbatch": SbatchSpec(command=("python", "train.py"), nodes=4, spares=1,
                               tasks_per_node=2, env=_LEVELS),
    "toy.sbatch": SbatchSpec(command=("python", "examples/toy_dp.py", "--steps", "200"),
                             nodes=4, spares=1, tasks_per_node=2, time="00:30:00",
                             job_name="ftkit-toy", env=_LEVELS,
                             setup=("source .venv/bin/activate",)),
    "hp_gpt.sbatch": SbatchSpec(command=("python", "examples/hp_gpt.py", "--dp", "2", "--tp",
                                         "2", "--pp", "2", "--steps", "200"),
                                nodes=4, spares=1, tasks_per_node=2, time="00:30:00",
                                job_name="ftkit-hp-gpt", env=_LEVELS,
                                setup=("source .venv/bin/activate",)),
}


def main(argv: list[str]) -> int:
    """``python -m ftkit.slurm.sbatch DIR``: write :data:`TEMPLATES` into DIR."""
    out = Path(argv[0] if argv else "slurm")
    for name, spec in TEMPLATES.items():
        (out / name).write_text(render_sbatch(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""``ftkit`` command line (docs/guide.md; `ftkit --help`). Only this module configures logging.

Subcommands: ``run``, ``clean``, ``advise``, ``inspect``, ``verify``, ``export``. Importing this
module imports neither mpi4py nor torch. Exit status 2 means a usage, configuration or
launch-setup error; ``ftkit run`` exits 3 when a rank raised an error that a relaunch would hit
again (see :mod:`ftkit.launch.relaunch` for all its statuses).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import shlex
import shutil
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ftkit.cli.fmt import human, tree_size
from ftkit.config import LOG_LEVELS, Config
from ftkit.errors import ConfigError, LaunchError
from ftkit.jobdir import paths

log = logging.getLogger(__name__)

USAGE_STATUS = 2
DEFAULT_RESTARTS = 3       # ftkit run is a fault-tolerance launcher: restarts are on
_LOG_FORMAT = "ftkit: %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    """Send the ``ftkit`` logger to stderr at ``level`` (idempotent; root logger untouched)."""
    logger = logging.getLogger("ftkit")
    if not any(getattr(h, "_ftkit_cli", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler._ftkit_cli = True  # type: ignore[attr-defined]
        handler.setFormatter(logging.Formatter(_LOG_FORMAT))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level if level in LOG_LEVELS else "WARNING")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):          # False for nan too
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _add_run_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``ftkit run -n N [...] -- CMD [ARGS...]``."""
    from ftkit.launch import registry
    from ftkit.launch.outcome import DEFAULT_RESTART_DELAY, NOT_RETRIED_STATUS
    from ftkit.launch.spec import (
        DEFAULT_ATTEMPT_TIMEOUT,
        DEFAULT_STALL_TIMEOUT,
        DEFAULT_STARTUP_TIMEOUT,
    )
    run = sub.add_parser(
        "run", help="launch CMD on N ranks and relaunch it on failure",
        description="Launch CMD on N ranks (mpiexec locally); on failure relaunch it with "
                    "FTKIT_ATTEMPT incremented, up to --max-restarts times. An attempt succeeds "
                    "only if the launcher exits 0 and the job wrote $FTKIT_DONE_FILE. Every "
                    "attempt resumes from the newest committed step; errors that a relaunch "
                    "would hit again (bad configuration, unusable checkpoints, a state that "
                    "does not match the checkpoint) are not retried. Prints one line per "
                    "attempt; exit status: 0 success, 2: usage or configuration error, or "
                    "another instance of the job is running (it holds the job's lock), "
                    f"{NOT_RETRIED_STATUS}: a rank raised an error that would recur, not "
                    "retried (the attempt line names it and the rank), 124: an attempt stalled or "
                    "timed out, 128+N: "
                    "stopped by signal N, else the last attempt's status.")
    run.add_argument("-n", "--np", dest="n", type=_positive_int, required=True, metavar="N",
                     help="number of ranks")
    run.add_argument("--ranks-per-node", type=_positive_int, metavar="K",
                     help="virtual nodes of K consecutive ranks (sets FTKIT_RANKS_PER_NODE)")
    run.add_argument("--spares", type=_non_negative_int, default=0, metavar="S",
                     help="spare nodes to bring in on failure (Slurm); with --in-job, spare "
                          "ranks that take failed ranks' places in the running job")
    run.add_argument("--in-job", action="store_true",
                     help="recover from failed ranks without a relaunch (mpiexec --with-ft "
                          "ulfm, Open MPI 5): N ranks train, S spares wait; the script runs "
                          "its training under ftkit.resilient(train); more failures than "
                          "spares fall back to a relaunch")
    run.add_argument("--max-restarts", type=_non_negative_int, default=DEFAULT_RESTARTS,
                     metavar="R", help=f"relaunch at most R times (default {DEFAULT_RESTARTS}; "
                                       "0: never)")
    run.add_argument("--launcher", choices=registry.names(), default="auto",
                     help="auto: srun inside a Slurm allocation, mpiexec elsewhere")
    run.add_argument("--attempt-timeout", type=float, default=DEFAULT_ATTEMPT_TIMEOUT,
                     metavar="SECONDS",
                     help="wall-clock limit of one attempt (default 0: none; under Slurm the "
                          "job's time limit bounds the allocation)")
    run.add_argument("--stall-timeout", type=float, default=DEFAULT_STALL_TIMEOUT,
                     metavar="SECONDS",
                     help="kill an attempt (status 124, relaunched like a failure) whose job "
                          "shows no progress for this long: nothing new in "
                          "$FTKIT_PFS_DIR/<job>/events.jsonl, which rank 0 appends to on "
                          "restore and at every save, commit and flush (default "
                          f"{DEFAULT_STALL_TIMEOUT:g}; 0: never). Keep it above the longest "
                          "time between two checkpoints, and above the restore")
    run.add_argument("--startup-timeout", type=float, default=DEFAULT_STARTUP_TIMEOUT,
                     metavar="SECONDS",
                     help="with --in-job: end an attempt (status 124, relaunched like a "
                          "failure) whose processes have not all passed MPI_Init this long "
                          "after launch (a process that dies during MPI_Init leaves the others "
                          f"waiting there; default {DEFAULT_STARTUP_TIMEOUT:g}; 0: never). "
                          "Keep it above the time your script takes to import")
    run.add_argument("--mpiexec", metavar="PATH",
                     help="mpiexec to use (default: next to this Python, then on PATH)")
    run.add_argument("--launcher-args", metavar="ARGS", default="",
                     help="more arguments for mpiexec, one string split like a shell does, "
                          "e.g. \"--hostfile hosts --map-by ppr:4:node --bind-to core\"; "
                          "when they place or bind ranks, ftkit adds none of its own "
                          "(otherwise Open MPI gets --oversubscribe --bind-to none, for one "
                          "small machine)")
    run.add_argument("--fresh", action="store_true",
                     help="start over: attempt 0 deletes the job's committed checkpoints and "
                          "begins at step 0 (FTKIT_START=fresh); its relaunches, and a "
                          "requeued Slurm job, resume what it committed. Without it a job "
                          "whose checkpoints cannot be used stops (status 3) and keeps them. "
                          "To delete a job's data without running it: ftkit clean JOB")
    run.add_argument("--restart-delay", type=_seconds, default=DEFAULT_RESTART_DELAY,
                     metavar="SECONDS",
                     help="wait this long before the first relaunch, twice as long before "
                          "each next one, at most 60 s (default "
                          f"{DEFAULT_RESTART_DELAY:g}; 0: relaunch at once)")
    run.add_argument("--resume", nargs="?", const="", default=None, metavar="JOB",
                     help="continue JOB (its newest committed step) instead of starting a "
                          "new job; without JOB the job under $FTKIT_PFS_DIR that was active "
                          "last. Without --resume, FTKIT_JOB or Slurm, every ftkit run starts "
                          "a new job with its own id (printed)")
    run.add_argument("--keep-local", action="store_true",
                     help="keep the job's node-local copies at a successful end (by default "
                          "every node removes them then, when the newest committed step is on "
                          "the PFS; a later --resume restores it from there)")
    run.add_argument("--shrink", action="store_true",
                     help="Slurm: when a node fails and no spare is left, go on with fewer "
                          "ranks on the healthy nodes instead of requeueing; the ranks restore "
                          "the newest PFS step resharded to the smaller world (the PFS level "
                          "is needed; the training must accept the world size)")
    run.add_argument("--shrink-multiple", type=_positive_int, default=1, metavar="M",
                     help="with --shrink: the rank count stays a multiple of M, e.g. tp*pp "
                          "(default 1); nodes left over stay spares")
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]",
                     help="the command every rank runs")
    run.set_defaults(func=_cmd_run)


def _add_clean_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``ftkit clean JOB [--dry-run] [--force]``."""
    p = sub.add_parser(
        "clean", help="delete a job's checkpoints on this host (start over for good)",
        description="Remove the checkpoint data of JOB that this host can see: "
                    "$FTKIT_PFS_DIR/JOB (PFS steps, event log) and $FTKIT_LOCAL_DIR/JOB (the "
                    "node-local directories of every (virtual) node of this machine; under "
                    "Slurm also $FTKIT_LOCAL_DIR/$SLURMD_NODENAME/JOB). Node-local data lives "
                    "on every node: on a cluster run it on every node, once per node, e.g. "
                    "'srun --ntasks-per-node=1 ftkit clean JOB'. Run it only when the job is "
                    "not running. Prints each directory removed with its size. Refuses "
                    "directories holding entries ftkit does not create (listed) unless --force. "
                    "Exit 0: removed, or nothing was there; 1: refused, nothing removed; "
                    "2: usage error.")
    p.add_argument("job", metavar="JOB", help="the job id (FTKIT_JOB / SLURM_JOB_ID)")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed")
    p.add_argument("--force", action="store_true",
                   help="remove the job directories even when they hold other entries")
    p.set_defaults(func=_cmd_clean)


def _add_status_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``ftkit status [JOB] [--json] [--events N]``."""
    p = sub.add_parser(
        "status", help="where a job stands: running or not, steps per level, last events",
        description="Without JOB: every job under $FTKIT_PFS_DIR (most recently active "
                    "last): whether an ftkit run holds it, its newest PFS step, its last "
                    "outcome. With JOB: its run id, committed steps with sizes on the PFS and "
                    "in the node-local directories this host sees, and its last events. Plain "
                    "file reads. Exit 0; 1: no such job.")
    p.add_argument("job", metavar="JOB", nargs="?", help="the job id (FTKIT_JOB)")
    p.add_argument("--json", action="store_true", help="one JSON document")
    p.add_argument("--events", type=_non_negative_int, default=5, metavar="N",
                   help="how many of the last events to show (default 5)")
    p.set_defaults(func=_cmd_status)


def _cmd_status(args: argparse.Namespace) -> int:
    from ftkit.cli.status import cmd_status
    try:
        return cmd_status(args)
    except ConfigError as exc:
        return _error("status", exc)


def _add_advise_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``ftkit advise --nodes N --mtbf-hours H [...]``."""
    adv = sub.add_parser(
        "advise", help="survival odds of each scheme and checkpoint intervals",
        description="Exact probability that each scheme (local, partner, xor, rs, pfs) survives "
                    "k simultaneous node failures, from ftkit's real placement, and the "
                    "Young/Daly checkpoint interval of every level with a known cost.")
    adv.add_argument("--nodes", type=_positive_int, required=True, metavar="N")
    adv.add_argument("--mtbf-hours", type=_positive_float, required=True, metavar="H",
                     help="mean time between failures of ONE node")
    adv.add_argument("--ranks-per-node", type=_positive_int, default=1, metavar="K")
    adv.add_argument("--xor-set", type=_positive_int, default=4)
    adv.add_argument("--rs-set", type=_positive_int, default=4)
    adv.add_argument("--rs-parity", type=_positive_int, default=2)
    adv.add_argument("--max-failures", type=_positive_int, default=3, metavar="K")
    adv.add_argument("--measured", metavar="BENCH.json",
                     help="bench JSON with a 'level_costs_s' object {level: seconds}")
    adv.add_argument("--cost", action="append", default=[], metavar="LEVEL=SECONDS",
                     help="checkpoint cost of a level (overrides --measured)")
    adv.add_argument("--json", action="store_true", help="machine-readable output")
    adv.set_defaults(func=_cmd_advise)


_CHECKPOINT_EXIT = (
    "A damaged file can make the HDF5 library hang or crash, so the files are read in a "
    "child process: one that reports no progress within --timeout seconds is stopped, one "
    "that crashes is reported with its signal; either names the file it was reading. ")


def _checkpoint_args(p: argparse.ArgumentParser, step_help: str, *, json_flag: bool = True
                     ) -> None:
    """PATH, --step, --timeout (and --json) of the HDF5 checkpoint tools."""
    p.add_argument("path", metavar="PATH",
                   help="job directory ($FTKIT_PFS_DIR/<job>), a step-<s> directory or a "
                        "step's ftkit.h5")
    p.add_argument("--step", type=_non_negative_int, metavar="S", help=step_help)
    p.add_argument("--timeout", type=_positive_float, metavar="SECONDS",
                   help="stop reading when no progress is made for this long (default: "
                        "FTKIT_TIMEOUT, 120)")
    if json_flag:
        p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_checkpoint_tool)


def _add_inspect_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``ftkit inspect PATH [--step S] [--json]`` (body in :mod:`ftkit.cli.checkpoints`)."""
    p = sub.add_parser(
        "inspect", help="list the steps of an HDF5 checkpoint and their tensors",
        description="List the steps of a PFS checkpoint (committed or incomplete) with world, "
                    "dp, tp and pp, and every tensor of every rank (path, dtype, shape, bytes) "
                    "of one step: --step, or the newest committed step; problems found in "
                    "the files are listed with their step. " + _CHECKPOINT_EXIT +
                    "Exit 0: listed; 1: PATH is not a regular file or directory, or reading "
                    "a step was stopped (no progress, crash); 2: usage error.")
    _checkpoint_args(p, "step to list")


def _add_verify_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``ftkit verify PATH [--step S] [--json]`` (body in :mod:`ftkit.cli.checkpoints`)."""
    p = sub.add_parser(
        "verify", help="recompute every checksum of an HDF5 checkpoint",
        description="Recompute the checksum of every dataset of the chosen step (default: "
                    "every step of the job directory) through the index's links. "
                    + _CHECKPOINT_EXIT + "Exit 0: intact; 1: a step is corrupt, incomplete "
                    "or unreadable (a file missing or not a regular file, a reader stopped; "
                    "the other steps are still verified), or PATH is not a regular file or "
                    "directory; 2: usage error.")
    _checkpoint_args(p, "step to verify")


def _add_export_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``ftkit export PATH --step S --out FILE [--format pt|safetensors|dcp]``."""
    p = sub.add_parser(
        "export", help="write one step as a single-process state dict",
        description="Write the tensors of one committed step as a flat {state path: tensor} "
                    "dict: rank 0's for data-parallel checkpoints, shards merged along "
                    "shard_dim for TP/PP; exactly the tensors of the tree(s), or nothing. "
                    "Streams tensor by tensor (memory of about one tensor); FILE appears "
                    "only when complete. " + _CHECKPOINT_EXIT + "Exit 0: written; 1: "
                    "incomplete, corrupt, unmergeable or unreadable (nothing written); 2: "
                    "usage error.")
    _checkpoint_args(p, "step to export (default: the newest committed step)",
                     json_flag=False)
    p.add_argument("--out", required=True, metavar="FILE",
                   help="file to write (--format dcp: a new directory)")
    p.add_argument("--only", metavar="PREFIX",
                   help="export only the tensors under this state path, with PREFIX/ cut "
                        "from their keys: --only model gives the keys of model.state_dict(), "
                        "ready for load_state_dict")
    p.add_argument("--format", choices=("pt", "safetensors", "dcp"),
                   help="pt: torch.save (default; needs torch); safetensors: written by "
                        "ftkit itself (default for a .safetensors FILE); dcp: a "
                        "torch.distributed.checkpoint directory, keys nested at '/' "
                        "(model/w is DCP's model.w), loadable with or without a process "
                        "group and into any sharding")


def _cmd_checkpoint_tool(args: argparse.Namespace) -> int:
    """Body of ``inspect``/``verify``/``export`` (imports h5py/torch only when run)."""
    from ftkit.cli.checkpoints import run
    return run(args)


def _costs(args: argparse.Namespace) -> tuple[dict[str, float], dict[str, str]]:
    """Each level's checkpoint cost and where it came from (``--measured`` or ``--cost``)."""
    import json
    costs: dict[str, float] = {}
    sources: dict[str, str] = {}
    if args.measured:
        with open(args.measured) as fh:
            for level, value in json.load(fh)["level_costs_s"].items():
                costs[level], sources[level] = float(value), f"measured: {args.measured}"
    for item in args.cost:
        level, _, value = item.partition("=")
        costs[level], sources[level] = float(value), "--cost"
    return costs, sources


def _cmd_advise(args: argparse.Namespace) -> int:
    import json

    from ftkit.advise import advise, render
    try:
        costs, sources = _costs(args)
        report = advise(args.nodes, args.mtbf_hours, ranks_per_node=args.ranks_per_node,
                        xor_set=args.xor_set, rs_set=args.rs_set, rs_parity=args.rs_parity,
                        max_failures=args.max_failures, costs=costs, cost_sources=sources)
    except (OSError, KeyError, ValueError) as exc:
        return _error("advise", exc)
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0


BROKEN_PIPE_STATUS = 128 + 13   # as a shell reports a command ended by SIGPIPE


def build_parser() -> argparse.ArgumentParser:
    """The ``ftkit`` argument parser with every registered subcommand."""
    parser = argparse.ArgumentParser(prog="ftkit", description="Fault tolerance for MPI "
                                     "training jobs: checkpoints, recovery, relaunch.")
    from ftkit._version import __version__
    parser.add_argument("--version", action="version", version=f"ftkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_run_parser(sub)
    _add_clean_parser(sub)
    _add_status_parser(sub)
    from ftkit.cli.sbatchcmd import add_parser as add_sbatch_parser
    add_sbatch_parser(sub, _positive_int, _non_negative_int)
    _add_advise_parser(sub)
    _add_inspect_parser(sub)
    _add_verify_parser(sub)
    _add_export_parser(sub)
    return parser


def _error(command: str, exc: Exception) -> int:
    print(f"ftkit {command}: error: {exc}", file=sys.stderr, flush=True)
    return USAGE_STATUS


def _cmd_run(args: argparse.Namespace) -> int:
    """Body of ``ftkit run``."""
    from ftkit.launch import registry
    from ftkit.launch.base import Request
    from ftkit.launch.jobs import choose_job
    from ftkit.launch.relaunch import run_job
    from ftkit.launch.spec import RunSpec
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    try:
        if args.resume is not None and args.fresh:
            raise ConfigError("--resume and --fresh contradict each other: give one")
        job = choose_job(Config.load(), args.resume)
        cfg = job.cfg
        configure_logging(cfg.log_level)
        spec = RunSpec(n=args.n, cmd=tuple(cmd), ranks_per_node=args.ranks_per_node,
                       spares=args.spares, max_restarts=args.max_restarts,
                       attempt_timeout=args.attempt_timeout,
                       stall_timeout=args.stall_timeout,
                       fresh=_starts_fresh(args.fresh or cfg.start == "fresh"),
                       restart_delay=args.restart_delay,
                       tidy=not args.keep_local, shrink=_shrink(args, cfg),
                       in_job=args.in_job, startup_timeout=args.startup_timeout)
        launcher = registry.resolve(args.launcher, Request(
            os.environ, args.mpiexec, _split_args(args.launcher_args), spec, cfg))
        print(f"ftkit run: {job.line}: {args.n} ranks, up to {args.max_restarts} "
              f"restart(s) (--max-restarts)", file=sys.stderr, flush=True)
        return run_job(spec, cfg, launcher, {**os.environ, "FTKIT_JOB": cfg.job})
    except (ConfigError, LaunchError) as exc:
        return _error("run", exc)


def _shrink(args: argparse.Namespace, cfg: Config) -> int:
    """``RunSpec.shrink`` of ``--shrink``/``--shrink-multiple`` (0: off); ConfigError when
    the job has no PFS level to reshard from, or the multiple comes alone."""
    if not args.shrink:
        if args.shrink_multiple != 1:
            raise ConfigError("--shrink-multiple only applies with --shrink")
        return 0
    if cfg.levels and not cfg.interval("pfs"):
        raise ConfigError("--shrink restarts on fewer ranks from the PFS level, but "
                          "FTKIT_LEVELS="
                          + ",".join(f"{name}:{every}" for name, every in cfg.levels)
                          + " has none: add pfs:N")
    return int(args.shrink_multiple)


def _split_args(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise ConfigError(f"--launcher-args {text!r}: {exc}") from exc


def _starts_fresh(asked: bool) -> bool:
    """Whether attempt 0 starts over: not when Slurm requeued the job (the batch script runs
    the same ``ftkit run --fresh`` again; it must resume what the first run committed)."""
    if not asked:
        return False
    from ftkit.slurm.env import SlurmEnv
    senv = SlurmEnv.from_environ(os.environ)
    if senv is not None and senv.restart_count > 0:
        print(f"ftkit run: Slurm requeued job {senv.job_id} ({senv.restart_count} time(s)): "
              "resuming its committed steps instead of starting over (--fresh / "
              "FTKIT_START=fresh apply to the first run only)", file=sys.stderr, flush=True)
        return False
    return True


# ----------------------------------------------------------------------------- clean
@dataclasses.dataclass(frozen=True)
class _Layout:
    """What ftkit creates in a directory: directory names, file names, and what may be in
    those directories (None: not looked into)."""

    dirs: str
    files: str = ""
    inner: _Layout | None = None

    def odd(self, root: Path) -> list[str]:
        """Entries under ``root`` that ftkit does not create there."""
        found: list[str] = []
        for entry in sorted(os.scandir(root), key=lambda e: e.name):
            if entry.is_dir(follow_symlinks=False) and re.fullmatch(self.dirs, entry.name):
                if self.inner is not None:
                    found += [f"{entry.name}/{name}" for name in self.inner.odd(Path(entry.path))]
            elif not (entry.is_file(follow_symlinks=False) and self.files
                      and re.fullmatch(self.files, entry.name)):
                found.append(entry.name + ("/" if entry.is_dir(follow_symlinks=False) else ""))
        return found

    def __or__(self, other: _Layout) -> _Layout:
        """Both layouts in one directory (PFS and node-local roots that coincide)."""
        files = "|".join(f for f in (self.files, other.files) if f)
        return _Layout(f"{self.dirs}|{other.dirs}", files, None)


#: $FTKIT_PFS_DIR/<job> and $FTKIT_LOCAL_DIR/<job> (ftkit.jobdir.paths)
_PFS_LAYOUT = _Layout(paths.PFS_DIRS, paths.PFS_FILES, None)
_LOCAL_LAYOUT = _Layout(paths.LOCAL_DIRS, "", _Layout(paths.NODE_DIRS, paths.NODE_FILES, None))


def _clean_targets(cfg: Config) -> dict[Path, _Layout]:
    """Directories of ``cfg.job`` that this host sees, and what ftkit puts in each."""
    targets = {Path(os.path.abspath(cfg.job_pfs_dir)): _PFS_LAYOUT}
    for host in dict.fromkeys((None, os.environ.get("SLURMD_NODENAME") or None)):
        local = Path(os.path.abspath(cfg.node_dir(0, host).parent))
        targets[local] = targets[local] | _LOCAL_LAYOUT if local in targets else _LOCAL_LAYOUT
    return targets


def _unsafe_local(cfg: Config, found: list[Path]) -> list[Path]:
    """The node-local job directories in ``found`` that are not this user's private
    directories (below a private ``FTKIT_LOCAL_DIR``): on a shared ``/dev/shm`` they may be
    another user's; each refusal is printed."""
    from ftkit.storage.private import problem
    base = Path(os.path.abspath(cfg.local_dir))
    unsafe = []
    for path in found:
        if base not in path.parents:
            continue
        why = problem(base, directory=True) or problem(path, directory=True)
        if why is not None:
            print(f"ftkit clean: refused: {path} (in {base}): {why}; remove it yourself if it "
                  "is yours", file=sys.stderr)
            unsafe.append(path)
    return unsafe


def _running(job: str, found: list[Path]) -> list[Path]:
    """The directories in ``found`` whose job lock (``LOCK``, or ``node-*/LOCK`` below a
    node-local job directory) is held now: the job is running; each refusal is printed."""
    from ftkit.jobdir.lock import LOCK_FILE, describe, held_by
    busy = []
    for path in found:
        for lock in [path / LOCK_FILE, *sorted(path.glob(f"node-*/{LOCK_FILE}"))]:
            holder = held_by(lock)
            if holder is not None:
                print(f"ftkit clean: refused: job {job} is running: {describe(holder)} holds "
                      f"{lock}; stop it first", file=sys.stderr)
                busy.append(path)
                break
    return busy


def _ignore_vanished(_func: Callable[..., object], _path: str, exc_info: Any) -> None:
    """rmtree error handler: another node's ``ftkit clean`` may remove the same PFS files."""
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]


def _cmd_clean(args: argparse.Namespace) -> int:
    """Body of ``ftkit clean`` (plain file operations; no MPI, no torch)."""
    job = args.job
    if not job or "/" in job or ".." in job or job == "." or "\0" in job:
        return _error("clean", ValueError(f"JOB {job!r} is not a job id (a plain name: no "
                                          "'/', no '..', not empty); nothing removed"))
    try:
        cfg = Config.load(job=job)
        targets = _clean_targets(cfg)
    except ConfigError as exc:
        return _error("clean", exc)
    found = [p for p in targets if os.path.lexists(p)]
    not_dirs = [p for p in found if p.is_symlink() or not p.is_dir()]
    for path in not_dirs:
        print(f"ftkit clean: refused: {path} is not a directory ftkit created (a file or a "
              "symbolic link); remove it yourself", file=sys.stderr)
    not_dirs += _unsafe_local(cfg, [p for p in found if p not in not_dirs])
    not_dirs += _running(cfg.job, [p for p in found if p not in not_dirs])
    odd = {p: targets[p].odd(p) for p in found if p not in not_dirs}
    for path, names in odd.items():
        if names and not args.force:
            print(f"ftkit clean: refused: {path} holds entries ftkit does not create: "
                  f"{', '.join(names)}", file=sys.stderr)
    if not_dirs or (any(odd.values()) and not args.force):
        print("ftkit clean: nothing removed" + ("" if not_dirs else
                                                "; --force removes those entries too"),
              file=sys.stderr, flush=True)
        return 1
    if not found:
        print(f"ftkit clean: nothing to remove for job {job} on {socket.gethostname()}: "
              f"{' and '.join(str(p) for p in targets)} do not exist", flush=True)
        return 0
    for path in found:
        size = human(tree_size(path))
        if args.dry_run:
            print(f"ftkit clean: would remove {path} ({size})", flush=True)
            continue
        try:
            shutil.rmtree(path, onerror=_ignore_vanished)
        except OSError as exc:
            print(f"ftkit clean: error: cannot remove {path}: {exc}", file=sys.stderr,
                  flush=True)
            return 1
        print(f"ftkit clean: removed {path} ({size})", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ftkit`` console script; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:          # --help, usage errors
        return exc.code if isinstance(exc.code, int) else USAGE_STATUS
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except BrokenPipeError:            # ftkit inspect ... | head: the reader is gone
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())   # no second error when Python flushes at exit
        return BROKEN_PIPE_STATUS


if __name__ == "__main__":
    sys.exit(main())

"""``ftkit run``: launch a command on N ranks and relaunch it on failure (the loop itself is
:mod:`ftkit.launch.relaunch`)."""
from __future__ import annotations

import argparse
import os
import shlex
import sys

from ftkit.cli.args import configure_logging, error, non_negative_int, positive_int, seconds
from ftkit.config import Config
from ftkit.errors import ConfigError, LaunchError

DEFAULT_RESTARTS = 3       # ftkit run is a fault-tolerance launcher: restarts are on


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    run.add_argument("-n", "--np", dest="n", type=positive_int, required=True, metavar="N",
                     help="number of ranks")
    run.add_argument("--ranks-per-node", type=positive_int, metavar="K",
                     help="virtual nodes of K consecutive ranks (sets FTKIT_RANKS_PER_NODE)")
    run.add_argument("--spares", type=non_negative_int, default=0, metavar="S",
                     help="spare nodes to bring in on failure (Slurm); with --in-job, spare "
                          "ranks that take failed ranks' places in the running job")
    run.add_argument("--in-job", action="store_true",
                     help="recover from failed ranks without a relaunch (mpiexec --with-ft "
                          "ulfm, Open MPI 5): N ranks train, S spares wait; the script runs "
                          "its training under ftkit.resilient(train); more failures than "
                          "spares fall back to a relaunch")
    run.add_argument("--max-restarts", type=non_negative_int, default=DEFAULT_RESTARTS,
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
    run.add_argument("--restart-delay", type=seconds, default=DEFAULT_RESTART_DELAY,
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
    run.add_argument("--shrink-multiple", type=positive_int, default=1, metavar="M",
                     help="with --shrink: the rank count stays a multiple of M, e.g. tp*pp "
                          "(default 1); nodes left over stay spares")
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]",
                     help="the command every rank runs")
    run.set_defaults(func=_cmd_run)


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
        return error("run", exc)


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

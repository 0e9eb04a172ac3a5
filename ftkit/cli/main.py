"""``ftkit`` command line (DESIGN §7). Only this module configures logging.

Subcommands: ``run``, ``advise``, ``inspect``, ``verify``, ``export``. Importing this module imports neither mpi4py nor torch.
Exit status 2 means a usage, configuration or launch-setup error.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

from ftkit.config import LOG_LEVELS, Config
from ftkit.errors import ConfigError, LaunchError

log = logging.getLogger(__name__)

USAGE_STATUS = 2
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


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _add_run_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``ftkit run -n N [...] -- CMD [ARGS...]``."""
    from ftkit.launch.relaunch import DEFAULT_ATTEMPT_TIMEOUT, LAUNCHERS
    run = sub.add_parser(
        "run", help="launch CMD on N ranks and relaunch it on failure",
        description="Launch CMD on N ranks (mpiexec locally); on failure relaunch it with "
                    "FTKIT_ATTEMPT incremented, up to --max-restarts times. An attempt succeeds "
                    "only if the launcher exits 0 and the job wrote $FTKIT_DONE_FILE. Prints "
                    "one line per attempt; exits with the last attempt's status (124: timeout).")
    run.add_argument("-n", "--np", dest="n", type=_positive_int, required=True, metavar="N",
                     help="number of ranks")
    run.add_argument("--ranks-per-node", type=_positive_int, metavar="K",
                     help="virtual nodes of K consecutive ranks (sets FTKIT_RANKS_PER_NODE)")
    run.add_argument("--spares", type=_non_negative_int, default=0, metavar="S",
                     help="spare nodes to bring in on failure (Slurm only; recorded)")
    run.add_argument("--max-restarts", type=_non_negative_int, default=0, metavar="R",
                     help="relaunch at most R times (default 0)")
    run.add_argument("--launcher", choices=LAUNCHERS, default="auto",
                     help="auto: srun inside a Slurm allocation, mpiexec elsewhere")
    run.add_argument("--attempt-timeout", type=_positive_float, default=DEFAULT_ATTEMPT_TIMEOUT,
                     metavar="SECONDS", help="kill an attempt after this long (default 86400)")
    run.add_argument("--mpiexec", metavar="PATH",
                     help="mpiexec to use (default: next to this Python, then on PATH)")
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]",
                     help="the command every rank runs")
    run.set_defaults(func=_cmd_run)


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


def _checkpoint_args(p: argparse.ArgumentParser, step_help: str, *, json_flag: bool = True
                     ) -> None:
    """PATH, --step (and --json) of the HDF5 checkpoint tools."""
    p.add_argument("path", metavar="PATH",
                   help="job directory ($FTKIT_PFS_DIR/<job>), a step-<s> directory or a "
                        "step's ftkit.h5")
    p.add_argument("--step", type=_non_negative_int, metavar="S", help=step_help)
    if json_flag:
        p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_checkpoint_tool)


def _add_inspect_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``ftkit inspect PATH [--step S] [--json]`` (body in :mod:`ftkit.cli.checkpoints`)."""
    p = sub.add_parser(
        "inspect", help="list the steps of an HDF5 checkpoint and their tensors",
        description="List the steps of a PFS checkpoint (committed or incomplete) with world, "
                    "dp, tp and pp, and every tensor of every rank (path, dtype, shape, bytes) "
                    "of one step: --step, or the newest committed step.")
    _checkpoint_args(p, "step to list")


def _add_verify_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``ftkit verify PATH [--step S] [--json]`` (body in :mod:`ftkit.cli.checkpoints`)."""
    p = sub.add_parser(
        "verify", help="recompute every checksum of an HDF5 checkpoint",
        description="Recompute the checksum of every dataset of the chosen step (default: "
                    "every step of the job directory) through the index's links. Exit 0: "
                    "intact; 1: a dataset is corrupt or unreadable, or a step is incomplete; "
                    "2: usage error.")
    _checkpoint_args(p, "step to verify")


def _add_export_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``ftkit export PATH --step S --out FILE [--format pt|safetensors]``."""
    p = sub.add_parser(
        "export", help="write one step as a single-process state dict",
        description="Write the tensors of one committed step as a flat {state path: tensor} "
                    "dict: rank 0's for data-parallel checkpoints, shards merged along "
                    "shard_dim for TP/PP. Exit 0: written; 1: incomplete, corrupt or "
                    "unmergeable; 2: usage error.")
    _checkpoint_args(p, "step to export (required for a job directory)", json_flag=False)
    p.add_argument("--out", required=True, metavar="FILE", help="file to write")
    p.add_argument("--format", choices=("pt", "safetensors"),
                   help="pt: torch.save (default); safetensors: needs that package "
                        "(default for a .safetensors FILE)")


def _cmd_checkpoint_tool(args: argparse.Namespace) -> int:
    """Body of ``inspect``/``verify``/``export`` (imports h5py/torch only when run)."""
    from ftkit.cli.checkpoints import run
    return run(args)


def _costs(args: argparse.Namespace) -> dict[str, float]:
    import json
    costs: dict[str, float] = {}
    if args.measured:
        with open(args.measured) as fh:
            costs.update({k: float(v) for k, v in json.load(fh)["level_costs_s"].items()})
    for item in args.cost:
        level, _, value = item.partition("=")
        costs[level] = float(value)
    return costs


def _cmd_advise(args: argparse.Namespace) -> int:
    import json

    from ftkit.advise import advise, render
    try:
        report = advise(args.nodes, args.mtbf_hours, ranks_per_node=args.ranks_per_node,
                        xor_set=args.xor_set, rs_set=args.rs_set, rs_parity=args.rs_parity,
                        max_failures=args.max_failures, costs=_costs(args))
    except (OSError, KeyError, ValueError) as exc:
        return _error("advise", exc)
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``ftkit`` argument parser with every registered subcommand."""
    parser = argparse.ArgumentParser(prog="ftkit", description="Fault tolerance for MPI "
                                     "training jobs: checkpoints, recovery, relaunch.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_run_parser(sub)
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
    from ftkit.launch.relaunch import RunSpec, resolve_launcher, run_job
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    try:
        cfg = Config.load()
        configure_logging(cfg.log_level)
        spec = RunSpec(n=args.n, cmd=tuple(cmd), ranks_per_node=args.ranks_per_node,
                       spares=args.spares, max_restarts=args.max_restarts,
                       attempt_timeout=args.attempt_timeout)
        launcher = resolve_launcher(args.launcher, os.environ, mpiexec=args.mpiexec,
                                    spec=spec, cfg=cfg)
        return run_job(spec, cfg, launcher)
    except (ConfigError, LaunchError) as exc:
        return _error("run", exc)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ftkit`` console script; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:          # --help, usage errors
        return exc.code if isinstance(exc.code, int) else USAGE_STATUS
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


if __name__ == "__main__":
    sys.exit(main())

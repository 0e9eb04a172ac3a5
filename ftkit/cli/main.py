"""``ftkit`` command line (docs/guide.md; `ftkit --help`): the parser and the entry point.

Subcommands, each in its own module: ``run`` (:mod:`.run`), ``clean`` (:mod:`.clean`),
``status`` (:mod:`.status`), ``sbatch`` (:mod:`.sbatchcmd`), ``advise`` (:mod:`.advise`),
``inspect``, ``verify``, ``export`` (:mod:`.tools`). Importing this module imports neither
mpi4py nor torch. Exit status 2 means a usage, configuration or
launch-setup error; ``ftkit run`` exits 3 when a rank raised an error that a relaunch would hit
again (see :mod:`ftkit.launch.relaunch` for all its statuses).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from ftkit.cli import advise, clean, run, sbatchcmd, status, tools
from ftkit.cli.args import USAGE_STATUS, non_negative_int, positive_int

__all__ = ["BROKEN_PIPE_STATUS", "USAGE_STATUS", "build_parser", "main"]

BROKEN_PIPE_STATUS = 128 + 13   # as a shell reports a command ended by SIGPIPE


def build_parser() -> argparse.ArgumentParser:
    """The ``ftkit`` argument parser with every registered subcommand."""
    parser = argparse.ArgumentParser(prog="ftkit", description="Fault tolerance for MPI "
                                     "training jobs: checkpoints, recovery, relaunch.")
    from ftkit._version import __version__
    parser.add_argument("--version", action="version", version=f"ftkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run.add_parser(sub)
    clean.add_parser(sub)
    status.add_parser(sub)
    sbatchcmd.add_parser(sub, positive_int, non_negative_int)
    advise.add_parser(sub)
    tools.add_parsers(sub)
    return parser


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

"""The argument parsers of the HDF5 checkpoint tools ``inspect``, ``verify`` and ``export``
(their bodies: :mod:`ftkit.cli.checkpoints`, imported only when one runs)."""
from __future__ import annotations

import argparse

from ftkit.cli.args import non_negative_int, positive_float

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
    p.add_argument("--step", type=non_negative_int, metavar="S", help=step_help)
    p.add_argument("--timeout", type=positive_float, metavar="SECONDS",
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


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``inspect``, ``verify`` and ``export``."""
    _add_inspect_parser(sub)
    _add_verify_parser(sub)
    _add_export_parser(sub)

"""``ftkit sbatch [options] -- CMD...``: print (or write) a batch script for an ftkit job.

A thin command line over the pure renderer :func:`ftkit.slurm.sbatch.render_sbatch`: the script
asks for the nodes plus spares, ``--no-kill``, a signal before the time limit and
``--requeue``, and ``exec``s ``ftkit run`` (see that module).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from ftkit.errors import LaunchError
from ftkit.fs import write_text_atomic
from ftkit.slurm.sbatch import SbatchSpec, render_sbatch


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser],
               positive: Callable[[str], int], non_negative: Callable[[str], int]) -> None:
    """Register ``ftkit sbatch``; ``positive``/``non_negative``: the CLI's int types."""
    p = sub.add_parser(
        "sbatch", help="write a Slurm batch script for an ftkit job",
        description="Render a batch script that asks for --nodes nodes plus --spares spare "
                    "nodes, keeps the allocation when a node fails (--no-kill), signals the "
                    "job --signal-seconds before the time limit (a final checkpoint on every "
                    "level) and requeues it, and execs 'ftkit run --launcher auto -n "
                    "NODES*TASKS -- CMD'. Printed, or written to --out (then: sbatch FILE). "
                    "Exit 0; 2: usage error.")
    p.add_argument("--nodes", type=positive, required=True, metavar="N",
                   help="nodes the ranks run on (spares come on top)")
    p.add_argument("--tasks-per-node", type=positive, default=1, metavar="K",
                   help="ranks per node (on GPU nodes: one per GPU)")
    p.add_argument("--spares", type=non_negative, default=1, metavar="S",
                   help="spare nodes that replace failed ones (default 1)")
    p.add_argument("--time", default="01:00:00", help="time limit (default 01:00:00)")
    p.add_argument("--job-name", default="ftkit")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--gpus-per-node", type=positive, metavar="G")
    p.add_argument("--cpus-per-task", type=positive, metavar="C")
    p.add_argument("--exclusive", action="store_true", help="whole nodes")
    p.add_argument("--levels", metavar="LEVELS", default="local:1,partner:1,pfs:10",
                   help="FTKIT_LEVELS of the job (default local:1,partner:1,pfs:10)")
    p.add_argument("--local-dir", metavar="DIR",
                   help="FTKIT_LOCAL_DIR on the nodes, e.g. a node-local NVMe mount "
                        "(default: ftkit's, /dev/shm/ftkit-$USER)")
    p.add_argument("--pfs-dir", metavar="DIR", help="FTKIT_PFS_DIR of the job")
    p.add_argument("--signal-seconds", type=non_negative, default=120, metavar="T",
                   help="SIGUSR1 this long before the time limit (default 120; 0: none)")
    p.add_argument("--no-requeue", action="store_true", help="never requeue the job")
    p.add_argument("--max-restarts", type=non_negative, default=3, metavar="R")
    p.add_argument("--shrink", action="store_true",
                   help="out of spares, go on with fewer ranks on the healthy nodes instead "
                        "of requeueing (ftkit run --shrink; needs a pfs level)")
    p.add_argument("--shrink-multiple", type=positive, default=1, metavar="M",
                   help="with --shrink: the rank count stays a multiple of M (e.g. tp*pp)")
    p.add_argument("--in-job", action="store_true",
                   help="in-job recovery (ftkit run --in-job): the spare nodes hold spare "
                        "ranks that take a failed node's place in the running job")
    p.add_argument("--setup", action="append", default=[], metavar="LINE",
                   help="a shell line run first, verbatim (module load ..., source "
                        "venv/bin/activate); repeatable")
    p.add_argument("--out", metavar="FILE", help="write the script here instead of stdout")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]")
    p.set_defaults(func=cmd_sbatch)


def cmd_sbatch(args: argparse.Namespace) -> int:
    """Body of ``ftkit sbatch``."""
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    env = [("FTKIT_LEVELS", args.levels)]
    if args.pfs_dir:
        env.append(("FTKIT_PFS_DIR", args.pfs_dir))
    try:
        spec = SbatchSpec(command=tuple(cmd), nodes=args.nodes, spares=args.spares,
                          tasks_per_node=args.tasks_per_node, time=args.time,
                          job_name=args.job_name, signal_seconds=args.signal_seconds,
                          requeue=not args.no_requeue, max_restarts=args.max_restarts,
                          shrink=args.shrink_multiple if args.shrink else 0,
                          partition=args.partition, account=args.account,
                          gpus_per_node=args.gpus_per_node, cpus_per_task=args.cpus_per_task,
                          exclusive=args.exclusive, local_dir=args.local_dir, env=tuple(env),
                          setup=tuple(args.setup), in_job=args.in_job)
    except LaunchError as exc:
        print(f"ftkit sbatch: error: {exc}", file=sys.stderr)
        return 2
    text = render_sbatch(spec)
    if args.out is None:
        sys.stdout.write(text)
        return 0
    out = Path(args.out)
    try:
        write_text_atomic(out, text, mode=0o755)
    except OSError as exc:
        print(f"ftkit sbatch: error: cannot write {out}: {exc.strerror}", file=sys.stderr)
        return 2
    print(f"ftkit sbatch: wrote {out} ({spec.nodes} + {spec.spares} nodes); submit it with: "
          f"sbatch {out}")
    return 0

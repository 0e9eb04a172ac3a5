"""``ftkit status [JOB]``: where a job stands, from its files alone (no MPI, no HDF5 reads).

Without JOB: every job under ``$FTKIT_PFS_DIR``, most recently active last, with whether an
``ftkit run`` holds it, its newest committed steps and its last outcome. With JOB: the same
in detail — its committed steps per level (the PFS, and the node-local copies *as this host
sees them*: on a cluster, node-local data lives on every node) with their sizes, its run id
and the last events of ``events.jsonl``. ``--json`` prints the same as one JSON document.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from ftkit.cli.args import error, non_negative_int
from ftkit.cli.fmt import human, tree_size
from ftkit.config import Config
from ftkit.errors import ConfigError
from ftkit.jobdir.events import read_events
from ftkit.jobdir.identity import RUN_FILE
from ftkit.jobdir.lock import LOCK_FILE, describe, held_by
from ftkit.launch.jobs import jobs_in
from ftkit.launch.orphans import held_locks, this_host_job_dir
from ftkit.storage.stepnames import step_dirs

OUTCOMES = ("done", "gave-up", "stopped", "requeue", "attempt-end")


def committed_steps(root: Path) -> list[dict[str, Any]]:
    """``{"step", "bytes"}`` of every ``step-<s>/COMMITTED`` directly under ``root``, oldest
    first ([] when ``root`` does not exist)."""
    return [{"step": step, "bytes": tree_size(path)} for step, path in step_dirs(root)
            if (path / "COMMITTED").is_file()]


def local_steps(job_local: Path) -> dict[str, list[dict[str, Any]]]:
    """Committed node-local steps per ``node-<id>`` directory of ``job_local`` (this host's
    view; under Slurm, one tree per Slurm node name above the job)."""
    out: dict[str, list[dict[str, Any]]] = {}
    try:
        nodes = sorted(e.name for e in os.scandir(job_local) if e.name.startswith("node-"))
    except OSError:
        return out
    for node in nodes:
        out[node] = committed_steps(job_local / node)
    return out


def job_status(cfg: Config, events: int = 5) -> dict[str, Any]:
    """Everything ``ftkit status JOB`` says, as a dict (plain file reads)."""
    job_dir = cfg.job_pfs_dir
    job_local = this_host_job_dir(cfg)
    log = list(read_events(cfg.events_path)) if cfg.events_path.is_file() else []
    holder = held_by(job_dir / LOCK_FILE)
    outcome = next((e for e in reversed(log) if e.get("event") in OUTCOMES), None)
    run = _run_id(job_dir / RUN_FILE)
    ranks = {str(p): describe(h) for p, h in held_locks(job_local).items()}
    return {"job": cfg.job, "pfs_dir": str(job_dir), "local_dir": str(job_local),
            "running": describe(holder) if holder is not None else None, "ranks": ranks,
            "run": run,
            "pfs": committed_steps(job_dir), "local": local_steps(job_local),
            "outcome": outcome, "events": log[-events:] if events else []}


def _run_id(path: Path) -> str | None:
    """The ``run`` of a RUN record; None when there is none or it cannot be read."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    run = record.get("run") if isinstance(record, dict) else None
    return run if isinstance(run, str) else None


def _steps(steps: list[dict[str, Any]]) -> str:
    if not steps:
        return "none"
    return ", ".join(f"{s['step']} ({human(s['bytes'])})" for s in steps)


def _event_line(e: dict[str, Any]) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.get("time", 0)))
    rest = {k: v for k, v in e.items() if k not in ("event", "time")}
    return f"  {when}  {e.get('event')}  {json.dumps(rest)[:160]}"


def _outcome(e: dict[str, Any] | None) -> str:
    if e is None:
        return "no outcome yet"
    what = e.get("event")
    if what == "attempt-end":
        return f"attempt {e.get('attempt')} ended: {e.get('reason')}"
    if what == "gave-up":
        return f"gave up: {e.get('reason')} (status {e.get('status')})"
    return f"{what}" + (f" (step {e['step']})" if "step" in e else "")


def _running(st: dict[str, Any]) -> str:
    """``running (holder)``, ``not running``, or what still holds its node-local locks."""
    if st["running"]:
        return f"running ({st['running']})"
    if st["ranks"]:
        return ("no ftkit run holds it, but its ranks still run on this host (" +
                "; ".join(f"{who} holds {path}" for path, who in st["ranks"].items()) + ")")
    return "not running"


def print_job(st: dict[str, Any]) -> None:
    print(f"job {st['job']}: {_running(st)}; {_outcome(st['outcome'])}")
    print(f"  run id: {st['run'] or 'none'}")
    print(f"  PFS {st['pfs_dir']}: committed steps {_steps(st['pfs'])}")
    if not st["local"]:
        print(f"  node-local {st['local_dir']} (this host): none")
    for node, steps in st["local"].items():
        print(f"  node-local {st['local_dir']}/{node} (this host): committed steps "
              f"{_steps(steps)}")
    if st["events"]:
        print(f"  last {len(st['events'])} events:")
        for e in st["events"]:
            print(_event_line(e))


def cmd_status(args: argparse.Namespace) -> int:
    """Body of ``ftkit status``; returns the exit status (0, or 1 for an unknown JOB)."""
    base = Config.load()
    if args.job is None:
        jobs = [job_status(Config.load(job=j), events=0) for j in jobs_in(Path(base.pfs_dir))]
        if args.json:
            print(json.dumps({"pfs_dir": base.pfs_dir, "jobs": jobs}, indent=1))
            return 0
        if not jobs:
            print(f"ftkit status: no job under FTKIT_PFS_DIR={base.pfs_dir}")
        for st in jobs:
            newest = st["pfs"][-1]["step"] if st["pfs"] else None
            running = "running" if st["running"] else \
                "ranks still running" if st["ranks"] else "not running"
            print(f"{st['job']}: {running}; "
                  f"newest PFS step {newest if newest is not None else 'none'}; "
                  f"{_outcome(st['outcome'])}")
        return 0
    cfg = Config.load(job=args.job)
    if not cfg.job_pfs_dir.is_dir() and not cfg.job_local_dir.is_dir():
        print(f"ftkit status: no job {args.job} under FTKIT_PFS_DIR={cfg.pfs_dir} or "
              f"FTKIT_LOCAL_DIR={cfg.local_dir} (jobs there: "
              f"{', '.join(jobs_in(Path(cfg.pfs_dir))[-5:]) or 'none'})")
        return 1
    st = job_status(cfg, events=args.events)
    if args.json:
        print(json.dumps(st, indent=1))
    else:
        print_job(st)
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    p.add_argument("--events", type=non_negative_int, default=5, metavar="N",
                   help="how many of the last events to show (default 5)")
    p.set_defaults(func=_cmd_status)


def _cmd_status(args: argparse.Namespace) -> int:
    try:
        return cmd_status(args)
    except ConfigError as exc:
        return error("status", exc)

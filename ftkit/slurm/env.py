"""Everything ftkit reads from ``SLURM_*`` variables, parsed in one declarative place, plus
Slurm hostlist expressions (``scontrol show hostnames`` semantics).

>>> expand_hostlist("n[1-3,7],login")
['n1', 'n2', 'n3', 'n7', 'login']
>>> compress_hostlist(["n1", "n2", "n3", "n7"])
'n[1-3,7]'
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Iterable, Mapping

from ftkit.errors import LaunchError

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
#: Most host names one expression may expand to (a bad ``n[0-999999999]`` must not allocate
#: forever; Slurm itself refuses ranges of more than 64K hosts).
MAX_HOSTS = 1_000_000
#: Most digits of a host number, zero padding included (numbers fit an unsigned 64-bit
#: integer, as in Slurm's own hostlists).
MAX_DIGITS = 18


def _split_top(expr: str) -> list[str]:
    """Split at commas that are not inside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise LaunchError(f"bad hostlist {expr!r}: unbalanced ']'")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise LaunchError(f"bad hostlist {expr!r}: unbalanced '['")
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def _too_many(expr: str) -> LaunchError:
    return LaunchError(f"bad hostlist {expr!r}: expands to more than {MAX_HOSTS} hosts")


def _expand_ranges(body: str, expr: str) -> list[str]:
    out: list[str] = []
    for item in body.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise LaunchError(f"bad hostlist {expr!r}: range {item!r} is not N or N-M")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if max(len(lo), len(hi)) > MAX_DIGITS:
            raise LaunchError(f"bad hostlist {expr!r}: a number has more than {MAX_DIGITS} "
                              "digits")
        if int(hi) < int(lo):
            raise LaunchError(f"bad hostlist {expr!r}: range {item!r} runs backwards")
        if len(out) + int(hi) - int(lo) + 1 > MAX_HOSTS:
            raise _too_many(expr)
        width = len(lo) if lo.startswith("0") else 0
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def expand_hostlist(expr: str) -> list[str]:
    """``n[01-03],x[1-2]y[5,7]`` -> every host name in order (zero padding kept).

    LaunchError naming ``expr`` when it is malformed or expands to more than
    :data:`MAX_HOSTS` names or has a number of more than :data:`MAX_DIGITS` digits."""
    hosts: list[str] = []
    for term in _split_top(expr):
        pieces = re.split(r"(\[[^\]]*\])", term)
        choices = [_expand_ranges(p[1:-1], expr) if p.startswith("[") else [p]
                   for p in pieces if p]
        if len(hosts) + math.prod(len(c) for c in choices) > MAX_HOSTS:
            raise _too_many(expr)
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


def compress_hostlist(hosts: Iterable[str]) -> str:
    """Inverse of :func:`expand_hostlist`: consecutive names with one prefix and one padding
    style share a bracket (``n1,n2,n3,n7`` -> ``n[1-3,7]``); the order is always kept."""
    groups: list[tuple[str, int, list[str]] | str] = []      # (prefix, width, digits) | name
    for h in hosts:
        m = re.match(r"^(.*?)(\d+)$", h)
        if not m:
            groups.append(h)
            continue
        prefix, digits = m.group(1), m.group(2)
        padded = digits.startswith("0") and len(digits) > 1
        last = groups[-1] if groups else None
        if isinstance(last, tuple) and last[0] == prefix and (
                len(digits) == last[1] if last[1] else not padded):
            last[2].append(digits)
        else:
            groups.append((prefix, len(digits) if padded else 0, [digits]))
    return ",".join(g if isinstance(g, str) else _bracket(g[0], g[2]) for g in groups)


def _bracket(prefix: str, digits: list[str]) -> str:
    if len(digits) == 1:
        return prefix + digits[0]
    runs = []
    for _, grp in itertools.groupby(enumerate(digits), lambda p: int(p[1]) - p[0]):
        run = [d for _, d in grp]
        runs.append(run[0] if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return f"{prefix}[{','.join(runs)}]"


@dataclasses.dataclass(frozen=True)
class SlurmEnv:
    """The allocation ftkit runs in, from the environment of the batch script / a task."""

    job_id: str
    nodes: tuple[str, ...]            # SLURM_JOB_NODELIST, expanded
    tasks_per_node: int | None        # SLURM_NTASKS_PER_NODE (first value)
    restart_count: int                # SLURM_RESTART_COUNT: times the job was requeued
    node_name: str | None             # SLURMD_NODENAME: the node this process runs on
    cluster: str | None

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> SlurmEnv | None:
        """``None`` outside an allocation; LaunchError naming the variable if malformed."""
        job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job:
            return None
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
        return cls(job_id=job, nodes=tuple(expand_hostlist(nodelist)),
                   tasks_per_node=_first_int(env, "SLURM_NTASKS_PER_NODE"),
                   restart_count=_first_int(env, "SLURM_RESTART_COUNT") or 0,
                   node_name=env.get("SLURMD_NODENAME") or None,
                   cluster=env.get("SLURM_CLUSTER_NAME") or None)


def _first_int(env: Mapping[str, str], key: str) -> int | None:
    """``SLURM_NTASKS_PER_NODE=2(x4)`` style values: the first number, or None if unset."""
    raw = env.get(key)
    if not raw:
        return None
    m = re.match(r"^\s*(\d+)", raw)
    if not m:
        raise LaunchError(f"{key}={raw!r}: expected a number")
    return int(m.group(1))

"""What the relaunch loop needs from a launcher, with every optional hook defaulted.

A launcher starts one attempt (:meth:`Launcher.command` and :meth:`Launcher.environ`); one
that owns the job's nodes (Slurm) also says what to do after a failure (exclude nodes, take
spares, shrink or requeue). A new launcher is one module with a :class:`Launcher` subclass
plus one entry in :mod:`ftkit.launch.registry`.
"""
from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence

from ftkit.config import Config
from ftkit.launch.spec import RunSpec


@dataclasses.dataclass(frozen=True)
class Recovery:
    """What to do after a failed attempt (:meth:`Launcher.after_failure`)."""

    action: str                      # "relaunch", "shrink" or "requeue"
    failed: dict[str, str]           # node -> why
    replaced: dict[str, str]         # failed node -> spare that took its slot
    message: str
    n: int | None = None             # ranks of the next attempt when they change (shrink)


@dataclasses.dataclass(frozen=True)
class Request:
    """What ``ftkit run`` asks for: the environment it runs in, ``--mpiexec`` (None: find
    one), ``--launcher-args``, the run and its configuration (None in a tool that only
    builds commands)."""

    env: Mapping[str, str]
    mpiexec: str | None = None
    extra: Sequence[str] = ()
    spec: RunSpec | None = None
    cfg: Config | None = None


class Launcher(abc.ABC):
    """Starts the attempts of one ``ftkit run``."""

    #: short name recorded in events (``mpiexec``, ``srun``)
    name: str = ""
    #: whether :meth:`after_failure` can change the job's nodes (spares, shrink, requeue)
    recovers: bool = False

    @abc.abstractmethod
    def command(self, n: int, cmd: Sequence[str]) -> list[str]:
        """Launcher argv for ``n`` ranks of ``cmd``."""

    @abc.abstractmethod
    def environ(self, base: Mapping[str, str]) -> dict[str, str]:
        """Launcher environment derived from ``base``."""

    def describe(self) -> dict[str, object]:
        """Where the ranks run, for the ``launch`` and ``nodes`` events (none: ``{}``)."""
        return {}

    def follow_in_job(self) -> dict[int, str]:
        """After an attempt: learn where in-job recoveries moved ranks; the node slots that
        moved (none: ``{}``)."""
        return {}

    def after_failure(self) -> Recovery:
        """After a failed attempt: which nodes failed and what comes next. Only called
        when :attr:`recovers`; the default relaunches on the same nodes."""
        return Recovery("relaunch", {}, {}, "same nodes")

    def requeue(self) -> tuple[bool, str]:
        """Ask the scheduler to requeue the job: ``(ok, detail)``."""
        return False, f"the {self.name} launcher cannot requeue a job"

"""What ``ftkit run`` was asked to do (:class:`RunSpec`), checked when it is made."""
from __future__ import annotations

import dataclasses
import math

from ftkit.errors import LaunchError

DEFAULT_ATTEMPT_TIMEOUT = 0.0      # no wall-clock limit per attempt (0: none)
DEFAULT_STALL_TIMEOUT = 3600.0     # an attempt without a checkpoint event this long is hung
#: --in-job: an attempt whose processes did not all pass MPI_Init this long after launch is
#: ended (a process that dies during MPI_Init leaves the others waiting there: ULFM does not
#: cover initialisation)
DEFAULT_STARTUP_TIMEOUT = 180.0
DEFAULT_KILL_GRACE = 5.0


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """What ``ftkit run`` was asked to do."""

    n: int
    cmd: tuple[str, ...]
    ranks_per_node: int | None = None
    spares: int = 0
    max_restarts: int = 0
    attempt_timeout: float = DEFAULT_ATTEMPT_TIMEOUT     # seconds; 0: no wall-clock limit
    stall_timeout: float = DEFAULT_STALL_TIMEOUT         # seconds; 0: no progress watchdog
    kill_grace: float = DEFAULT_KILL_GRACE
    fresh: bool = False                  # attempt 0 starts over (FTKIT_START=fresh)
    restart_delay: float = 0.0           # seconds before restart 1, then doubled (the CLI: 2)
    tidy: bool = False                   # a successful end removes the node-local copies
    #                                      (when the newest step is on the PFS)
    shrink: int = 0                      # --shrink: out of spares, go on with fewer ranks,
    #                                      a multiple of this (0: requeue instead; Slurm)
    in_job: bool = False                 # --in-job: spares are ranks replacing failed ones
    #                                      in the running job (ULFM)
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT    # --in-job: seconds from launch to
    #                                      the job's first event; 0: not watched

    def start(self, attempt: int) -> str:
        """``FTKIT_START`` of ``attempt``: relaunches resume what attempt 0 committed."""
        return "fresh" if self.fresh and attempt == 0 else "resume"

    def __post_init__(self) -> None:
        checks = ((self.n >= 1, f"-n must be >= 1, got {self.n}"),
                  (bool(self.cmd), "no command given after --"),
                  (self.ranks_per_node is None or self.ranks_per_node >= 1,
                   f"--ranks-per-node must be >= 1, got {self.ranks_per_node}"),
                  (self.spares >= 0, f"--spares must be >= 0, got {self.spares}"),
                  (self.max_restarts >= 0, f"--max-restarts must be >= 0, got {self.max_restarts}"),
                  (self.shrink >= 0, f"--shrink-multiple must be >= 1, got {self.shrink}"),
                  _seconds_ok(self.attempt_timeout, "--attempt-timeout", "no limit"),
                  _seconds_ok(self.stall_timeout, "--stall-timeout", "no watchdog"),
                  _seconds_ok(self.startup_timeout, "--startup-timeout", "not watched"),
                  (self.kill_grace >= 0, f"kill grace must be >= 0, got {self.kill_grace}"))
        for ok, message in checks:
            if not ok:
                raise LaunchError(message)


def _seconds_ok(value: float, option: str, zero: str) -> tuple[bool, str]:
    """A ``(ok, message)`` check of a limit in seconds: finite and >= 0 (0 means ``zero``)."""
    return (math.isfinite(value) and value >= 0,
            f"{option} must be a finite number of seconds >= 0 (0: {zero}), got {value}")

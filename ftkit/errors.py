"""Exception tree of ftkit.

Every error that concerns a checkpoint names the rank, the step, the level and the file
where it can, so that a user reading one line of a log knows where to look.
"""
from __future__ import annotations

from collections.abc import Mapping


class FtkitError(Exception):
    """Base class of every error ftkit raises on purpose.

    ``recurs`` is True for errors that a relaunch of the same job would hit again (a bad
    configuration, a checkpoint that cannot be used, a state that does not match it):
    ``ftkit run`` stops instead of retrying them.
    """

    recurs: bool = False


class ConfigError(FtkitError, ValueError):
    """A configuration key or value (or a topology shape) is invalid."""

    recurs = True


class UnsafeLocalDirError(ConfigError, OSError):
    """An entry of the node-local tree is not private to the user running ftkit: a
    symbolic link, not a directory (or not a regular file), owned by another user, or open
    to group/others. ftkit refuses it instead of writing checkpoints where another user can
    redirect, hide or read them; the message names the path, owner, mode and what to do.

    A ConfigError (``ftkit run`` does not retry it) and an OSError (the Checkpointer's
    collective check of the local directory reports it on every rank)."""


class CheckpointError(FtkitError):
    """A collective checkpoint operation failed on one or more ranks.

    Raised with the *same* ``failures`` mapping on every rank, so that all ranks take the
    same decision (the mpi4py "abort, don't hang" rule).
    """

    def __init__(self, step: int, failures: Mapping[int, str], message: str = "") -> None:
        self.step = step
        self.failures = dict(sorted(failures.items()))
        lines = "; ".join(f"rank {r}: {why}" for r, why in self.failures.items())
        head = message or f"checkpoint of step {step} failed"
        super().__init__(f"{head}: {lines}" if lines else head)


class ProtocolTimeout(CheckpointError):
    """A protocol phase did not complete within ``FTKIT_TIMEOUT`` seconds."""


class NoCheckpointError(FtkitError):
    """A command asked for a checkpoint that does not exist."""


class CorruptCheckpointError(FtkitError):
    """A shard or record failed validation (magic, header, size, checksum, identity)."""

    def __init__(self, path: str, reason: str, *, rank: int | None = None,
                 step: int | None = None, level: str = "local") -> None:
        self.path = path
        self.reason = reason
        self.rank = rank
        self.step = step
        self.level = level
        where = [f"level {level}"]
        if rank is not None:
            where.append(f"rank {rank}")
        if step is not None:
            where.append(f"step {step}")
        super().__init__(f"{path} ({', '.join(where)}): {reason}")


class StorageError(FtkitError, OSError):
    """Writing to a level failed (full disk, I/O error, permissions); names file/rank/step."""

    def __init__(self, path: str, exc: OSError, *, rank: int, step: int, level: str) -> None:
        self.path, self.rank, self.step, self.level = path, rank, step, level
        FtkitError.__init__(self, f"cannot write {path} (level {level}, rank {rank}, step "
                                  f"{step}): {exc.strerror or exc}")
        self.errno = exc.errno


class UnrecoverableError(FtkitError):
    """Committed checkpoints exist but none can be used (no copy of a required shard
    survives on any level, or they belong to another run or layout). Nothing was deleted;
    starting over is an explicit choice (``ftkit run --fresh`` / ``FTKIT_START=fresh``)."""

    recurs = True


class StateMismatchError(CheckpointError):
    """The state passed to ``restore`` does not have the structure (names, shapes, dtypes)
    of the checkpoint: resuming would silently train another model, so it is refused."""

    recurs = True


class JobLockedError(ConfigError):
    """Another instance of the same job holds its lock (:mod:`ftkit.jobdir.lock`): two writers
    of one job would destroy each other's checkpoints. The message names the job, the
    holder (host, pid, role) and what to do. A ConfigError: ``ftkit run`` does not retry it."""


class UnsupportedStateError(FtkitError):
    """The state given to ``restore()`` (or the first ``save()``) holds a leaf ftkit cannot
    checkpoint — a plain DataLoader, an object without ``state_dict`` — named with what to
    use instead. Raised on every rank before the first step; ``ftkit run`` does not retry it."""

    recurs = True


class LaunchError(FtkitError):
    """``ftkit run`` could not launch or relaunch the job."""


class InjectedFault(FtkitError):
    """Raised by the ``raise`` kind of fault injection (FTKIT_FAULTS)."""


def one_line(exc: BaseException, limit: int = 400) -> str:
    """An exception as one short line: the reason a copy or a step is unusable. ftkit's own
    errors already name file, rank and step; anything else is prefixed with its type."""
    text = str(exc) if isinstance(exc, FtkitError) else f"{type(exc).__name__}: {exc}"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."

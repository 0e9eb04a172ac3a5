"""Launching jobs: ``mpiexec`` command building (pure), the ``ftkit run`` relaunch loop, the
records with which ranks stop it or say why they died (:mod:`ftkit.launch.fatal`), and what an
attempt came to (:mod:`ftkit.launch.failures`, :mod:`ftkit.launch.outcome`)."""
from ftkit.launch.fatal import FATAL_DIR_ENV, read_fatal, record_death, record_fatal
from ftkit.launch.mpiexec import (
    MPICH,
    OPENMPI,
    UNKNOWN,
    MpiexecLauncher,
    build_command,
    detect_flavor,
    find_mpiexec,
    launch_env,
    query_flavor,
    rewrite_python,
)
from ftkit.launch.outcome import NOT_RETRIED_STATUS, AttemptResult, attempt_line, judge
from ftkit.launch.relaunch import (
    Launcher,
    RunSpec,
    done_file_path,
    resolve_launcher,
    run_attempt,
    run_job,
)

__all__ = ["FATAL_DIR_ENV", "MPICH", "NOT_RETRIED_STATUS", "OPENMPI", "UNKNOWN", "AttemptResult",
           "Launcher", "MpiexecLauncher", "RunSpec", "attempt_line", "build_command",
           "detect_flavor", "done_file_path", "find_mpiexec", "judge", "launch_env",
           "query_flavor", "read_fatal", "record_death", "record_fatal", "resolve_launcher", "rewrite_python",
           "run_attempt", "run_job"]

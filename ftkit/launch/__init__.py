"""Launching jobs: ``mpiexec`` command building (pure) and the ``ftkit run`` relaunch loop."""
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
from ftkit.launch.relaunch import (
    AttemptResult,
    Launcher,
    RunSpec,
    attempt_line,
    done_file_path,
    judge,
    resolve_launcher,
    run_attempt,
    run_job,
)

__all__ = ["MPICH", "OPENMPI", "UNKNOWN", "AttemptResult", "Launcher", "MpiexecLauncher",
           "RunSpec", "attempt_line", "build_command", "detect_flavor", "done_file_path",
           "find_mpiexec", "judge", "launch_env", "query_flavor", "resolve_launcher",
           "rewrite_python", "run_attempt", "run_job"]

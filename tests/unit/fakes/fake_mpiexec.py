"""A fake ``mpiexec`` for the relaunch-loop tests; it never runs the command it is given.

``--version`` prints ``$FAKE_MPIEXEC_VERSION`` (default: Hydra text). Otherwise it appends one
JSON line (argv and the ftkit variables it saw) to ``$FAKE_MPIEXEC_LOG`` and then performs the
action that ``$FAKE_MPIEXEC_PLAN`` (comma-separated, indexed by ``FTKIT_ATTEMPT``; the last
entry repeats) names for this attempt:

``ok``            write ``$FTKIT_DONE_FILE`` (JSON) and exit 0
``nomarker``      exit 0 without the marker
``exit:N``        exit N
``marker-exit:N`` write the marker, then exit N
``selfkill``      SIGKILL itself
``straggler``     start a sleeping child in its group, print its pid, exit 1
``hang``          print ``FAKE READY``, wait for a signal; SIGTERM/SIGINT exit 128+signum after
                  recording the signal in ``$FAKE_MPIEXEC_LOG``
``hang-stubborn`` like ``hang`` but ignore SIGTERM and SIGINT
"""
import json
import os
import signal
import subprocess
import sys

_HYDRA = "HYDRA build details:\n    Version:                                 fake\n"


def _log(record):
    path = os.environ.get("FAKE_MPIEXEC_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _marker():
    with open(os.environ["FTKIT_DONE_FILE"], "w") as f:
        json.dump({"attempt": int(os.environ["FTKIT_ATTEMPT"])}, f)


def _on_signal(signum, _frame):
    _log({"signal": signum})
    os._exit(128 + signum)


def _hang(stubborn):
    handler = signal.SIG_IGN if stubborn else _on_signal
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    print("FAKE READY", flush=True)
    while True:
        signal.pause()


def main():
    if sys.argv[1:] == ["--version"]:
        print(os.environ.get("FAKE_MPIEXEC_VERSION", _HYDRA), flush=True)
        return 0
    attempt = int(os.environ["FTKIT_ATTEMPT"])
    plan = os.environ.get("FAKE_MPIEXEC_PLAN", "ok").split(",")
    action = plan[min(attempt, len(plan) - 1)]
    env = {k: v for k, v in os.environ.items() if k.startswith(("FTKIT_", "OMPI_"))}
    _log({"argv": sys.argv[1:], "attempt": attempt, "action": action, "env": env})
    kind, _, arg = action.partition(":")
    if kind in ("ok", "marker-exit"):
        _marker()
    if kind in ("ok", "nomarker"):
        return 0
    if kind in ("exit", "marker-exit"):
        return int(arg)
    if kind == "selfkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "straggler":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        _log({"straggler": child.pid})
        return 1
    if kind in ("hang", "hang-stubborn"):
        _hang(kind == "hang-stubborn")
    raise SystemExit(f"fake mpiexec: unknown action {action!r}")


if __name__ == "__main__":
    sys.exit(main())

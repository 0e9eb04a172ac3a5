"""Every ftkit benchmark in one run: bounds of this machine, ftkit's levels, peers (torch DCP,
torch.save), protocol cost growth, recovery time, checkpoint overhead of the HP example.

    python bench/run.py [--quick] [--out DIR]        # full: sizes 1 MiB .. 1 GiB per rank
    python bench/run.py --smoke --out /tmp/x         # tiny sizes: keeps the code working

Each part is its own script (``bench/bounds.py``, ``levels.py`` (twice: 4 ranks on 2 nodes,
and the restore goal's 2 ranks x 256 MiB as ``levels_2ranks``), ``memory.py``,
``redundancy.py``, ``hdf5_vs_dcp.py``, ``protocol.py``, ``recovery.py``, ``hp_overlap.py``) run as a subprocess
that writes ``<part>.json`` into DIR; this script then derives every ratio the goals name, prints
``name: value (ratio to X = r)`` lines, and writes ``DIR/run.json`` (figures + the parts +
the machine) and PNG plots (matplotlib).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _figures
import _mpi
import _plots

#: part -> extra arguments for (full, quick, smoke) runs
PARTS: dict[str, tuple[list[str], list[str], list[str]]] = {
    "bounds": ([], ["--quick"], ["--quick", "--size-mib", "4", "--repeat", "1"]),
    # 1 GiB per rank does not fit 4 ranks in 24 GiB (state + staging + 2 versions + copies):
    # on a larger machine run bench/levels.py --sizes-mib 1,16,64,256,1024 directly
    "levels": (["--sizes-mib", "1,16,64,256"], ["--quick"],
               ["--quick", "--sizes-mib", "1", "--repeat", "1"]),
    # the save / restore goals' own setting: 2 ranks (one per node) x 256 MiB
    "levels_2ranks": (["--ranks", "2", "--ranks-per-node", "1", "--levels", "local,partner,xor",
                       "--sizes-mib", "256", "--repeat", "5", "--name", "levels_2ranks"],
                      ["--ranks", "2", "--ranks-per-node", "1", "--levels", "local,partner",
                       "--sizes-mib", "16", "--name", "levels_2ranks"],
                      ["--ranks", "2", "--ranks-per-node", "1", "--levels", "local,partner,xor",
                       "--sizes-mib", "1", "--repeat", "1", "--name", "levels_2ranks"]),
    # what a rank holds: the private-memory goal's setting, 2 ranks x 256 MiB, local:1
    "memory": ([], ["--size-mib", "64"], ["--size-mib", "1", "--saves", "1"]),
    "redundancy": (["--repeat", "5"], ["--size-mib", "16"],
                   ["--ranks", "2", "--size-mib", "1", "--repeat", "1"]),
    "hdf5_vs_dcp": (["--size-mib", "256", "--repeat", "5", "--load-repeat", "9"], ["--quick", "--ranks", "2"],
                    ["--quick", "--ranks", "2", "--size-mib", "4", "--repeat", "1"]),
    # the PFS goals' large setting: 1 GiB per rank, 2 ranks (one per node)
    "hdf5_vs_dcp_1g": (["--ranks", "2", "--ranks-per-node", "1", "--size-mib", "1024",
                        "--repeat", "4", "--load-repeat", "7", "--name", "hdf5_vs_dcp_1g"],
                       ["--quick", "--ranks", "2", "--ranks-per-node", "1",
                        "--name", "hdf5_vs_dcp_1g"],
                       ["--quick", "--ranks", "2", "--ranks-per-node", "1", "--repeat", "1",
                        "--name", "hdf5_vs_dcp_1g"]),
    "protocol": ([], ["--quick"], ["--quick", "--ranks-list", "2,4", "--saves", "4"]),
    "recovery": ([], ["--quick"], ["--quick"]),
    "hp_overlap": ([], ["--steps", "20", "--repeat", "2"],
                   ["--steps", "6", "--hidden", "32", "--seq", "16", "--repeat", "1"]),
}

#: parts run by another part's script (with their own arguments and report name)
SCRIPTS = {"levels_2ranks": "levels", "hdf5_vs_dcp_1g": "hdf5_vs_dcp"}


def run_part(name: str, extra: list[str], out: Path) -> tuple[dict[str, Any], float]:
    """Run ``bench/<name>.py``; returns its JSON and wall seconds (raises on failure)."""
    cmd = [sys.executable, str(HERE / f"{SCRIPTS.get(name, name)}.py"), *extra,
           "--out", str(out)]
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, check=False, timeout=3600, text=True, capture_output=True)
    seconds = time.monotonic() - t0
    sys.stdout.write(proc.stdout)
    if proc.returncode:
        raise SystemExit(f"bench/{name}.py failed (exit {proc.returncode}):\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads((out / f"{name}.json").read_text()), seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a few sizes (< 10 min on 2 cores)")
    mode.add_argument("--smoke", action="store_true", help="tiny sizes (tests)")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--only", default="", help="comma-separated parts (default: all)")
    ap.add_argument("--table", metavar="RUN_JSON",
                    help="print the docs/performance.md tables (figures, costs) of a run.json")
    args = ap.parse_args()
    if args.table:
        run = json.loads(Path(args.table).read_text())
        print(_figures.markdown(run["figures"]), end="")
        costs = _figures.costs_markdown(run["parts"].get("levels", {}))
        print(f"\nWhat one checkpoint costs a rank (the most any rank paid):\n\n{costs}"
              if costs else "", end="")
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    which = 2 if args.smoke else 1 if args.quick else 0
    names = [p for p in PARTS if not args.only or p in args.only.split(",")]
    parts, seconds = {}, {}
    for name in names:
        parts[name], seconds[name] = run_part(name, PARTS[name][which], out)
    figures = _figures.derive(parts)
    print("\n== summary")
    for line in _figures.lines(figures):
        print(line)
    report = {"command": " ".join(["python", *sys.argv]), "mode": ["full", "quick",
                                                                  "smoke"][which],
              "machine": _mpi.machine(), "seconds": seconds, "figures": figures, "parts": parts}
    (out / "run.json").write_text(json.dumps(report, indent=1) + "\n")
    written = _plots.plot_all(parts, out)
    print(f"wrote {out / 'run.json'} and {', '.join(p.name for p in written)}")


if __name__ == "__main__":
    main()

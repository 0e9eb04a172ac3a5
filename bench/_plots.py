"""PNG plots of ``bench/run.py`` (matplotlib, Agg backend; one function per figure)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def levels(part: dict[str, Any], bound: dict[str, float], out: Path) -> Path:
    """Save and restore bandwidth per level over state size, bounds as dashed lines."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    x0 = min(float(s) for per in part["save_gb_per_s"].values() for s in per)
    for ax, key, title in ((axes[0], "save_gb_per_s", "save"),
                           (axes[1], "restore_gb_per_s", "restore")):
        for level, per_size in part[key].items():
            sizes = sorted(per_size, key=float)
            ax.plot([float(s) for s in sizes], [per_size[s] for s in sizes], "o-", label=level)
        for name in ("tmpfs_write", "p2p_same_node", "disk_write_fsync"):
            if name in bound and title == "save":
                ax.axhline(bound[name], ls="--", lw=0.8, color="grey")
                ax.annotate(name, (x0, bound[name]), fontsize=7, color="grey",
                            va="bottom")
        ax.set(xscale="log", yscale="log", xlabel="state per rank (MiB)", ylabel="GB/s per rank",
               title=f"ftkit {title} by level ({part.get('ranks', '?')} ranks)")
        ax.legend(fontsize=8)
    return _save(fig, out / "levels.png")


def peers(part: dict[str, Any], out: Path) -> Path:
    gbs = part["gb_per_s"]
    fig, ax = plt.subplots(figsize=(8, 4))
    names = sorted(gbs, key=gbs.get)  # type: ignore[arg-type]
    ax.barh(names, [gbs[n] for n in names],
            color=["tab:blue" if n.startswith("ftkit") else "tab:grey" for n in names])
    ax.set(xlabel="GB/s (all ranks)", title="ftkit HDF5 vs torch DCP / torch.save")
    return _save(fig, out / "peers.png")


def protocol(part: dict[str, Any], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, per_n in part["save_s"].items():
        ns = sorted(per_n, key=int)
        ax.plot([int(n) for n in ns], [per_n[n] * 1e3 for n in ns], "o-", label=name)
    ax.set(xscale="log", xlabel="ranks", ylabel="ms per save (empty state)",
           title="protocol cost growth")
    ax.legend()
    return _save(fig, out / "protocol.png")


def recovery(part: dict[str, Any], out: Path) -> Path:
    phases = ["detection_s", "relaunch_s", "discovery_s", "rebuild_s", "load_s",
              "first_step_s"]
    scen = part["scenarios"]
    fig, ax = plt.subplots(figsize=(8, 3))
    names = list(scen)
    left = [0.0] * len(names)
    for phase in phases:
        widths = [scen[n].get(phase, 0.0) for n in names]
        ax.barh(names, widths, left=left, label=phase.removesuffix("_s"))
        left = [a + b for a, b in zip(left, widths)]
    ax.set(xlabel="seconds", title="failure -> training resumed (toy, 4 ranks)")
    ax.legend(fontsize=7, ncol=3)
    return _save(fig, out / "recovery.png")


def plot_all(parts: dict[str, dict[str, Any]], out: Path) -> list[Path]:
    bound = parts.get("bounds", {}).get("gb_per_s", {})
    written = []
    if "levels" in parts:
        written.append(levels(parts["levels"], bound, out))
    if "hdf5_vs_dcp" in parts:
        written.append(peers(parts["hdf5_vs_dcp"], out))
    if "protocol" in parts:
        written.append(protocol(parts["protocol"], out))
    if "recovery" in parts:
        written.append(recovery(parts["recovery"], out))
    return written

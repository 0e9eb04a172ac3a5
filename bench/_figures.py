"""Derive the headline figures of ``bench/run.py`` from the parts' JSON (pure, testable).

A figure is ``{"value", "unit", "to", "ratio", "goal", "op", "met"}``: ``ratio`` is value /
(the value named by ``to``); ``goal`` with ``op`` ``">="`` or ``"<="`` says what the design
asks of the ratio (docs/performance.md); ``met`` is None when no goal applies.
"""
from __future__ import annotations

from typing import Any

Figures = dict[str, dict[str, Any]]
LEVEL_BOUND = {"local": ("tmpfs_write", 0.8), "partner": ("p2p_same_node", 0.7),
               "xor": ("p2p_same_node", 0.7), "rs": ("p2p_same_node", None),
               "pfs": ("disk_write_fsync", None)}
#: a whole node-local restore (new Checkpointer, every byte verified) against a memcpy of
#: the same bytes per rank
RESTORE_BOUND = {"local": ("memcpy", 0.4)}
#: a whole synchronous node-local save (steady state) against a memcpy of the same bytes
SAVE_MEMCPY_GOAL = {"local": 0.45}
#: a whole synchronous save with a redundancy level (steady state) against the slower of a
#: memcpy and an MPI p2p exchange of the same bytes (median of per-round ratios)
SAVE_BOUND_GOAL = {"partner": 0.45, "xor": 0.4}
#: the largest deviation of a round's save seconds from their median, as a fraction
SAVE_SPREAD_GOAL = 0.2
#: private memory a rank holds beyond its state during a synchronous ``local:1`` save, as
#: a fraction of the state (a staging buffer would be 1.0)
PRIVATE_MEMORY_GOAL = 0.1


def _fig(value: float, unit: str, to: str | None = None, base: float | None = None,
         goal: float | None = None, op: str = ">=") -> dict[str, Any]:
    ratio = value / base if base else None
    met = None
    if goal is not None and ratio is not None:
        met = ratio >= goal if op == ">=" else ratio <= goal
    return {"value": value, "unit": unit, "to": to, "ratio": ratio, "goal": goal, "op": op,
            "met": met}


def _largest(per_size: dict[str, float]) -> tuple[str, float]:
    size = max(per_size, key=float)
    return size, per_size[size]


def bounds(part: dict[str, Any]) -> Figures:
    return {f"bound[{k}]": _fig(v, "GB/s") for k, v in part["gb_per_s"].items()}


def levels(part: dict[str, Any], bound: dict[str, float], tag: str = "") -> Figures:
    """Save bandwidth per level at the largest size (redundancy levels: their increment over
    local, i.e. what the level itself costs) against the matching bound; restore speed-ups.
    ``tag`` is added to every name (a second run of the part in another setting)."""
    out: Figures = {}
    for level, per_size in part["save_gb_per_s"].items():
        size, value = _largest(per_size)
        inc = part.get("increment_s", {}).get(level, {}).get(size)
        if level != "local" and inc:
            value = float(size) * 2**20 / 1e9 / inc
        to, goal = LEVEL_BOUND.get(level, (None, None))
        out[f"save[{level}, {size} MiB{tag}]"] = _fig(value, "GB/s", to, bound.get(to or ""), goal)
    for level, per_size in part.get("save_vs_memcpy", {}).items():
        size, vs = _largest(per_size)
        value = part["save_gb_per_s"][level][size]
        out[f"save vs memcpy[{level}, {size} MiB{tag}]"] = _fig(
            value, "GB/s", "memcpy (same rounds, median)", value / vs["median"],
            SAVE_MEMCPY_GOAL.get(level))
        rounds = part.get("save_round_s", {}).get(level, {}).get(size)
        if rounds:
            mid = sorted(rounds)[len(rounds) // 2]
            out[f"save spread[{level}, {size} MiB{tag}]"] = _fig(
                max(abs(r / mid - 1) for r in rounds), "of the median", "1", 1.0,
                SAVE_SPREAD_GOAL, "<=")
    for level, per_size in part.get("save_vs_bound", {}).items():
        size, vs = _largest(per_size)
        if level in SAVE_BOUND_GOAL:
            value = part["save_gb_per_s"][level][size]
            out[f"save vs min(p2p, memcpy)[{level}, {size} MiB{tag}]"] = _fig(
                value, "GB/s", "min(p2p, memcpy) (same rounds, median)",
                value / vs["median"], SAVE_BOUND_GOAL[level])
            serial = part.get("save_vs_serial", {}).get(level, {}).get(size)
            if serial:          # the floor when copy and transfer cannot overlap
                out[f"save vs memcpy+p2p[{level}, {size} MiB{tag}]"] = _fig(
                    value, "GB/s", "memcpy then p2p (same rounds, median)",
                    value / serial["median"])
    for level, per_size in part["restore_gb_per_s"].items():
        size, value = _largest(per_size)
        to, goal = RESTORE_BOUND.get(level, (None, None))
        base = bound.get(to or "")
        same_run = part.get("restore_vs_memcpy", {}).get(level, {}).get(size)
        if to and same_run:         # memcpy timed on the same ranks, alternating rounds
            to, base = "memcpy (same rounds, median)", value / same_run["median"]
        out[f"restore[{level}, {size} MiB{tag}]"] = _fig(value, "GB/s", to, base, goal)
    restore = part["restore_s"]
    if "pfs" in restore:
        size, pfs = _largest(restore["pfs"])
        for level in ("local", "partner"):
            if level in restore and size in restore[level]:
                out[f"restore speed-up[{level} vs pfs, {size} MiB{tag}]"] = _fig(
                    pfs / restore[level][size], "x", "1", 1.0, 10.0)
    return out


def redundancy(part: dict[str, Any]) -> Figures:
    """RS encode against XOR encode of the same set, alternating rounds (median of per-round
    ratios): with one parity block (the goal's figure: same tolerance, same bytes moved) and
    with the configured parity blocks (no goal: it moves more bytes)."""
    out: Figures = {}
    gbs, parity = part["gb_per_s"], part.get("parity_blocks", {})
    for name, key, goal in (("rs1", "rs_vs_xor_same_parity", 0.7), ("rs", "rs_vs_xor", None)):
        vs = part.get(key)
        if name == "rs" and parity.get("rs") == parity.get("rs1"):
            continue                    # a set too small for 2 parity blocks: rs1 says it
        if isinstance(vs, dict) and name in gbs:
            value = gbs[name]
            out[f"rs encode[{parity.get(name, '?')} parity, {_mib(part)} MiB]"] = _fig(
                value, "GB/s", "xor encode (same rounds, median)", value / vs["median"], goal)
    return out


def _mib(part: dict[str, Any]) -> int:
    return int(part.get("shard_bytes_per_rank", 0)) >> 20


def _gib(part: dict[str, Any]) -> str:
    """State per rank of a hdf5_vs_dcp part, e.g. ``1 GiB``."""
    ranks = part.get("machine", {}).get("ranks") or 1
    return f"{part.get('state_bytes_all_ranks', 0) / ranks / 2**30:.3g} GiB"


def peers(part: dict[str, Any], tag: str = "") -> Figures:
    """Throughput of every method (goal pairs against their peer), then the PFS level's
    goals (``pfs[...]``: ratios of seconds as ``bench/hdf5_vs_dcp.py`` defines them)."""
    gbs, out = part["gb_per_s"], {}
    pairs = part.get("goal", {}).get("pairs", {})
    for name, value in gbs.items():
        peer = pairs.get(name)
        out[f"peer[{name}{tag}]"] = _fig(value, "GB/s", peer, gbs.get(peer or ""),
                                         1.5 if peer else None)
    for name, g in part.get("pfs_goals", {}).items():
        num, den = (g["of"] + [None, None])[:2]
        out[f"pfs[{name}{tag}]"] = _fig(g["ratio"], "x" if den else "MiB",
                                        f"{num} / {den}" if den else "1", 1.0, g["goal"],
                                        g["op"])
    return out


def protocol(part: dict[str, Any]) -> Figures:
    out: Figures = {}
    for levels_name, per_n in part["save_s"].items():
        ns = sorted(per_n, key=int)
        for n in ns:
            out[f"protocol[{levels_name}, n={n}]"] = _fig(
                per_n[n] * 1e3, "ms per save", f"n={ns[0]}", per_n[ns[0]] * 1e3)
    for levels_name, per_n in part.get("collectives_per_save", {}).items():
        ns = sorted(per_n, key=int)
        for key, unit in (("rounds", "collectives per save"), ("bytes", "bytes per save")):
            first, last = per_n[ns[0]][key], per_n[ns[-1]][key]
            out[f"protocol {key}[{levels_name}, n={ns[-1]}]"] = _fig(
                last, unit, f"n={ns[0]}", first or None)
    return out


def recovery(part: dict[str, Any]) -> Figures:
    out: Figures = {}
    scen = part["scenarios"]
    for name, phases in scen.items():
        for phase, value in phases.items():
            if not phase.endswith("_s") or isinstance(value, bool) \
                    or not isinstance(value, (int, float)):
                continue
            ratio_to = phase in ("total_s", "restore_s")
            out[f"recovery[{name}, {phase}]"] = _fig(
                value, "s", "local_partner" if ratio_to else None,
                scen.get("local_partner", {}).get(phase) if ratio_to else None)
    return out


#: iteration-time overhead (p50, against no checkpoints) the HP example may pay
HP_OVERHEAD_GOAL = {"local+partner": 0.05, "local+partner every 5th": 0.01}


def overlap(part: dict[str, Any]) -> Figures:
    """The HP example: iteration p50 per configuration against no checkpoints, the
    blocked time per step, and (when measured in rounds) the p50 / p99 overheads."""
    out: Figures = {}
    for name, r in part["results"].items():
        out[f"hp iteration[{name}]"] = _fig(r["iter_s"] * 1e3, "ms", "none",
                                            r["iter_s"] / r["ratio_to_none"] * 1e3)
        goal = 0.01 if name == "local+partner" else None
        out[f"hp blocked[{name}]"] = _fig(r["blocked_s_per_step"] * 1e3, "ms per step",
                                          "iteration", r["iter_s"] * 1e3, goal, "<=")
        for q in ("p50", "p99") if name != "none" and "overhead_p50" in r else ():
            out[f"hp overhead {q}[{name}]"] = _fig(
                r[f"overhead_{q}"]["median"], "of none", "1", 1.0,
                HP_OVERHEAD_GOAL.get(name) if q == "p50" else None, "<=")
    return out


def memory(part: dict[str, Any]) -> Figures:
    """Per rank, beyond its state: peak private memory (the goal's figure, synchronous
    saves), private memory + node-local files (its footprint), and peak RSS (which also
    counts the mapped slot pages, the same pages as the node-local files); each as a
    fraction of the state."""
    out: Figures = {}
    state = float(part["state_mib"])
    for mode, f in part["per_rank_max"].items():
        tag = f"local:1 {mode}, {part['state_mib']} MiB"
        goal = PRIVATE_MEMORY_GOAL if mode == "sync" else None
        out[f"memory private[{tag}]"] = _fig(f["peak_private_mib"], "MiB", "state", state,
                                              goal, "<=")
        out[f"memory footprint[{tag}]"] = _fig(f["peak_private_mib"] + f["node_local_mib"],
                                                "MiB", "state", state)
        out[f"memory rss[{tag}]"] = _fig(f["peak_rss_mib"], "MiB", "state", state)
    return out


def derive(parts: dict[str, dict[str, Any]]) -> Figures:
    """Every figure the parts allow (parts may be missing)."""
    bound = parts.get("bounds", {}).get("gb_per_s", {})
    out: Figures = {}
    steps = (("bounds", lambda p: bounds(p)), ("levels", lambda p: levels(p, bound)),
             ("levels_2ranks", lambda p: levels(p, bound, f", {p['ranks']} ranks")),
             ("redundancy", redundancy), ("hdf5_vs_dcp", peers),
             ("hdf5_vs_dcp_1g", lambda p: peers(p, f", {_gib(p)} per rank")),
             ("protocol", protocol),
             ("recovery", recovery), ("hp_overlap", overlap), ("memory", memory))
    for name, fn in steps:
        if name in parts:
            out.update(fn(parts[name]))
    return out


def lines(figures: Figures) -> list[str]:
    """``name: value unit (ratio to X = r; goal >= g: met)`` per figure."""
    out = []
    for name, f in figures.items():
        text = f"{name}: {f['value']:.4g} {f['unit']}"
        if f["ratio"] is not None:
            text += f" (ratio to {f['to']} = {f['ratio']:.3g}"
            if f["goal"] is not None:
                text += f"; goal {f['op']} {f['goal']:g}: {'met' if f['met'] else 'MISSED'}"
            text += ")"
        out.append(text)
    return out


def markdown(figures: Figures) -> str:
    """The performance table (docs/performance.md): one row per figure that has a ratio (pure)."""
    rows = ["| figure | value | ratio | goal |", "|---|---|---|---|"]
    for name, f in figures.items():
        if f["ratio"] is None:
            continue
        goal = "" if f["goal"] is None else \
            f"{f['op']} {f['goal']:g}: {'met' if f['met'] else '**missed**'}"
        rows.append(f"| `{name}` | {f['value']:.4g} {f['unit']} | "
                    f"{f['ratio']:.3g} × {f['to']} | {goal} |")
    return "\n".join(rows) + "\n"


def costs_markdown(levels_part: dict[str, Any]) -> str:
    """The table (docs/performance.md) of what each operation costs a rank at the largest size of the
    levels part: passes over the state's bytes by kind (counted by ftkit's code paths),
    CPU seconds, peak extra memory (pure; empty when the part has no costs)."""
    rows = ["| operation | level | MiB/rank | passes | of which | CPU s | peak extra MiB |",
            "|---|---|---|---|---|---|---|"]
    for op in ("save", "restore"):
        for level, per_size in levels_part.get(f"{op}_costs", {}).items():
            size, cost = _largest(per_size)
            kinds = ", ".join(f"{k} {v:.2g}" for k, v in cost["passes"].items()
                              if k != "total" and v)
            rows.append(f"| {op} | {level} | {size} | {cost['passes']['total']:.3g} | {kinds} "
                        f"| {cost['cpu_s']:.3g} | {cost['peak_extra_mib']:.1f} |")
    return "\n".join(rows) + "\n" if len(rows) > 2 else ""

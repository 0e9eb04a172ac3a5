"""``ftkit advise``: survival odds of each scheme and checkpoint intervals (the model is
:mod:`ftkit.advise`)."""
from __future__ import annotations

import argparse

from ftkit.cli.args import error, positive_float, positive_int


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``ftkit advise --nodes N --mtbf-hours H [...]``."""
    adv = sub.add_parser(
        "advise", help="survival odds of each scheme and checkpoint intervals",
        description="Exact probability that each scheme (local, partner, xor, rs, pfs) survives "
                    "k simultaneous node failures, from ftkit's real placement, and the "
                    "Young/Daly checkpoint interval of every level with a known cost.")
    adv.add_argument("--nodes", type=positive_int, required=True, metavar="N")
    adv.add_argument("--mtbf-hours", type=positive_float, required=True, metavar="H",
                     help="mean time between failures of ONE node")
    adv.add_argument("--ranks-per-node", type=positive_int, default=1, metavar="K")
    adv.add_argument("--xor-set", type=positive_int, default=4)
    adv.add_argument("--rs-set", type=positive_int, default=4)
    adv.add_argument("--rs-parity", type=positive_int, default=2)
    adv.add_argument("--max-failures", type=positive_int, default=3, metavar="K")
    adv.add_argument("--measured", metavar="BENCH.json",
                     help="bench JSON with a 'level_costs_s' object {level: seconds}")
    adv.add_argument("--cost", action="append", default=[], metavar="LEVEL=SECONDS",
                     help="checkpoint cost of a level (overrides --measured)")
    adv.add_argument("--json", action="store_true", help="machine-readable output")
    adv.set_defaults(func=_cmd_advise)


def _costs(args: argparse.Namespace) -> tuple[dict[str, float], dict[str, str]]:
    """Each level's checkpoint cost and where it came from (``--measured`` or ``--cost``)."""
    import json
    costs: dict[str, float] = {}
    sources: dict[str, str] = {}
    if args.measured:
        with open(args.measured) as fh:
            for level, value in json.load(fh)["level_costs_s"].items():
                costs[level], sources[level] = float(value), f"measured: {args.measured}"
    for item in args.cost:
        level, _, value = item.partition("=")
        costs[level], sources[level] = float(value), "--cost"
    return costs, sources


def _cmd_advise(args: argparse.Namespace) -> int:
    import json

    from ftkit.advise import advise, render
    try:
        costs, sources = _costs(args)
        report = advise(args.nodes, args.mtbf_hours, ranks_per_node=args.ranks_per_node,
                        xor_set=args.xor_set, rs_set=args.rs_set, rs_parity=args.rs_parity,
                        max_failures=args.max_failures, costs=costs, cost_sources=sources)
    except (OSError, KeyError, ValueError) as exc:
        return error("advise", exc)
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0

"""Summarise the demo: recovery events, the loss curves of both runs, the digest check.

    python scripts/demo_report.py REFERENCE.out FAULTY.out EVENTS.jsonl

Exits 1 when the recovered run's final digest differs from the failure-free one."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

EVENT_FIELDS = ("event", "attempt", "step", "rc", "reason", "nodes", "ranks", "from_partner",
                "seconds")


def records(path: str) -> list[dict[str, Any]]:
    out = []
    for line in Path(path).read_text().splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def curve(recs: list[dict[str, Any]]) -> list[tuple[int, int, float]]:
    """(attempt, step, loss) in print order; the attempt comes from the start lines."""
    attempt, out = 0, []
    for r in recs:
        if r.get("event") == "start":
            attempt = int(r.get("attempt", 0))
        elif r.get("event") == "step":
            out.append((attempt, int(r["step"]), float(r["loss"])))
    return out


def main() -> int:
    ref_out, faulty_out, events_path = sys.argv[1:4]
    print("== events.jsonl of the faulty run (restore / relaunch decisions)")
    for e in records(events_path):
        if e.get("event") in ("restore", "restore-skip", "rebuild", "attempt-end", "relaunch",
                              "done"):
            print("  ", {k: e[k] for k in EVENT_FIELDS if k in e})
    ref = {step: loss for _, step, loss in curve(records(ref_out))}
    print("\n== loss curve: failure-free vs faulty run (a second row for a step = replayed)")
    print("   step  attempt  reference   faulty run")
    for attempt, step, loss in curve(records(faulty_out)):
        same = "=" if ref.get(step) == loss else "DIFFERENT"
        print(f"   {step:4d}  {attempt:7d}  {ref.get(step, float('nan')):9.6f}  {loss:9.6f} {same}")
    digests = []
    for path in (ref_out, faulty_out):
        done = [r for r in records(path) if r.get("event") == "done"]
        digests.append(done[-1]["digest"] if done else "")
    print(f"\nreference digest: {digests[0]}\nrecovered digest: {digests[1]}")
    if digests[0] and digests[0] == digests[1]:
        print("OK: the recovered run is bit-identical to the failure-free run")
        return 0
    print("MISMATCH: the recovered run differs from the failure-free run", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())

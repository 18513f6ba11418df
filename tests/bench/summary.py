#!/usr/bin/env python3
"""Gathers the figures of a `make bench` run and says what moved.

Every benchmark writes "key value" lines to target/bench/<name>.summary (ratios to a peer
measured in the same run, CPU per event, p99s). This collects them into
target/bench/summary.json and compares each figure with the committed previous summary
(tests/bench/summary.json): anything that moved by more than 10 % is printed, marked as
better or worse by the direction the figure should go.

  tests/bench/summary.py            # gather, write summary.json, compare
  tests/bench/summary.py --accept   # ...and make this run the committed reference

Not a test: these machines are noisy (single runs swing by ±10-15 %), so a move is
something to look at, not a failure.
"""

import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "target", "bench")
REFERENCE = os.path.join(ROOT, "tests", "bench", "summary.json")
THRESHOLD = 0.10


def lower_is_better(key):
    return any(k in key for k in ("cpu_us", "p99", "_ms", "rss", "seconds", "commands_per", "steal"))


def gather():
    figures = {}
    for path in sorted(glob.glob(os.path.join(OUT, "*.summary"))):
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) != 2:
                    continue
                try:
                    figures[parts[0]] = float(parts[1])
                except ValueError:
                    continue
    return figures


def main():
    figures = gather()
    if not figures:
        sys.exit(f"no figures in {OUT}/*.summary: run make bench (or one bench-* target) first")
    os.makedirs(OUT, exist_ok=True)
    current = os.path.join(OUT, "summary.json")
    with open(current, "w") as f:
        json.dump(figures, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"{len(figures)} figures in {current}")
    steal = max((v for k, v in figures.items() if k.endswith("max_steal_pct")), default=0)
    if steal > 5:
        print(f"  the host took up to {steal:g} % of the CPU during the load runs: moves are likely noise")
    previous = {}
    if os.path.exists(REFERENCE):
        with open(REFERENCE) as f:
            previous = json.load(f)
    moved = 0
    for key in sorted(figures):
        new, old = figures[key], previous.get(key)
        if old is None:
            continue
        if old == 0:
            change = 0 if new == 0 else float("inf")
        else:
            change = (new - old) / abs(old)
        if abs(change) > THRESHOLD:
            better = (change < 0) == lower_is_better(key)
            moved += 1
            print(f"  {key:<48} {old:>10g} -> {new:<10g} {change * 100:+6.1f} %  {'better' if better else 'WORSE'}")
    missing = sorted(set(previous) - set(figures))
    print(f"{moved} figures moved by more than {THRESHOLD * 100:.0f} % against {os.path.relpath(REFERENCE, ROOT)}"
          + (f"; not measured in this run: {len(missing)}" if missing else ""))
    if "--accept" in sys.argv[1:]:
        merged = dict(previous)
        merged.update(figures)
        with open(REFERENCE, "w") as f:
            json.dump(merged, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"{os.path.relpath(REFERENCE, ROOT)} now holds this run's figures")


if __name__ == "__main__":
    main()

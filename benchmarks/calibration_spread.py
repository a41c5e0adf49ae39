"""How steady the adaptive controller's step-cost table is: the table timed afresh --tables times for each
(repeats, budget) setting, alternated, and the spread of the ratios the controller decides by.

    python benchmarks/calibration_spread.py [--slots 1] [--max-draft 5] [--tables 12] \
        [--settings 5:0.15 11:0.5]

Per setting: each ratio c(T) / c(1 token per slot) as median [min, max] over the tables, and the time one
table took to time. The table is kept on disk (cost_cache), so a job times it once per machine and week.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument("--max-draft", type=int, default=5)
    ap.add_argument("--tables", type=int, default=12)
    ap.add_argument("--settings", nargs="+", default=["5:0.15", "11:0.5"], help="REPEATS:BUDGET_SECONDS")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ["SPECGEN_COST_CACHE"] = "0"
    from specgen import load_model
    from specgen.engine import runner

    model = load_model(None, threads=args.threads).model
    cache = model.new_cache(args.slots, 64)
    settings = [(int(r), float(b)) for r, b in (s.split(":") for s in args.settings)]
    ratios: dict = {s: [] for s in settings}
    spent: dict = {s: [] for s in settings}
    tokens = None
    for _ in range(args.tables):
        for s in settings:
            runner.CALIBRATION_REPEATS, runner.CALIBRATION_BUDGET = s
            model.calibrations.clear()
            start = time.perf_counter()
            runner.calibrate(model, cache, args.max_draft)
            spent[s].append(time.perf_counter() - start)
            tokens, seconds = model.calibrations[(args.slots, args.max_draft)]
            one = seconds[list(tokens).index(args.slots)]  # 1 token per slot
            ratios[s].append(seconds / one)
    print(f"slots {args.slots}, max draft {args.max_draft}, {args.tables} tables per setting; "
          f"tokens {[int(t) for t in tokens]}")
    for s in settings:
        r = np.array(ratios[s])
        cols = "  ".join(f"c({t})/c({args.slots}) {np.median(r[:, j]):.2f} "
                         f"[{r[:, j].min():.2f}, {r[:, j].max():.2f}]"
                         for j, t in enumerate(tokens) if t != args.slots)
        print(f"repeats {s[0]:>2}, budget {s[1]:.2f} s: {cols}  table {1e3 * np.median(spent[s]):.0f} ms")


if __name__ == "__main__":
    sys.exit(main())

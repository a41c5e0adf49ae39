"""A verify step's cost against a 1-token step's, at the start of a sequence and deep into one.

    python benchmarks/context_cost.py [--positions 0 256 1024 2048] [--tokens 1 2 6] [--slots 1]

The adaptive controller's step-cost table is timed at position 0. This prefills each position's context
(random tokens) and times the forward of T tokens per slot starting there, greedy, median of --repeats runs
taken round robin; it prints ms per step and each T's cost over the 1-token step's at that position.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--positions", type=int, nargs="+", default=[0, 256, 1024, 2048])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 6])
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from specgen import load_model
    from specgen.engine.types import build_forward_batch

    model = load_model(None, threads=args.threads).model
    slots = np.arange(args.slots, dtype=np.int64)
    rng = np.random.default_rng(0)
    cache = model.new_cache(args.slots, max(args.positions) + max(args.tokens) + 1)
    if max(args.positions):
        n = max(args.positions)
        prefill = build_forward_batch(slots, np.zeros(args.slots, np.int64), np.full(args.slots, n),
                                      rng.integers(0, 1000, args.slots * n), np.zeros(args.slots, bool))
        model.forward_greedy(prefill, cache, logits=False)
    print(f"slots {args.slots}; ms per step (median of {args.repeats}); cost over the 1-token step")
    print(f"{'position':>9}" + "".join(f"{f'{t} tok ms':>11}" for t in args.tokens)
          + "".join(f"{f'{t}/1':>7}" for t in args.tokens[1:]))
    for pos in args.positions:
        batches = [build_forward_batch(slots, np.full(args.slots, pos), np.full(args.slots, t),
                                       rng.integers(0, 1000, args.slots * t), np.ones(args.slots, bool))
                   for t in args.tokens]
        times: list[list[float]] = [[] for _ in batches]
        for b in batches:
            model.forward_greedy(b, cache, logits=False)
        for _ in range(args.repeats):
            for b, ts in zip(batches, times):
                start = time.perf_counter()
                model.forward_greedy(b, cache, logits=False)
                ts.append(time.perf_counter() - start)
        ms = [1e3 * float(np.median(ts)) for ts in times]
        print(f"{pos:>9}" + "".join(f"{m:>11.2f}" for m in ms)
              + "".join(f"{m / ms[0]:>6.2f}x" for m in ms[1:]), flush=True)


if __name__ == "__main__":
    sys.exit(main())

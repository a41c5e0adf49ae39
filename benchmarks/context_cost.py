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


def step_costs(model, positions: list[int], tokens: list[int], slots: int = 1,
               repeats: int = 30) -> dict[int, dict[int, float]]:
    """Seconds of a greedy forward feeding T tokens to each of `slots` slots that start at each position (random
    tokens; one prefill up to the deepest position first): {position: {T: median of `repeats` timings, taken
    round robin over the T}}. `model` is the engine's Model."""
    from specgen.engine.types import build_forward_batch

    s = np.arange(slots, dtype=np.int64)
    rng = np.random.default_rng(0)
    cache = model.new_cache(slots, max(positions) + max(tokens) + 1)
    if max(positions):
        n = max(positions)
        prefill = build_forward_batch(s, np.zeros(slots, np.int64), np.full(slots, n),
                                      rng.integers(0, 1000, slots * n), np.zeros(slots, bool))
        model.forward_greedy(prefill, cache, logits=False)
    out = {}
    for pos in positions:
        batches = {t: build_forward_batch(s, np.full(slots, pos), np.full(slots, t),
                                          rng.integers(0, 1000, slots * t), np.ones(slots, bool)) for t in tokens}
        times: dict[int, list[float]] = {t: [] for t in tokens}
        for b in batches.values():
            model.forward_greedy(b, cache, logits=False)
        for _ in range(repeats):
            for t, b in batches.items():
                start = time.perf_counter()
                model.forward_greedy(b, cache, logits=False)
                times[t].append(time.perf_counter() - start)
        out[pos] = {t: float(np.median(v)) for t, v in times.items()}
    return out


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

    model = load_model(None, threads=args.threads).model
    print(f"slots {args.slots}; ms per step (median of {args.repeats}); cost over the 1-token step")
    print(f"{'position':>9}" + "".join(f"{f'{t} tok ms':>11}" for t in args.tokens)
          + "".join(f"{f'{t}/1':>7}" for t in args.tokens[1:]))
    costs = step_costs(model, args.positions, args.tokens, args.slots, args.repeats)
    for pos in args.positions:
        ms = [1e3 * costs[pos][t] for t in args.tokens]
        print(f"{pos:>9}" + "".join(f"{m:>11.2f}" for m in ms)
              + "".join(f"{m / ms[0]:>6.2f}x" for m in ms[1:]), flush=True)


if __name__ == "__main__":
    sys.exit(main())

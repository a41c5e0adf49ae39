"""Decode steps of many slots with an environment switch off and on, alternated step by step in one process:

    python benchmarks/decode_switch_ab.py [--switch SPECGEN_WIDE_LINEAR] [--slots 32] [--position 64]
                                          [--tokens 1 2] [--repeats 20]

Prefills --slots slots with --position random tokens each, then times greedy forwards of T tokens per slot
(a plain step for T = 1, a verify step of T - 1 drafts per slot), the switch at 0 and unset in turn; medians.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--switch", default="SPECGEN_WIDE_LINEAR")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--position", type=int, default=64)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import numpy as np
    from spec_bench import load_default

    from specgen.engine.types import build_forward_batch

    m = load_default(args.threads).model
    rng = np.random.default_rng(0)
    s, p = args.slots, args.position
    cache = m.new_cache(s, p + max(args.tokens) + 8)
    m.forward(build_forward_batch(np.arange(s), np.zeros(s, np.int64), np.full(s, p),
                                  rng.integers(100, 40000, s * p), np.zeros(s, bool)), cache)
    for t in args.tokens:
        batch = build_forward_batch(np.arange(s), np.full(s, p), np.full(s, t), rng.integers(100, 40000, s * t),
                                    np.ones(s, bool))
        times = {"0": [], "1": []}
        for _ in range(args.repeats):
            for value in ("0", "1"):
                if value == "0":
                    os.environ[args.switch] = "0"
                else:
                    os.environ.pop(args.switch, None)
                start = time.perf_counter()
                m.forward_greedy(batch, cache, logits=False)
                times[value].append(time.perf_counter() - start)
        off, on = statistics.median(times["0"]), statistics.median(times["1"])
        print(f"{s} slots x {t} tokens at position {p}: {args.switch}=0 {off * 1e3:.1f} ms, on {on * 1e3:.1f} ms, "
              f"{off / on:.2f}x", flush=True)


if __name__ == "__main__":
    main()

"""What a step-cost table with the wrong shape costs a job, with and without the cost model's point-by-point
correction (specgen/engine/adaptive.py, CostModel).

    python benchmarks/stale_table.py [--sets summarization code_rewrite] [--per-category 4] [--mbpp 8] \
        [--repeats 3] [--distort 1.21 1.13]

A fresh table is timed once (runner.calibrate, the disk cache bypassed). The stale table is that one with its
2-token and (k+1)-token points multiplied by --distort (defaults: the table a test run left on disk on
2026-12-03 against the steps' measured costs: 1.39 / 1.15 and 2.28 / 2.01). Each repeat runs, one after the
other: none; ngram with the fresh table and with the stale one, each corrected per point (the engine) and with
the global ratio alone (CostModel.POINT_PRIOR set huge: every point follows the global ratio, the earlier
model). The table is handed to each job through the model's calibrations, which the engine reads first.
Printed per set and variant: median tok/s, the median per-repeat speedup over none, tokens per step, and
whether the tokens equal none's.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", default=["summarization", "code_rewrite"])
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--mbpp", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--distort", type=float, nargs=2, default=[1.39 / 1.15, 2.28 / 2.01])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ["SPECGEN_COST_CACHE"] = "0"  # the fresh table is timed here, not read from disk
    from spec_bench import load_sets, run_method

    from specgen import SamplingParams, SpecConfig, load_model
    from specgen.engine import adaptive, runner

    model = load_model(None, threads=args.threads)
    sp = SamplingParams(max_tokens=args.max_tokens)
    spec = SpecConfig(method="ngram", num_speculative_tokens=args.k)
    m = model.model
    cache = m.new_cache(1, 64)
    runner.calibrate(m, cache, args.k, 1)
    key = (1, args.k)
    tokens, fresh = m.calibrations[key]
    stale = fresh.copy()
    stale[list(tokens).index(2)] *= args.distort[0]
    stale[list(tokens).index(args.k + 1)] *= args.distort[1]
    stale = np.maximum.accumulate(stale)
    print("fresh table: " + ", ".join(f"c({t}) {s * 1e3:.2f} ms" for t, s in zip(tokens, fresh))
          + f"; c(2)/c(1) {fresh[1] / fresh[0]:.2f}, c({args.k + 1})/c(1) {fresh[-1] / fresh[0]:.2f}")
    print(f"stale table: c(2)/c(1) {stale[1] / stale[0]:.2f}, c({args.k + 1})/c(1) {stale[-1] / stale[0]:.2f}")
    variants = {"fresh, per point": (fresh, adaptive.CostModel.POINT_PRIOR),
                "fresh, global only": (fresh, 1e12),
                "stale, per point": (stale, adaptive.CostModel.POINT_PRIOR),
                "stale, global only": (stale, 1e12)}
    prior0 = adaptive.CostModel.POINT_PRIOR
    sets = load_sets(args.per_category, args.mbpp)
    for name in args.sets:
        prompts = sets[name]
        runs: dict[str, list] = {"none": [], **{v: [] for v in variants}}
        for _ in range(args.repeats):
            runs["none"].append(run_method(model, prompts, sp, 1, SpecConfig(method="none")))
            for v, (table, prior) in variants.items():
                m.calibrations[key] = (tokens, table)
                adaptive.CostModel.POINT_PRIOR = prior
                try:
                    runs[v].append(run_method(model, prompts, sp, 1, spec))
                finally:
                    adaptive.CostModel.POINT_PRIOR = prior0
        base = runs["none"]
        print(f"\n{name} ({len(prompts)} prompts, batch 1, k = {args.k}, {args.repeats} alternated repeats)")
        print(f"{'variant':<22}{'tok/s':>8}{'speedup (runs)':>30}{'tok/step':>10}{'same tokens':>13}")
        for v, rs in runs.items():
            ratios = [r[1]["tok_s"] / b[1]["tok_s"] for r, b in zip(rs, base)]
            same = all(o.token_ids == p.token_ids for r in rs for o, p in zip(r[0], base[0][0]))
            per_step = np.median([r[1]["mean_accepted_length"] for r in rs])
            runs_txt = ", ".join(f"{x:.2f}" for x in ratios)
            print(f"{v:<22}{np.median([r[1]['tok_s'] for r in rs]):>8.1f}"
                  f"{f'{np.median(ratios):.2f}x ({runs_txt})':>30}{per_step:>10.2f}{'yes' if same else 'NO':>13}",
                  flush=True)


if __name__ == "__main__":
    main()

"""The most that n-gram speculation could gain on this machine: an oracle bound, measured in one run.

    python benchmarks/target_bound.py [--sets summarization rag code_rewrite] [--per-category 6] [--mbpp 12]
        [--max-tokens 128] [--k 5] [--batch-32]

Per set at batch 1, from the plain (greedy) run:
- p: the share of the plain job's wall time that is prefill (the same job with max_tokens = 1), which
  speculation cannot shorten;
- the replay: the shipped n-gram rule (n 3..1, the job's pool) teacher-forced on the plain outputs, k drafts;
  per step, how many tokens it would emit if every draft were verified (1 + the drafts that match);
- c(T): a forward of T tokens at the set's median prompt length (median of alternated forwards), T = 1 .. k + 1;
- the oracle: a drafter that verifies exactly the drafts that will be accepted, so each step of the replay costs
  c(1 + accepted) and nothing is wasted on rejected drafts. No policy choosing k per step from these drafts does
  better while c grows with T (each step emits 1 + accepted tokens; verifying fewer of them only adds steps). Its
  decoding speedup is (tokens x c(1)) / sum over steps of c(1 + accepted), and the whole job's
  1 / (p + (1 - p) / that). "free" is the same with verification free (c constant): tokens per step.
Host time per step (drafting, verification bookkeeping) is not charged, so the real ceiling is lower still.

With --batch-32: code rewriting at 32 slots, where the oracle's steps feed 32 x (tokens per step) rows: the bound
is (tokens per step) x c(32) / c(32 x tokens per step), c timed at 32, 64 and 96 rows.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from context_cost import step_costs
from spec_bench import load_sets, replay_steps, run_method


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", default=["summarization", "rag", "code_rewrite"])
    ap.add_argument("--per-category", type=int, default=6)
    ap.add_argument("--mbpp", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--batch-32", action="store_true", help="also bound code rewriting at 32 slots")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from dataclasses import replace

    from specgen import SamplingParams, SpecConfig, load_model

    model = load_model(None, threads=args.threads)
    sets = load_sets(args.per_category, args.mbpp)
    sp, plain, pool = SamplingParams(max_tokens=args.max_tokens), SpecConfig(), SpecConfig().ngram_pool
    print(f"{'set':<15}{'p (prefill)':>12}{'tok/step':>9}{'c(k+1)/c(1)':>12}{'free':>7}{'oracle dec':>11}"
          f"{'oracle job':>11}{'free job':>9}", flush=True)
    for name in args.sets:
        prompts = [list(model.tokenizer.encode_chat(m)) for m in sets[name]]
        run_method(model, prompts[:1], replace(sp, max_tokens=4), 1, plain)  # warm
        outs, r = run_method(model, prompts, sp, 1, plain)
        _, pre = run_method(model, prompts, replace(sp, max_tokens=1), 1, plain)
        p = pre["wall_s"] / r["wall_s"]
        steps = replay_steps(prompts, [o.token_ids for o in outs], args.k, 1, 3, pool)
        pos = int(np.median([len(x) for x in prompts]))
        c = step_costs(model.model, [pos], list(range(1, args.k + 2)), repeats=15)[pos]
        tokens = sum(steps)
        free = tokens / len(steps)
        dec = tokens * c[1] / sum(c[e] for e in steps)  # each replayed step costs c(1 + accepted) = c(emitted)
        print(f"{name:<15}{p:>12.2f}{free:>9.2f}{c[args.k + 1] / c[1]:>11.2f}x{free:>6.2f}x{dec:>10.2f}x"
              f"{1 / (p + (1 - p) / dec):>10.2f}x{1 / (p + (1 - p) / free):>8.2f}x", flush=True)
    if args.batch_32:
        prompts = [list(model.tokenizer.encode_chat(m)) for m in sets["code_rewrite"]]
        outs, _ = run_method(model, prompts, sp, 32, plain)
        steps = replay_steps(prompts, [o.token_ids for o in outs], args.k, 1, 3, pool)
        free = sum(steps) / len(steps)
        pos = int(np.median([len(x) for x in prompts])) + args.max_tokens // 2
        c = step_costs(model.model, [pos], [1, 2, 3], slots=32, repeats=7)[pos]
        cost_at = float(np.interp(free, [1, 2, 3], [c[1], c[2], c[3]]))  # c(32 x tokens per step)
        print(f"code_rewrite at 32 slots: {free:.2f} tokens per step for free; c(64)/c(32) {c[2] / c[1]:.2f}x, "
              f"c(96)/c(32) {c[3] / c[1]:.2f}x; oracle decoding bound {free * c[1] / cost_at:.2f}x", flush=True)


if __name__ == "__main__":
    main()

"""The adaptive controller's cost model against the steps it prices, on the default model:

    python benchmarks/cost_trace.py [--set code_rewrite] [--batch-size 32] [--matmul float32|int8] [--every 6]

Runs one n-gram job (k = 5, greedy, 128 tokens) of --batch-size prompts and prints the start-up cost table,
then every --every-th step: tokens fed, measured ms, the table's own figure, the cost model's prediction
before the step (the table corrected point by point by the steps so far) and the global ratio after it. A
ratio far from 1, or drifting as slots finish, means the table misprices those steps; the model's column
should follow the measured one.
"""
from __future__ import annotations

import argparse
import os


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", default="code_rewrite")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--matmul", default="float32")
    ap.add_argument("--every", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from spec_bench import load_sets

    from specgen import EngineConfig, SamplingParams, SpecConfig, generate, load_model
    from specgen.engine import adaptive

    lm = load_model(None, threads=args.threads, matmul=args.matmul)
    prompts = load_sets(args.batch_size, args.batch_size)[args.set][: args.batch_size]
    trace = []
    observe = adaptive.CostModel.observe

    def traced(self, num_tokens, seconds):
        trace.append((num_tokens, seconds, self.table_at(num_tokens), self.at(num_tokens)))
        observe(self, num_tokens, seconds)
        trace[-1] += (self.scale,)

    adaptive.CostModel.observe = traced
    generate(prompts, model=lm, sampling=SamplingParams(max_tokens=128),
             speculative=SpecConfig(method="ngram", num_speculative_tokens=5),
             engine=EngineConfig(batch_size=args.batch_size, matmul=args.matmul))
    for (slots, k), (tokens, seconds) in lm.model.calibrations.items():
        print(f"table ({slots} slots, k {k}): " + ", ".join(f"{t} tokens {s * 1e3:.1f} ms" for t, s in zip(tokens, seconds)))
    print(f"{'step':>5}{'tokens':>8}{'measured ms':>13}{'table ms':>10}{'model ms':>10}{'scale':>7}")
    for i, (tokens, seconds, predicted, model_ms, scale) in enumerate(trace):
        if i % args.every == 0 or i == len(trace) - 1:
            print(f"{i:>5}{tokens:>8}{seconds * 1e3:>13.1f}{predicted * 1e3:>10.1f}{model_ms * 1e3:>10.1f}"
                  f"{scale:>7.2f}")


if __name__ == "__main__":
    main()

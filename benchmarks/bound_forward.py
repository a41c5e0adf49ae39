"""specgen_forward_bound (weights and caches handed to the kernels once, by handle) against specgen_forward
(every tensor passed on every call), side by side in one run:

    python benchmarks/bound_forward.py [--jobs writing:1 code_rewrite:1 summarization:1 code_rewrite:32]

1. The call alone: both ops on an empty batch (0 tokens), alternated, µs per call.
2. One forward of B slots feeding T tokens each, alternated.
3. Whole greedy jobs (`none` and `ngram` k=5, 128 tokens) with every forward run both ways in turn
   (benchmarks/paired.py): A = passed, B = bound.
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
    ap.add_argument("--steps", nargs="+", default=["1x1", "1x6", "32x1"], help="SLOTSxTOKENS forwards")
    ap.add_argument("--jobs", nargs="*", default=["writing:1", "code_rewrite:1", "summarization:1",
                                                  "code_rewrite:32"])
    ap.add_argument("--prompts", type=int, default=6, help="prompts per job, at least the batch size")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import paddle
    from greedy_screen import timed
    from paired import alternated_forward, paired_jobs
    from spec_bench import load_sets

    from specgen import load_model
    from specgen.engine.types import build_forward_batch

    lm = load_model(None, threads=args.threads)
    model = lm.model
    if not (model.fused_forward and model.bound_forward and model.ops is not None):
        sys.exit("needs the fused forward (specgen's kernels on an AVX-512 CPU)")
    cfg = model.config

    def variant(bound: bool):
        def forward(batch, cache, logits=True):
            model.bound_forward = bound
            try:
                return original(batch, cache, logits=logits)
            finally:
                model.bound_forward = True
        return forward

    original = model.forward_greedy
    passed, bound = variant(False), variant(True)

    # 1. the call alone
    cache = model.new_cache(1, 64)
    model.forward_greedy(build_forward_batch(np.array([0]), np.array([0]), np.array([1]), np.array([5]),
                                             np.ones(1, bool)), cache)  # gathers the arguments, binds
    *weights, q_norm, k_norm = model._columns
    empty = paddle.to_tensor(np.zeros(0, np.int64))
    pk = [model._ones] * len(cache.k)

    def call_passed():
        model.ops.specgen_forward(empty, model.w.embed, *weights, model.cos, model.sin, empty, empty, cache.k,
                                  cache.v, q_norm, k_norm, empty, pk, pk, model.w.final_norm, empty,
                                  model.w.lm_head.panels, model._no_screen, model._no_screen, cfg.num_heads,
                                  cfg.num_kv_heads, cache.capacity, cfg.qk_norm, cfg.rms_norm_eps, 0, model.w.lm_head.n)

    def call_bound():
        model.ops.specgen_forward_bound(empty, model._no_screen, model._no_screen, 0, model._weights_handle(),
                                        model._caches_handle(cache), cfg.num_heads, cfg.num_kv_heads,
                                        cache.capacity, cfg.qk_norm, cfg.rms_norm_eps, 0, model.w.lm_head.n)

    res = {"passed": [], "bound": []}
    for i in range(10):
        for name, fn in (("passed", call_passed), ("bound", call_bound))[:: 1 if i % 2 else -1]:
            fn()
            res[name].append(timed(fn, 100))
    a, b = np.median(res["passed"]) * 1e6, np.median(res["bound"]) * 1e6
    print(f"the call alone (0 tokens): passed {a:.0f} us, bound {b:.0f} us, {a - b:.0f} us saved per call", flush=True)

    # 2. single forwards
    print(f"\n{'forward':>8}{'passed ms':>11}{'bound ms':>10}{'ratio':>8}")
    for step in args.steps:
        a, b = alternated_forward(model, step, passed, bound)
        print(f"{step:>8}{a:>11.2f}{b:>10.2f}{a / b:>7.3f}x", flush=True)

    # 3. whole jobs
    most = max([args.prompts] + [int(j.split(":")[1]) for j in args.jobs])
    sets = load_sets(most, most)

    def same(x, y):
        return np.array_equal(x[2], y[2]) and np.array_equal(x[1].numpy(), y[1].numpy())

    print("\nA = every tensor passed (specgen_forward), B = bound (specgen_forward_bound)")
    paired_jobs(lm, sets, args.jobs, args.prompts, passed, bound, same)


if __name__ == "__main__":
    main()

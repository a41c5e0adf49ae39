"""Token trees against chains (issue 44): n-gram drafting as a chain of k and as a tree of the best distinct
continuations, against plain decoding, on copy-heavy prompt sets; and what moving a tree's accepted path costs.

    python benchmarks/trees.py --sets summarization rag code_rewrite --batch-sizes 1 8 --repeats 2

Greedy, the default model, float32, the fused backend, the adaptive controller on (it picks each slot's k or node
budget). Arms alternate within each repeat; tok/s are the best of the repeats. Per row: tokens per step (accepted
path + 1), nodes (drafts) verified per step, whether outputs equal `none`'s.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from common import load_sets, machine, print_table, timed

ARMS = {  # label -> (method, k, branches, static shape)
    "none": ("none", 3, 1, ()),
    "ngram chain k3": ("ngram", 3, 1, ()),
    "ngram tree 3x3": ("ngram", 3, 3, ()),
    "ngram tree 4x4": ("ngram", 4, 4, ()),
    "ngram static": ("ngram", 4, 3, ("0,0,0,0", "1", "1,0", "2", "0,1")),
}


def spec_of(arm: str):
    from specgen import NgramConfig, SpecConfig

    method, k, branches, shape = ARMS[arm]
    return SpecConfig(method=method, num_speculative_tokens=k, ngram=NgramConfig(branches=branches, tree_choices=shape))


def move_cost(model, slots: int, rows: int, repeats: int = 50) -> float:
    """Seconds of one KVCache.move_rows of `rows` rows in each of `slots` slots (every layer, K and V)."""
    cache = model.model.new_cache(slots, 512)
    cache.reserve(512)
    s = np.repeat(np.arange(slots), rows)
    src = np.tile(np.arange(rows) + 200, slots)
    start = time.perf_counter()
    for _ in range(repeats):
        cache.move_rows(s, src + 3, src)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sets", nargs="+", default=["summarization", "rag", "code_rewrite"])
    p.add_argument("--per-set", type=int, default=4)
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--arms", nargs="+", default=list(ARMS))
    args = p.parse_args()
    from specgen import SamplingParams, generate, load_model
    from specgen.engine.engine import EngineConfig

    print(machine())
    model = load_model(None)
    sets = load_sets(args.per_set, args.per_set)
    sampling = SamplingParams(max_tokens=args.max_tokens)
    rows = []
    for name in args.sets:
        prompts = sets[name]
        for batch in args.batch_sizes:
            best: dict[str, float] = {}
            outs = {}
            for _ in range(args.repeats):
                for arm in args.arms:
                    out, wall = timed(lambda: generate(prompts, model=model, sampling=sampling, speculative=spec_of(arm),
                                                       engine=EngineConfig(batch_size=batch)))
                    tokens = sum(len(o.token_ids) for o in out)
                    best[arm] = max(best.get(arm, 0.0), tokens / wall)
                    outs[arm] = out
            for arm in args.arms:
                out = outs[arm]
                steps = sum(o.stats.num_steps for o in out)
                rows.append([name, batch, arm, best[arm], best[arm] / best["none"] if "none" in best else None,
                             sum(len(o.token_ids) for o in out) / steps,
                             sum(o.stats.num_draft_tokens for o in out) / steps,
                             [o.token_ids for o in out] == [o.token_ids for o in outs[args.arms[0]]]])
            print_table(["set", "batch", "arm", "tok/s", "x none", "tok/step", "nodes/step", "identical"], rows[-len(
                args.arms):])
            print(machine())
    print()
    for slots, n in ((1, 3), (8, 3), (32, 4)):
        print(f"move_rows: {slots} slots x {n} rows: {move_cost(model, slots, n) * 1e6:.0f} us")
    print(machine())


if __name__ == "__main__":
    main()
